"""``python -m jaxflash.bench --mode decode``: attention of a few new
queries over a KV cache, side by side, in bandwidth.

Each shape is a batch of sequences of ``kv_len`` cached keys in pages of
``page_size`` rows (a shuffled page table), and ``q_len`` new queries per
sequence.  The paged implementations read the pages; the others
(cuDNN, XLA through ``jax.nn.dot_product_attention``) the same keys as a
contiguous cache, built outside the timing.  Bandwidth counts the bytes
of K and V the call must read (the valid tokens) over its median time.

A decode call takes microseconds, less than a host dispatch, so on a GPU
each timed program chains :data:`CHAIN` calls (:func:`_chained`) and the
time per call is the program's over the chain.  The calls take turns over
copies of the cache, at least :data:`ROTATE_BYTES` of them together, as a
model's layers each read their own: a cache of a few MB read again and
again would otherwise stay in the GPU's L2 (50 MB on the H100 and the
H200) and measure L2's bandwidth, not HBM's.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import paged, reference
from jaxflash.bench import core

MODE = "decode"
# Calls per timed program on a GPU: back-to-back dispatches of single calls
# measured a floor of about 60 us per call on an H100 for every
# implementation, above the kernels' own time at small shapes
# (docs/benchmarks/h100-2026-12-06-959a87f-paged-decode.md).
CHAIN = 16


# The cache copies a chained program cycles through fill at least this
# many bytes (five times the H100's and the H200's 50 MB L2).
ROTATE_BYTES = 256 << 20
# Arrays of at least this size are copied for the rotation (the caches;
# queries, page tables and scales are shared).
ROTATE_MIN_BYTES = 1 << 20


def _chained(attend: Callable, n: int) -> Callable:
  """``attend`` called ``n`` times in one program (unrolled), call ``i``
  over ``arg_sets[i % len(arg_sets)]`` (copies of the cache), each call's
  queries shifted by ``eps`` times an element of the previous output:
  ``eps`` is a runtime 0.0, so the results do not change, but XLA can
  neither hoist the calls nor run them at once (as consecutive decode
  steps cannot)."""
  def run(eps, q, arg_sets):
    carry = jnp.zeros((), jnp.float32)
    for i in range(n):
      out = attend(q + (eps * carry).astype(q.dtype),
                   *arg_sets[i % len(arg_sets)])
      carry = out.reshape(-1)[0].astype(jnp.float32)
    return carry
  return run


def rotation(args, n: int) -> tuple:
  """``args`` and copies of its large arrays (the caches), enough that
  together they fill :data:`ROTATE_BYTES`, at most ``n`` sets."""
  args = tuple(args)
  big = lambda x: (isinstance(x, jax.Array)
                   and x.size * x.dtype.itemsize >= ROTATE_MIN_BYTES)
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args)
             if big(x))
  sets = min(n, -(-ROTATE_BYTES // size)) if size else 1
  copy = lambda x: jnp.array(x, copy=True) if big(x) else x
  return (args,) + tuple(jax.tree.map(copy, args) for _ in range(sets - 1))


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """One decode benchmark point."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  page_size: int
  dtype: str = "bfloat16"

  @property
  def kv_bytes(self) -> int:
    """Bytes of K and V that the call reads (the valid tokens)."""
    return (2 * self.batch * self.kv_len * self.kv_heads * self.head_dim
            * jnp.dtype(self.dtype).itemsize)


def grid(*, batches, kv_lens, page_sizes, q_lens, heads: int,
         kv_heads: int, head_dim: int, dtype: str = "bfloat16",
         max_cache_bytes: float = 40e9) -> list[DecodeShape]:
  """Every (batch, kv_len, page_size, q_len) whose cache fits
  ``max_cache_bytes``."""
  out = []
  for b in batches:
    for n in kv_lens:
      for p in page_sizes:
        for t in q_lens:
          s = DecodeShape(b, t, n, heads, kv_heads, head_dim, p, dtype)
          if s.kv_bytes <= max_cache_bytes and t <= n:
            out.append(s)
  return out


def inputs(shape: DecodeShape, seed: int = 0):
  """``(q, k_pages, v_pages, page_indices, kv_lengths)``: random values,
  pages in a shuffled order."""
  per_seq = -(-shape.kv_len // shape.page_size)
  num_pages = shape.batch * per_seq
  dt = jnp.dtype(shape.dtype)
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (shape.batch, shape.q_len, shape.heads,
                                shape.head_dim), dt)
  page_shape = (num_pages, shape.page_size, shape.kv_heads, shape.head_dim)
  k_pages = jax.random.normal(ks[1], page_shape, dt)
  v_pages = jax.random.normal(ks[2], page_shape, dt)
  table = jax.random.permutation(ks[3], num_pages).reshape(
      shape.batch, per_seq).astype(jnp.int32)
  lengths = jnp.full((shape.batch,), shape.kv_len, jnp.int32)
  return q, k_pages, v_pages, table, lengths


def _contiguous(k_pages, table, kv_len):
  """The pages of each sequence in order, ``[batch, kv_len, kv_heads,
  head_dim]`` (built outside the timing)."""
  B, M = table.shape
  _, P, K, D = k_pages.shape
  return jnp.take(k_pages, table, axis=0).reshape(B, M * P, K, D)[:, :kv_len]


def _paged(implementation: str, config=None):
  def make(shape: DecodeShape, interpret: bool):
    def attend(q, k_pages, v_pages, table, lengths):
      return jaxflash.paged_attention(q, k_pages, v_pages, table, lengths,
                                      implementation=implementation,
                                      config=config, interpret=interpret)
    return attend, False
  return make


# --paged-variants: each kernel's row name and launch config.
_VARIANT_KERNELS = {"triton": ("jaxflash-paged", "PagedConfig"),
                    "mosaic_gpu": ("jaxflash-paged-mosaic",
                                   "MosaicPagedConfig")}


def parse_paged_variants(text: str) -> dict[str, Callable]:
  """``"mosaic_gpu/st2:stages=2;triton/sp8:splits=8"`` -> rows
  ``jaxflash-paged-mosaic[st2]`` and ``jaxflash-paged[sp8]``: a paged
  kernel (``triton`` or ``mosaic_gpu``) with its launch config's fields
  set (integers; ``none`` for None).  ValueError on an unknown kernel or
  field, a value that is not an integer, or a repeated name."""
  from jaxflash.mosaic_gpu import decode as hopper  # noqa: PLC0415
  from jaxflash.triton import decode as portable  # noqa: PLC0415
  classes = {"PagedConfig": portable.PagedConfig,
             "MosaicPagedConfig": hopper.MosaicPagedConfig}
  out = {}
  for part in filter(None, (p.strip() for p in text.split(";"))):
    head, sep, fields = part.partition(":")
    kernel, _, name = head.strip().partition("/")
    if kernel not in _VARIANT_KERNELS or not name or not sep:
      raise ValueError(f"variant {part!r}: expected KERNEL/NAME:field="
                       f"value,... with KERNEL one of"
                       f" {list(_VARIANT_KERNELS)}")
    row, cls_name = _VARIANT_KERNELS[kernel]
    cls = classes[cls_name]
    known = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for item in filter(None, (i.strip() for i in fields.split(","))):
      field, _, val = item.partition("=")
      field = field.strip()
      if field not in known:
        raise ValueError(f"unknown {cls_name} field {field!r} in {part!r};"
                         f" fields: {sorted(known)}")
      try:
        kw[field] = None if val.strip() == "none" else int(val)
      except ValueError:
        raise ValueError(f"{item!r}: the value must be an integer or"
                         " none") from None
    key = f"{row}[{name}]"
    if key in out:
      raise ValueError(f"variant {key} given twice")
    out[key] = _paged(kernel, cls(**kw))
  return out


def _paged_fp8(shape: DecodeShape, interpret: bool):
  """jaxflash's kernel over the same cache quantized to e4m3 per key/value
  head (outside the timing): one byte per element read."""
  if jnp.dtype(shape.dtype).itemsize != 2:
    raise NotImplementedError("an FP8 cache is read by bf16/fp16 queries")

  def attend(q, k8, v8, table, lengths, k_scale, v_scale):
    return jaxflash.paged_attention(q, k8, v8, table, lengths,
                                    k_scale=k_scale, v_scale=v_scale,
                                    implementation="triton",
                                    interpret=interpret)
  return attend, "fp8"


# --mode mla: multi-head latent attention, DeepSeek's softmax scale.
MLA_MODE = "mla"
MLA_SCALE = 192 ** -0.5


def mla_v_head_dim(head_dim: int) -> int:
  """The latent (value) width of an MLA shape: the largest power of two
  below ``head_dim`` (576 -> 512, DeepSeek's)."""
  return 1 << (head_dim - 1).bit_length() - 1


def _mla(implementation: str, fp8_latent: bool = False):
  def make(shape: DecodeShape, interpret: bool):
    if shape.kv_heads != 1:
      raise NotImplementedError("latent attention has one cache vector per"
                                " token (kv_heads 1)")
    if fp8_latent and jnp.dtype(shape.dtype).itemsize != 2:
      raise NotImplementedError("an FP8 latent is read by bf16/fp16 queries")

    def attend(q, pages, table, lengths):
      return jaxflash.mla_attention(
          q, pages, table, lengths,
          v_head_dim=mla_v_head_dim(shape.head_dim),
          softmax_scale=MLA_SCALE, implementation=implementation,
          interpret=interpret)
    return attend, "mla-fp8" if fp8_latent else "mla"
  return make


def _jax_nn(implementation: str):
  def make(shape: DecodeShape, interpret: bool):
    del interpret
    if shape.q_len != 1:
      # jax.nn's causal mask aligns the queries top-left; the new tokens
      # sit at the end of the cache.
      raise NotImplementedError("jax.nn.dot_product_attention's causal mask"
                                " is top-left aligned: q_len 1 only")

    def attend(q, k, v, lengths):
      return jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=lengths,
          implementation=implementation)
    return attend, True
  return make


def _cudnn_paged(shape: DecodeShape, interpret: bool):
  """cuDNN's paged entry point (private in jax 0.11.2:
  ``jax._src.cudnn.fused_attention_stablehlo.paged_attention``), over the
  same pages and table: it needs a pool of exactly batch x pages per
  sequence blocks (the grid's; no shared pages) and its table as ``[B, 1,
  M, 1]``; a padding mask by the lengths (q_len 1: the one query sees
  every valid key)."""
  if interpret:
    raise NotImplementedError("cuDNN runs on a GPU only")
  if shape.q_len != 1:
    raise NotImplementedError("cuDNN's causal mask is top-left aligned:"
                              " q_len 1 only")
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

  def attend(q, k_pages, v_pages, table, lengths):
    B = q.shape[0]
    pages = table.reshape(B, 1, -1, 1)
    return cudnn_fa.paged_attention(
        q, k_pages, v_pages, jnp.ones((B,), jnp.int32), lengths, pages,
        pages, scale=shape.head_dim ** -0.5,
        mask_type=cudnn_fa.MaskType.PADDING, qkv_layout="BTNH")
  return attend, False


def _pallas_paged(shape: DecodeShape, interpret: bool):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import paged_attention as lib
  if shape.q_len != 1:
    raise NotImplementedError("JAX's Pallas paged_attention decodes q_len 1")
  per_seq = -(-shape.kv_len // shape.page_size)
  splits = math.gcd(per_seq, 16)  # its split count must divide the pages
  block = math.gcd(per_seq // splits, 8)
  scale = shape.head_dim ** -0.5  # it takes the logits unscaled

  def attend(q, k_pages, v_pages, table, lengths):
    # Its layout: [kv_heads, pages, page_size, head_dim] (transposed
    # outside the timing, in run_shape).
    return lib.paged_attention(
        q[:, 0] * jnp.asarray(scale, q.dtype), k_pages, v_pages, table,
        lengths, k_splits=splits, pages_per_compute_block=block,
        interpret=interpret)[:, None]
  return attend, "heads_first"


IMPLS: dict[str, Callable] = {
    "jaxflash-paged": _paged("triton"),
    "jaxflash-paged-mosaic": _paged("mosaic_gpu"),
    "jaxflash-paged-xla": _paged("xla"),
    "jaxflash-paged-fp8": _paged_fp8,
    "cudnn": _jax_nn("cudnn"),
    "xla": _jax_nn("xla"),
    "jax-pallas-paged": _pallas_paged,
    "cudnn-paged": _cudnn_paged,
}
CPU_IMPLS = ("jaxflash-paged", "jaxflash-paged-xla", "xla")
MLA_IMPLS: dict[str, Callable] = {
    "jaxflash-mla": _mla("triton"),
    "jaxflash-mla-xla": _mla("xla"),
    "jaxflash-mla-fp8": _mla("triton", fp8_latent=True),
}
MLA_CPU_IMPLS = ("jaxflash-mla", "jaxflash-mla-xla")  # (float32 smoke)


# Bytes of K and V an implementation reads per element of the shape's
# dtype: the FP8 cache one byte where the others read two; latent
# attention reads its one cache once (FlashMLA's FP8 latent:
# :func:`mla_fp8_bytes_read`).
BYTES_READ = {"jaxflash-paged-fp8": 0.5, **{n: 0.5 for n in MLA_IMPLS}}


def mla_fp8_bytes_read(head_dim: int) -> float:
  """The FP8 latent's bytes per token over a 2-byte K and V's: one byte
  per latent column, a float32 scale per 128, two per rotary column
  (656 of 2304 at DeepSeek's 576)."""
  dv = mla_v_head_dim(head_dim)
  return (dv + 4 * (dv // 128) + 2 * (head_dim - dv)) / (4 * head_dim)


def record(shape: DecodeShape, impl: str, *, ms=None, max_abs_err=None,
           error=None, samples_ms=None) -> dict:
  """One result row: the grid rows' fields (``mode: "decode"``, ``seq_q``
  the new queries, ``seq_k`` the cached keys) with ``q_len``,
  ``page_size`` and ``gbytes_per_s`` (of the bytes it reads:
  :data:`BYTES_READ`)."""
  gbs = tflops = None
  mla = impl in MLA_IMPLS  # one latent cache, read once (BYTES_READ)
  if ms is not None and error is None:
    read = (mla_fp8_bytes_read(shape.head_dim)
            if impl == "jaxflash-mla-fp8" else BYTES_READ.get(impl, 1.0))
    gbs = shape.kv_bytes * read / (ms * 1e-3) / 1e9
    if mla:  # FlashMLA's count: 2 B T H S (head_dim + v_head_dim)
      flops = (2 * shape.batch * shape.q_len * shape.heads * shape.kv_len
               * (shape.head_dim + mla_v_head_dim(shape.head_dim)))
      tflops = flops / (ms * 1e-3) / 1e12
  return dict(impl=impl, model=None, batch=shape.batch, seq_q=shape.q_len,
              seq_k=shape.kv_len, heads=shape.heads,
              kv_heads=shape.kv_heads, head_dim=shape.head_dim, causal=True,
              dtype=shape.dtype, mask=None, mode=MLA_MODE if mla else MODE,
              ms=ms, tflops=tflops,
              peak_bytes=None, max_abs_err=max_abs_err, error=error,
              samples_ms=samples_ms, same_program_as=None, paired_with=None,
              q_len=shape.q_len, page_size=shape.page_size,
              gbytes_per_s=gbs)


def run_shape(shape: DecodeShape, names, *, interpret: bool, samples: int,
              seed: int = 0, sample_seconds: float = 0.02,
              chain: int = CHAIN, extra=None) -> list[dict]:
  """Every implementation at one shape: built and checked against the
  paged reference (sequence 0), then timed in interleaved rounds (on a
  GPU, ``chain`` calls per program: :func:`_chained`).  ``extra``: more
  named implementations (:func:`parse_paged_variants`)."""
  q, k_pages, v_pages, table, lengths = inputs(shape, seed)
  want = np.asarray(reference.paged_attention(
      q[:1], k_pages, v_pages, table[:1], lengths[:1])[0], np.float32)
  tol = 2 ** -6 if shape.dtype == "bfloat16" else 2 ** -8
  contiguous = None
  rows, calls = {}, {}
  for name in names:
    try:
      attend, layout = {**IMPLS, **MLA_IMPLS, **(extra or {})}[name](
          shape, interpret)
      expect = want
      if layout in ("mla", "mla-fp8"):
        # The cache's one vector per token is the key, its first columns
        # the value (FP8: checked against the dequantized cache).
        dv = mla_v_head_dim(shape.head_dim)
        cache = pages = k_pages[:, :, 0]
        if layout == "mla-fp8":
          cache = paged.quantize_latent(pages, v_head_dim=dv)
          pages = cache.dequantize(q.dtype)
        args = (q, cache, table, lengths)
        expect = np.asarray(reference.paged_attention(
            q[:1], pages[:, :, None], pages[:, :, None, :dv], table[:1],
            lengths[:1], softmax_scale=MLA_SCALE)[0], np.float32)
      elif layout == "fp8":
        # Checked against the reference of the dequantized pages.
        (k8, ks), (v8, vs) = (jaxflash.quantize_fp8(x, axis=2)
                              for x in (k_pages, v_pages))
        args = (q, k8, v8, table, lengths, ks, vs)
        expect = np.asarray(reference.paged_attention(
            q[:1], k8, v8, table[:1], lengths[:1], k_scale=ks,
            v_scale=vs)[0], np.float32)
      elif layout is True:  # a contiguous cache
        if contiguous is None:
          contiguous = tuple(_contiguous(x, table, shape.kv_len)
                             for x in (k_pages, v_pages))
        args = (q, *contiguous, lengths)
      elif layout == "heads_first":
        args = (q, jnp.moveaxis(k_pages, 2, 0), jnp.moveaxis(v_pages, 2, 0),
                table, lengths)
      else:
        args = (q, k_pages, v_pages, table, lengths)
      fn = jax.jit(attend).trace(*args).lower().compile()
      got = np.asarray(fn(*args)[:1], np.float32)
      err = float(np.max(np.abs(got - expect))) if got.size else 0.0
      if not np.isfinite(err) or err > tol * max(1.0,
                                                 np.abs(expect).max()):
        rows[name] = record(shape, name, max_abs_err=err,
                            error=f"wrong result: max_abs_err {err:.3g}")
        continue
      if not interpret:
        chained = (jnp.zeros((), jnp.float32), args[0],
                   rotation(args[1:], chain))
        calls[name] = (jax.jit(_chained(attend, chain)).trace(
            *chained).lower().compile(), chained)
      else:
        calls[name] = (fn, args)
      rows[name] = err
    except Exception as e:  # noqa: BLE001 - every failure is a reported row
      rows[name] = record(shape, name,
                          error=f"{type(e).__name__}: {e}".splitlines()[0]
                          [:300])
  per_round = {}
  times = core.time_interleaved(calls, samples=samples,
                                min_sample_s=sample_seconds,
                                seed=f"{seed}:{shape}",
                                samples_out=per_round)
  per_call = 1 if interpret else chain
  for name, secs in times.items():
    if isinstance(secs, Exception):
      rows[name] = record(shape, name, error=f"{type(secs).__name__}:"
                          f" {secs}".splitlines()[0][:300])
    else:
      rows[name] = record(
          shape, name, ms=secs / per_call * 1e3, max_abs_err=rows[name],
          samples_ms=[t / per_call * 1e3 for t in per_round[name]])
  return [rows[name] for name in names]


def table(results: list[dict]) -> str:
  """Bandwidth per row, and jaxflash's over the best other
  implementation of the shape."""
  key = lambda r: (r["batch"], r["seq_k"], r["page_size"], r["q_len"])
  best = {}
  for r in results:
    if not r["impl"].startswith("jaxflash") and r["gbytes_per_s"]:
      best[key(r)] = max(best.get(key(r), (None, 0.0)),
                         (r["impl"], r["gbytes_per_s"]), key=lambda x: x[1])
  lines = [f"{'batch':>5} {'kv_len':>7} {'page':>4} {'q_len':>5}"
           f" {'impl':20} {'ms':>9} {'GB/s':>8}  ratio to best other"]
  for r in results:
    b = best.get(key(r))
    ratio = ("-" if not (r["impl"].startswith("jaxflash") and b
                         and r["gbytes_per_s"])
             else f"{r['gbytes_per_s'] / b[1]:.2f} vs {b[0]}")
    ms = "-" if r["ms"] is None else f"{r['ms']:.4f}"
    gbs = "-" if r["gbytes_per_s"] is None else f"{r['gbytes_per_s']:.1f}"
    lines.append(f"{r['batch']:>5} {r['seq_k']:>7} {r['page_size']:>4}"
                 f" {r['q_len']:>5} {r['impl']:20} {ms:>9} {gbs:>8}  "
                 f"{ratio if not r['error'] else r['error'][:60]}")
  return "\n".join(lines)


def plot(path: str, results: list[dict]) -> bool:
  """Bandwidth against kv_len, one panel per (batch, page_size, q_len).
  Returns False when matplotlib is missing or nothing was timed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  panels = sorted({(r["batch"], r["page_size"], r["q_len"]) for r in results
                   if r["gbytes_per_s"]})
  if not panels:
    return False
  ncol = min(4, len(panels))
  nrow = -(-len(panels) // ncol)
  fig, axes = plt.subplots(nrow, ncol, figsize=(4 * ncol, 3.2 * nrow),
                           squeeze=False)
  for ax, (b, p, t) in zip(axes.flat, panels):
    for impl in sorted({r["impl"] for r in results}):
      pts = sorted((r["seq_k"], r["gbytes_per_s"]) for r in results
                   if (r["batch"], r["page_size"], r["q_len"]) == (b, p, t)
                   and r["impl"] == impl and r["gbytes_per_s"])
      if pts:
        ax.plot(*zip(*pts), "-o" if impl.startswith("jaxflash") else "--.",
                label=impl)
    ax.set_xscale("log", base=2)
    ax.set_title(f"batch {b}, page {p}, q_len {t}", fontsize=9)
    ax.set_xlabel("kv_len")
    ax.set_ylabel("GB/s (K and V read)")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True
