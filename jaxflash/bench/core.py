"""Benchmark grid, FLOP counting, timing and result records."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess

import jax.numpy as jnp

from jaxflash._timing import time_fn as time_fn
from jaxflash._timing import time_interleaved as time_interleaved
from jaxflash._timing import williams_orders as williams_orders

FLOP_FORMULA = (
    "forward FLOPs = 4 * batch * heads * seq_q * seq_k * head_dim, halved "
    "when causal; forward+backward = 3.5 x forward (FlashAttention's "
    "convention); TFLOP/s = FLOPs / median time")

MODES = ("fwd", "fwd_bwd")


@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmark point."""

  batch: int
  seq_q: int
  seq_k: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool
  dtype: str = "bfloat16"
  # None, "segments:N", "window:L", "bias", "dense-segments:N" or
  # "flashmask-doc:N" (parse_mask)
  mask: str | None = None
  model: str | None = None  # the MODELS entry it was taken from

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)


def flops(shape: Shape, mode: str) -> float:
  """FLOPs of one call, by the convention of :data:`FLOP_FORMULA`.

  Masks other than causal are not discounted: the figure is the dense
  (or causal) work, so a skipping kernel shows as a higher TFLOP/s.
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} must be one of {MODES}")
  f = 4.0 * shape.batch * shape.heads * shape.seq_q * shape.seq_k * (
      shape.head_dim)
  if shape.causal:
    f /= 2
  return f * (3.5 if mode == "fwd_bwd" else 1.0)


def parse_int_list(text: str) -> list[int]:
  """``"64,128"`` -> ``[64, 128]``; ValueError with the text otherwise."""
  try:
    vals = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ValueError(
        f"expected comma-separated integers, got {text!r}") from None
  if not vals or any(v <= 0 for v in vals):
    raise ValueError(f"expected positive integers, got {text!r}")
  return vals


def parse_causal(text: str) -> list[bool]:
  table = {"both": [False, True], "on": [True], "off": [False],
           "y": [True], "n": [False], "true": [True], "false": [False]}
  if text.lower() not in table:
    raise ValueError(f"causal={text!r} must be one of both, on, off")
  return table[text.lower()]


def parse_mask(text: str | None) -> str | None:
  if text in (None, "", "none"):
    return None
  kind, _, arg = text.partition(":")
  if text == "bias" or (kind in ("segments", "window", "dense-segments")
                        + FLASHMASK_KINDS
                        and arg.isdigit() and int(arg) >= 1):
    return text
  if kind == "dropout" and arg.isdigit() and 1 <= int(arg) <= 99:
    return text
  raise ValueError(
      f"mask={text!r} must be none, segments:N (N documents per row),"
      " window:L (sliding window of L keys, causal), bias (a dense bias per"
      " head, differentiated in fwd_bwd), dense-segments:N (segments:N"
      " as a dense boolean mask) or a FlashMask pattern: flashmask-doc:N"
      " (N causal documents), flashmask-prefix:N (prefix-LM, prefix of"
      " seq / N), flashmask-question:N (a shared question and N answers),"
      " flashmask-window:L (64 global tokens and a causal window of L),"
      " flashmask-block:N (N bidirectional documents), or dropout:P"
      " (attention dropout of P percent, 1-99)")


# FlashMask patterns of the benchmark (jaxflash.bench.impls.mask_kwargs);
# each holds its own causality, so they are meant for --causal off.
FLASHMASK_KINDS = ("flashmask-doc", "flashmask-prefix", "flashmask-question",
                   "flashmask-window", "flashmask-block")


def grid(*, head_dims, seqs, causal, tokens: int, width: int, kv_ratio=1,
         dtype="bfloat16", mask=None) -> list[Shape]:
  """The anchor grid: ``tokens`` per call (batch = tokens / seq) and a model
  ``width`` (heads = width / head_dim), ``kv_ratio`` query heads per
  key/value head."""
  shapes = []
  for d in head_dims:
    if width % d:
      raise ValueError(f"width={width} is not a multiple of head_dim={d}")
    heads = width // d
    if heads % kv_ratio:
      raise ValueError(f"heads={heads} not divisible by kv_ratio={kv_ratio}")
    for s in seqs:
      batch = max(1, tokens // s)
      for c in causal:
        shapes.append(Shape(batch, s, s, heads, heads // kv_ratio, d, c,
                            dtype, mask))
  return shapes


# The "models" shape set: attention calls of released models, with heads,
# key/value heads and head_dim as published (a tensor-parallel shard where
# named), at batch sizes and lengths of training and prefill.
# (name, batch, seq, heads, kv_heads, head_dim, causal, mask, source)
MODELS = (
    ("gpt2-small", 8, 2048, 12, 12, 64, True, None,
     "GPT-2 124M: 12 heads of 64"),
    ("gpt2-medium", 8, 1024, 16, 16, 64, True, None,
     "GPT-2 355M: 16 heads of 64"),
    ("llama3-8b", 1, 8192, 32, 8, 128, True, None,
     "Llama 3 8B: 32 heads, 8 kv heads, 128"),
    ("llama3-8b-b16-s512", 16, 512, 32, 8, 128, True, None,
     "Llama 3 8B, short batches"),
    ("llama3-70b-tp8", 2, 8192, 8, 1, 128, True, None,
     "Llama 3 70B (64 heads, 8 kv heads) on 8 tensor-parallel shards"),
    ("mistral-7b-window", 1, 16384, 32, 8, 128, True, "window:4096",
     "Mistral 7B v0.1: 32 heads, 8 kv heads, sliding window 4096"),
    ("gemma2-9b", 2, 4096, 16, 8, 256, True, None,
     "Gemma 2 9B: 16 heads, 8 kv heads, 256 (global layers)"),
    ("gemma2-2b-window", 4, 8192, 8, 4, 256, True, "window:4096",
     "Gemma 2 2B: 8 heads, 4 kv heads, 256 (local layers)"),
    ("qwen2.5-7b", 1, 32768, 28, 4, 128, True, None,
     "Qwen 2.5 7B: 28 heads, 4 kv heads, 128"),
    ("qwen2.5-0.5b", 4, 4096, 14, 2, 64, True, None,
     "Qwen 2.5 0.5B: 14 heads, 2 kv heads, 64"),
    ("phi3-mini", 2, 4096, 32, 32, 96, True, None,
     "Phi-3 mini: 32 heads of 96"),
    ("phi2", 4, 2048, 32, 32, 80, True, None, "Phi-2: 32 heads of 80"),
    ("vit-b16-384", 32, 577, 12, 12, 64, False, None,
     "ViT-B/16 at 384 px: 577 tokens, 12 heads of 64"),
)


def models(names=None, dtype: str = "bfloat16") -> list[Shape]:
  """The :data:`MODELS` shapes (those named in ``names``, in its order,
  where given; ValueError for a name it does not list)."""
  known = [m[0] for m in MODELS]
  unknown = sorted(set(names or ()) - set(known))
  if unknown:
    raise ValueError(f"unknown models {unknown}; known: {known}")
  return [Shape(b, s, s, h, kh, d, c, dtype, mask, name)
          for name, b, s, h, kh, d, c, mask, _ in MODELS
          if not names or name in names]


def parse_shapes(text: str, dtype: str = "bfloat16") -> list[Shape] | None:
  """``--shapes``: ``grid`` (None: the grid options decide), ``models`` or
  ``models:NAME,NAME``."""
  kind, _, names = text.partition(":")
  if kind == "grid" and not names:
    return None
  if kind != "models":
    raise ValueError(f"shapes={text!r} must be grid, models or"
                     " models:NAME,...")
  return models([n.strip() for n in names.split(",") if n.strip()] or None,
                dtype)


def compiled_bytes(compiled) -> int | None:
  """Device memory one call needs: arguments + outputs + temporaries, from
  XLA's memory analysis of a compiled executable (``jax.stages.Compiled``;
  None where the backend has no analysis)."""
  try:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes
               + m.temp_size_in_bytes - m.alias_size_in_bytes)
  except Exception:  # noqa: BLE001 - backends without the analysis
    return None


def program_fingerprint(jaxpr) -> str:
  """A hash of a traced program (``jax.jit(f).trace(...).jaxpr``, the
  kernels' own programs included) with the Hopper configs' reprs left
  out, the normalisation of tools/kernel_fingerprint.py (which keeps its
  own copy: it runs against older trees).  Two Hopper variants with one
  hash build the same kernels: their overrides do nothing on this call
  (an option for the persistent grid on a config without it)."""
  text = str(jaxpr)
  text = re.sub(r"MosaicConfig\([^)]*\)", "MosaicConfig()", text)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def record(shape: Shape, impl: str, mode: str, *, ms=None, peak_bytes=None,
           max_abs_err=None, error=None, samples_ms=None,
           same_program_as=None, paired_with=None,
           tiles_skipped=None) -> dict:
  """One result row of the JSON schema (docs/benchmarks/README.md);
  ``samples_ms``: the timed rounds' milliseconds per call, in round
  order (``ms`` is their median); ``same_program_as``: an earlier row of
  the shape and mode whose traced program this row's equals (Hopper
  variants only, :func:`program_fingerprint`); ``paired_with``: the row
  a variant's paired ratios are taken against, where not its base row
  (``--tuned-for``: the first variant); ``tiles_skipped``: the fraction
  of 128 x 128 tiles the shape's mask leaves empty
  (:func:`jaxflash.bench.impls.tiles_skipped`)."""
  tflops = None
  if ms is not None and error is None:
    tflops = flops(shape, mode) / (ms * 1e-3) / 1e12
  return dict(impl=impl, model=shape.model, batch=shape.batch,
              seq_q=shape.seq_q, seq_k=shape.seq_k, heads=shape.heads,
              kv_heads=shape.kv_heads,
              head_dim=shape.head_dim, causal=shape.causal, dtype=shape.dtype,
              mask=shape.mask, mode=mode, ms=ms, tflops=tflops,
              peak_bytes=peak_bytes, max_abs_err=max_abs_err, error=error,
              samples_ms=samples_ms, same_program_as=same_program_as,
              paired_with=paired_with, tiles_skipped=tiles_skipped)


def commit() -> str:
  """The jaxflash tree's commit, with ``+dirty`` where tracked files differ
  from it.  A copy of the tree (e.g. on a remote GPU machine) may carry a
  stale .git, which then shows as ``+dirty``: ``JAXFLASH_COMMIT`` names
  the commit the tree is at and wins."""
  if os.environ.get("JAXFLASH_COMMIT"):
    return os.environ["JAXFLASH_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))

  def git(*args):
    return subprocess.run(["git", *args], cwd=here, capture_output=True,
                          text=True, check=True).stdout.strip()

  try:
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")
