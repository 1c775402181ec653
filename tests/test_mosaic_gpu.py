"""The Hopper (Mosaic GPU) forward and backward kernels.

On CPU they run in the Mosaic GPU interpreter with race detection
(``InterpretGPUParams(detect_races=True)``): TMA, barriers, wgmma, one, two
(with the ping-pong schedule barrier) or three consumer warpgroups.  The ``gpu``
variants compile them for the H200, including the register-operand ``P V``
form the interpreter cannot run.  Gradients go through the Hopper dK/dV and
dQ kernels (padded head_dim <= 128, or with ``bwd_paired_dkv``; the dense
terms and dropout in the unpaired kernels), else the Triton backward
kernels.  A race the detector reports fails the test
(the detector only prints; ``_no_races`` reads the output).

Each interpreter run (:class:`Run`) runs the forward kernel, the backward
kernels or both; no two build the same kernels, and the PER_COMMIT runs
reach every kernel line that any run reaches (tests/kernel_coverage.py,
test_per_commit_runs_reach_every_kernel_line); the others are ``slow``.
"""

import contextlib
import dataclasses
import functools
import zlib
from typing import Any

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import kernel_coverage
import numerics
import numpy as np
import pytest
from jax.sharding import AxisType

import jaxflash
from jaxflash import backends, masks, mosaic_gpu
from jaxflash._util import round_up
from jaxflash.mosaic_gpu import backend as mosaic_kernels
from jaxflash.mosaic_gpu import forward as fwd_lib
from jaxflash.mosaic_gpu import pipeline
from jaxflash.mosaic_gpu.config import (
  head_dim_problem,
  needed_smem_bytes,
  parse_overrides,
)

# The Mosaic GPU op (kernels, VJP, vmap, partitioning) without the dispatch's
# device check: the interpreter and CPU lowerings run it here.
mosaic_attention = functools.partial(backends.attention, "mosaic_gpu")

RACES = plgpu.InterpretGPUParams(detect_races=True)

# The interpreter runs (Run, below) run on every commit: a greedy set
# cover of the kernel lines that all runs reach while they are traced
# (tests/kernel_coverage.py; the others are ``slow``).
PER_COMMIT = (
    'fp8-e5m2-persistent-overlap',
    'kv_multicast+item_overlap-d64-full',
    'item_overlap+q_double_buffer-d192-q113-k17',
    'intra_wg_overlap+prefetch_q-d256-causal-q300-k100',
    'terms-bwd-documents-2wg',
    'bwd_dkv_block_q_80+early_dv-d96-gqa-q200-k300',
    'softmax-overlap-d256-paired-dkv',
    'item_overlap_plain_one_wg-d128-full-6tiles',
    'bias-packed-flashmask',
    'paired-dq-d64',
    'bwd_paired_dq+dkv-d96-gqa-q200-k300',
    'kv_multicast-d192-q113-k17',
    'persistent_pairs-d256-causal-q300-k100',
    'three_wgs+item_overlap_plain+q_double_buffer-d64-gqa-q330-k300',
    'bwd_paired_dq-d256-split-dkv-gqa',
    'item_overlap_plain-d192-q113-k17',
    'dense-keys-persistent',
    'bias-dbias-full-2wg',
    'intra_wg_overlap+prefetch_q-d64-persistent-2wg-causal',
    'fp8-causal-2wg',
    'item_overlap+q_double_buffer-d128-full-6tiles',
    'bias-row-overlap',
    'persistent_pairs+intra_wg_overlap+lean_epilogue-d64-persistent-2wg-causal',
    'persistent_pairs+intra_wg_overlap+lean_epilogue-d96-gqa-q200-k300',
    'rescale_threshold+intra_wg_overlap-d256-causal-q300-k100',
    'dense-documents-overlap',
    'bwd_head_splits=1-d96-gqa-q200-k300',
    'kv_multicast+persistent-d128-mqa-2wg',
    'bwd_early_dv-d64-causal-2wg',
    'bias-dbias-row-segments-fp16',
    'alibi-causal-2wg',
    'dropout-overlap-shared',
    'prefetch_q-d192-q113-k17',
    'terms-bwd-keys-1wg',
    'paired-dkv-d256',
    'rescale_threshold-d64-causal-2wg',
    'rescale_threshold-d96-gqa-q200-k300',
    'bwd_paired_dq-d64-causal-2wg',
    'bwd_paired_dq-d96-gqa-q200-k300',
    'paired-dkv-d64',
    'lean_epilogue-d192-q113-k17',
    'lean_epilogue-d256-causal-q300-k100',
    'intra_wg_overlap+prefetch_q+early_q_release-d256-causal-q300-k100',
    'bwd_dkv_block_q_80-d64-causal-2wg',
    'flashmask-prefix-2wg',
    'bwd_dkv_block_q_80-d128-window',
)


@pytest.fixture(autouse=True)
def _no_races(capfd):
  """jax's race detector prints "RACE DETECTED" and carries on: fail on
  it."""
  yield
  out, err = capfd.readouterr()
  races = (out + err).split("RACE DETECTED")[1:]
  assert not races, out + err


ONE_WG = mosaic_gpu.INTERPRET_CONFIG
TWO_WG = mosaic_gpu.MosaicConfig(block_q=64, block_kv=64, stages=2,
                                 compute_wgs=2, p_in_smem=True,
                                 schedule_barrier=True)
DEEP = mosaic_gpu.MosaicConfig(block_q=64, block_kv=64, stages=4,
                               compute_wgs=2, p_in_smem=True,
                               schedule_barrier=True)

# The Hopper backward at head_dim 256: the paired dK/dV kernel beside the
# one-consumer dQ kernel.
PAIRED_DKV = dataclasses.replace(ONE_WG, bwd_paired_dkv=True)

PERSISTENT = dataclasses.replace(ONE_WG, persistent=True)
PERSISTENT_2WG = dataclasses.replace(TWO_WG, persistent=True, stages=3)

# (name, q_len, kv_len, heads, kv_heads, head_dim, dtype, causal, window, cfg)
CASES = [
    ("d64-full", 256, 256, 2, 2, 64, jnp.bfloat16, False, None, ONE_WG),
    ("d64-causal-2wg", 256, 256, 4, 2, 64, jnp.bfloat16, True, None, TWO_WG),
    ("d96-gqa-q200-k300", 200, 300, 4, 2, 96, jnp.float16, True, None,
     ONE_WG),
    ("d128-mqa-2wg", 130, 130, 4, 1, 128, jnp.bfloat16, False, None, TWO_WG),
    ("d128-window", 257, 257, 2, 1, 128, jnp.bfloat16, True, (70, 0),
     TWO_WG),
    ("d192-q113-k17", 113, 17, 2, 2, 192, jnp.float16, False, None, ONE_WG),
    ("d256-causal-q300-k100", 300, 100, 2, 1, 256, jnp.bfloat16, True, None,
     ONE_WG),
    ("d64-len1", 1, 1, 2, 1, 64, jnp.bfloat16, False, None, TWO_WG),
    # Several fully visible key tiles per consumer at head_dim 128: the
    # unmasked loop's later steps (a config that used Q from registers
    # went wrong from the second such tile on the H200, and no other case
    # had one; docs/benchmarks/h200-2026-12-02-2c0e534-q-in-regs.md).
    ("d128-full-6tiles", 128, 384, 2, 2, 128, jnp.bfloat16, False, None,
     TWO_WG),
    ("d64-stages4-short", 64, 128, 2, 2, 64, jnp.bfloat16, False, None,
     DEEP),
    ("d64-stages4-window-far", 384, 384, 2, 2, 64, jnp.bfloat16, False,
     (10, 10), DEEP),
    ("d32-tiny-window-empty", 100, 100, 2, 2, 32, jnp.bfloat16, True, (0, 0),
     TWO_WG),
    # The Hopper backward at head_dim 256 (PAIRED_DKV).
    ("d256-split-dkv-gqa", 130, 200, 4, 2, 256, jnp.bfloat16, True, None,
     PAIRED_DKV),
    ("d64-2wg-window-f16", 200, 200, 2, 1, 64, jnp.float16, False,
     (30, 40), TWO_WG),
    # Persistent grid: 2 programs, each looping over several work items
    # with the K/V ring running on across them.
    ("d64-persistent-2wg-causal", 256, 256, 4, 2, 64, jnp.bfloat16, True,
     None, PERSISTENT_2WG),
    ("d128-persistent-window-q200-k300", 200, 300, 2, 1, 128, jnp.float16,
     False, (50, 20), PERSISTENT),
]


def _case_fn(case, interpret, config):
  """The Hopper attention of a case (its mask and scale): ``(q, k, v) ->
  (out, lse)``."""
  _, t, s, _, _, d, _, causal, window, _ = case
  spec = masks.MaskSpec(t, s, causal, None, *(window or (None, None)))

  def fn(q, k, v):
    return mosaic_attention(q, k, v, mask=spec, softmax_scale=d ** -0.5,
                                config=config, interpret=interpret)
  return fn


def _run(case, interpret, config):
  _, t, s, h, kh, d, dtype, causal, window, _ = case
  args = numerics.random_inputs(
      jax.random.key(zlib.crc32(case[0].encode())), batch=2, q_len=t,
      kv_len=s, heads=h, kv_heads=kh, head_dim=d, dtype=dtype)
  got = numerics.outputs_and_grads(_case_fn(case, interpret, config), *args)
  numerics.check_rule(got, *args, causal=causal,
                      window=window or (None, None))


@contextlib.contextmanager
def _forward_spy(name: str):
  """Records each answer of ``forward.<name>`` while the block traces
  kernels: ``_chains_items`` (whether the forward's loop runs on across
  work items, ``item_overlap``).  jax's caches are cleared
  first: a call traced before (another test's, in this worker) would not
  be traced again."""
  jax.clear_caches()
  seen, real = [], getattr(fwd_lib, name)

  def spy(*args, **kwargs):
    seen.append(real(*args, **kwargs))
    return seen[-1]
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(fwd_lib, name, spy)
    yield seen


# -- interpreter runs ----------------------------------------------------------
#
# Every run of the kernels in the interpreter with race detection is a Run:
# the CASES, each kernel option of INTERPRET_VARIANTS over the cases that
# exercise it, the segment-id forms (SEG_CASES) and the soft-cap forms
# (_SOFT_CAP_FORMS).  A forward option (a MosaicConfig field not starting
# with ``bwd_``) leaves the backward kernels as they are, so its runs run
# the forward kernel only; a backward option's runs run the backward
# kernels only, from the reference's residuals.  No two runs build the
# same kernels.  PER_COMMIT (below) run on every commit, the others are
# ``slow``: test_per_commit_runs_reach_every_kernel_line checks both.


@dataclasses.dataclass(frozen=True)
class Run:
  """One interpreter run: its inputs, mask, config and the part of the
  Hopper kernels it runs: ``fwd`` (the forward kernel; out and LSE by the
  numerics rule), ``bwd`` (the dQ and dK/dV kernels from the float32
  reference's out, cast to the input dtype, and LSE; dq, dk, dv by the
  rule) or ``fwd+bwd`` (both, through the op's VJP; all five)."""
  name: str
  part: str
  shape: tuple  # (batch, q_len, kv_len, heads, kv_heads, head_dim)
  dtype: Any
  config: mosaic_gpu.MosaicConfig
  seed: int
  causal: bool = False
  window: tuple | None = None
  segments: dict | None = None  # SEG_CASES' documents and lengths
  flash: str | None = None  # a FLASH_PATTERNS FlashMask
  alibi: bool = False  # ALiBi slopes 2^-1, 2^-2, ... per head
  bias: str | None = None  # a dense bias per "head", per "batch" row,
  # "full" (both), or one "row" of keys per batch row (a key padding bias)
  bias_grad: bool = False  # the "bwd" part returns dbias too (checked)
  dense: str | None = None  # a dense boolean mask: "documents" per batch
  # row with holes, random per "head", or one row of "keys" per batch row
  dropout: float = 0.0  # attention dropout's rate (seeds per batch row)
  dropout_shared: bool = False  # one keep mask for every head
  soft_cap: float | None = None
  softmax_scale: float | None = None  # None: head_dim ** -0.5
  # FP8 (the forward only): q in e4m3 (``dtype``), k and v in this format,
  # quantized per head from the run's normal inputs.
  fp8_kv: Any = None

  @property
  def scale(self) -> float:
    return self.softmax_scale or self.shape[5] ** -0.5

  @property
  def spec(self) -> masks.MaskSpec:
    _, t, s, *_ = self.shape
    return masks.MaskSpec(t, s, self.causal, None,
                          *(self.window or (None, None)))


def _case_run(case, part=None, config=None, name=None) -> Run:
  """A CASES (or VARIANT_CASES) entry as a Run, with its own config or
  ``config``: both parts where the Hopper backward serves it (else the
  Triton backward would run: the forward only), or ``part``."""
  cname, t, s, h, kh, d, dtype, causal, window, cfg = case
  run = Run(name or cname, part or "fwd+bwd", (2, t, s, h, kh, d), dtype,
            config or cfg, zlib.crc32(cname.encode()), causal, window)
  if part is None and not _serves_backward(run):
    run = dataclasses.replace(run, part="fwd")
  return run


def _serves_backward(run: Run) -> bool:
  b, t, s, h, kh, d = run.shape
  return mosaic_gpu.serves_backward(
      jax.ShapeDtypeStruct((b, t, h, d), run.dtype),
      jax.ShapeDtypeStruct((b, s, kh, d), run.dtype), mask=run.spec,
      config=run.config, interpret=RACES, arrays=_mask_arrays(run)[0],
      bias_grad=run.bias_grad, dropout_rate=run.dropout)


def _mask_arrays(run: Run):
  """The run's segment ids and lengths: the kernels' MaskArrays and the
  reference's keywords."""
  from test_mask_features import packed_segments
  seg = run.segments or {}
  arrays, ref_kw = {}, {}
  if "docs" in seg:
    ids = packed_segments(jax.random.key(3), run.shape[0], run.shape[1],
                          seg["docs"], pad_tail=seg["pad"])
    arrays.update(q_segment_ids=ids, kv_segment_ids=ids)
    ref_kw["segment_ids"] = (ids, ids)
  for side in ("q", "kv"):
    if f"{side}_len" in seg:
      arrays[f"{side}_seq_lengths"] = ref_kw[f"{side}_seq_lengths"] = (
          jnp.array(seg[f"{side}_len"]))
  if run.flash is not None:
    b, t, s = run.shape[:3]
    fm = FLASH_PATTERNS[run.flash](b, t).check(b, run.shape[3], t, s)
    arrays["flash_mask"] = jaxflash.flashmask.columns(fm)
    ref_kw["dense_mask"] = fm.dense(t)
  if run.alibi:
    _, t, s, h = run.shape[:4]
    slopes = 2.0 ** -jnp.arange(1, h + 1, dtype=jnp.float32)
    arrays["alibi_slopes"] = jnp.stack(
        [slopes, jnp.zeros_like(slopes)], -1)[None, :, None, :]
    ref_kw["bias"] = masks.alibi_bias(
        slopes[None, :, None, None], jnp.arange(t)[:, None],
        jnp.arange(s)[None, :], run.spec.offset)
  if run.bias is not None:
    # In the inputs' precision, as the kernels read it: a "bwd" run's
    # residuals come from the reference, so its LSE must be of the bias
    # the kernels add.
    arrays["bias"] = ref_kw["bias"] = _dense_bias(run).astype(
        run.dtype).astype(jnp.float32)
  if run.dense is not None:
    arrays["dense_mask"] = ref_kw["dense_mask"] = _dense_mask(run)
  if run.dropout:
    # (seed, first head, first row, first key) per batch row: a shard's
    # offsets, as a context-parallel piece passes them.
    seeds = jnp.asarray([[7, 0, 0, 0], [-3, 1, 5, 9]][:run.shape[0]],
                        jnp.int32)
    arrays["dropout_seeds"] = ref_kw["dropout_seeds"] = seeds
    ref_kw.update(dropout_rate=run.dropout,
                  dropout_shared=run.dropout_shared)
  return masks.MaskArrays(**arrays), ref_kw


def _dense_bias(run: Run):
  """A float32 bias ``[1, H, T, S]`` ("head"), ``[B, 1, T, S]``
  ("batch"), ``[B, H, T, S]`` ("full") or ``[B, 1, 1, S]`` ("row") of
  normal values, with -inf on a few keys of every row; but for "row", on
  all of query row 3 too (a row that sees nothing: output 0, LSE -inf)."""
  b, t, s, h = run.shape[:4]
  shape = {"head": (1, h, t, s), "batch": (b, 1, t, s),
           "full": (b, h, t, s), "row": (b, 1, 1, s)}[run.bias]
  bias = 2.0 * jax.random.normal(jax.random.key(run.seed + 40), shape)
  hidden = jax.random.bernoulli(jax.random.key(run.seed + 41), 0.05, shape)
  bias = jnp.where(hidden, -jnp.inf, bias)
  return bias if run.bias == "row" else bias.at[:, :, 3].set(-jnp.inf)


def _dense_mask(run: Run):
  """A boolean mask: "documents" ``[B, 1, T, S]`` (documents of 90 keys,
  shifted per batch row, with 3% of pairs hidden inside the second),
  "head" ``[1, H, T, S]`` (each pair hidden with probability 0.2, all of
  query row 3 hidden: a row that sees nothing) or "keys" ``[B, 1, 1, S]``
  (the last 37 keys of batch row 1 hidden: a key padding mask)."""
  b, t, s, h = run.shape[:4]
  key = jax.random.key(run.seed + 50)
  if run.dense == "documents":
    doc_q = (jnp.arange(t)[None, :] + 30 * jnp.arange(b)[:, None]) // 90
    doc_k = (jnp.arange(s)[None, :] + 30 * jnp.arange(b)[:, None]) // 90
    same = doc_q[:, :, None] == doc_k[:, None, :]
    holes = jax.random.bernoulli(key, 0.03, same.shape) & (
        doc_q[:, :, None] == 1)
    return (same & ~holes)[:, None]
  if run.dense == "head":
    keep = ~jax.random.bernoulli(key, 0.2, (1, h, t, s))
    return keep.at[:, :, 3].set(False)
  keys = jnp.arange(s)[None, :] < jnp.asarray([s, s - 37][:b])[:, None]
  return keys[:, None, None, :]


# FlashMasks shared by the heads, ``(batch, seq) -> FlashMask``: the forms
# the Hopper kernels take (:data:`FLASH_RUNS`).
FLASH_PATTERNS = {
    # With lt_end given (to the end, as its absence means): all four
    # fields, so pipeline.flash_visible reads and compares each.
    "prefix": lambda b, t: dataclasses.replace(
        jaxflash.FlashMask.prefix_lm(jnp.asarray([t // 3, t - 5][:b]), t),
        lt_end=jnp.full((b, 1, t), t, jnp.int32)),
    "question": lambda b, t: jaxflash.FlashMask.shared_question(
        jnp.broadcast_to(jnp.minimum(jnp.arange(t) // (t // 4), 3), (b, t))),
    "blocks": lambda b, t: jaxflash.FlashMask.document(
        jnp.broadcast_to(jnp.arange(t) // 70, (b, t))),
    # Documents longer than the tiles: runs of fully visible tiles between
    # partial ones at the document edges and the diagonal.
    "documents": lambda b, t: jaxflash.FlashMask.document(
        jnp.broadcast_to(jnp.arange(t) // 300, (b, t))),
    # 16 global keys and a causal window of 90: the tiles between the
    # global tile and a row's window are a gap the forward skips.
    "global-window": lambda b, t: jaxflash.FlashMask.global_and_window(
        t, 16, 90),
}


def _kernel_kwargs(run: Run) -> dict:
  kw = dict(mask=run.spec, softmax_scale=run.scale,
            logits_soft_cap=run.soft_cap, config=run.config,
            interpret=RACES)
  if run.dropout:
    kw.update(dropout_rate=run.dropout, dropout_shared=run.dropout_shared)
  return kw


def _forward_kernel(run: Run, arrays, dequant=None):
  """``(q, k, v) -> (out, lse)``: the forward kernel alone (FP8 runs: with
  the ``[H, 2]`` table ``dequant``, ones where not given)."""
  if run.fp8_kv is not None:
    kw = _kernel_kwargs(run)
    if dequant is None:
      dequant = jnp.ones((run.shape[3], 2), jnp.float32)
    return lambda q, k, v: mosaic_kernels.forward_fp8(
        q, k, v, arrays, dequant=dequant, out_dtype=jnp.bfloat16, **kw)
  return lambda q, k, v: mosaic_kernels.forward(q, k, v, arrays,
                                                **_kernel_kwargs(run))


def _backward_kernels(run: Run, arrays):
  """``(q, k, v, out, lse, do, dlse) -> (dq, dk, dv)``: the backward
  kernels alone (and dbias fourth with ``run.bias_grad``)."""
  kw = _kernel_kwargs(run)
  if run.bias_grad:
    kw["bias_grad"] = True
  return lambda q, k, v, out, lse, do, dlse: mosaic_kernels.backward(
      q, k, v, arrays, out, lse, do, dlse, **kw)


def _run_fp8(run: Run):
  """An FP8 run: the forward kernel on per-head quantized normal inputs
  against exact attention of the dequantized values (jaxflash.fp8's XLA
  path).  They differ by the kernel's rounding of P to e4m3 for P V (a
  few percent of an output at most); the LSE comes from the float32
  logits, as the reference's."""
  b, t, s, h, kh, d = run.shape
  ks = jax.random.split(jax.random.key(run.seed), 3)
  q, k, v = (jax.random.normal(key, shape, jnp.float32) for key, shape in
             zip(ks, [(b, t, h, d), (b, s, kh, d), (b, s, kh, d)]))
  (q8, qs), (k8, kscale), (v8, vs) = (
      jaxflash.quantize_fp8(x, axis=2, dtype=dt)
      for x, dt in ((q, run.dtype), (k, run.fp8_kv), (v, run.fp8_kv)))
  arrays, _ = _mask_arrays(run)
  g = jnp.repeat(jnp.arange(kh), h // kh)
  dequant = jnp.stack([qs * kscale[g], vs[g]], axis=1)
  out, lse = jax.jit(_forward_kernel(run, arrays, dequant))(q8, k8, v8)
  deq = lambda x, sc: x.astype(jnp.float32) * sc[None, None, :, None]
  ref, ref_lse = backends.attention(
      "xla", deq(q8, qs), deq(k8, kscale), deq(v8, vs), mask=run.spec,
      arrays=arrays, softmax_scale=run.scale, logits_soft_cap=run.soft_cap)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  fin = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin],
                             atol=1e-4)
  err = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))
  assert err.max() <= 0.05 * np.abs(np.asarray(ref)).max(), err.max()
  assert float(np.sqrt(np.mean(err.astype(np.float64) ** 2))) <= 0.01


def _run_interpreted(run: Run):
  if run.fp8_kv is not None:
    return _run_fp8(run)
  b, t, s, h, kh, d = run.shape
  args = numerics.random_inputs(
      jax.random.key(run.seed), batch=b, q_len=t, kv_len=s, heads=h,
      kv_heads=kh, head_dim=d, dtype=run.dtype)
  arrays, ref_kw = _mask_arrays(run)
  ref_kw.update(causal=run.causal, window=run.window or (None, None),
                softmax_scale=run.scale, logits_soft_cap=run.soft_cap)
  if run.part == "fwd+bwd":
    def fn(q, k, v):
      return mosaic_attention(q, k, v, arrays=arrays, **_kernel_kwargs(run))
    numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                        **ref_kw)
    return
  q, k, v, do, dlse = args
  if run.part == "fwd":
    got = jax.jit(_forward_kernel(run, arrays))(q, k, v)
    _check_parts(dict(zip(("out", "lse"), got)), args, ref_kw)
  else:
    out, lse = _reference32(args, ref_kw)[:2]
    got = jax.jit(_backward_kernels(run, arrays))(
        q, k, v, out.astype(q.dtype), lse, do, dlse)
    _check_parts(dict(zip(("dq", "dk", "dv"), got)), args, ref_kw)
    if run.bias_grad:
      _check_dbias(got[3], args, ref_kw)


def _check_dbias(got, args, ref_kw):
  """A dense bias's gradient against the float32 reference's (``jax.vjp``
  through jaxflash.reference.attention's output and LSE): within 2% of its
  largest entry, and zero where the bias is -inf."""
  q, k, v, do, dlse = (x.astype(jnp.float32) if x.dtype != jnp.float32
                       else x for x in args)
  kw = {n: x for n, x in ref_kw.items() if n != "bias"}
  if "window" in kw:
    kw["window"] = tuple(kw["window"])
  bias = ref_kw["bias"]
  _, vjp = jax.vjp(lambda b: jaxflash.reference.attention(
      q, k, v, bias=b, **kw), bias)
  want = np.asarray(vjp((do, dlse))[0])
  got = np.asarray(got, np.float32)
  assert got.shape == want.shape, (got.shape, want.shape)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
  np.testing.assert_array_equal(got[np.isneginf(np.asarray(bias))], 0.0)


def _reference32(args, ref_kw):
  """``ref32``'s (out, lse, dq, dk, dv) (the reference on float32 inputs)."""
  q, k, v, do, dlse = args
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  return numerics.reference_outputs_and_grads(f32(q), f32(k), f32(v),
                                              f32(do), dlse, **ref_kw)


def _check_parts(got: dict, args, ref_kw):
  """The numerics rule for the results in ``got`` (some of ``out``,
  ``lse``, ``dq``, ``dk``, ``dv``); the others are taken from ``ref32``
  itself, which passes."""
  ref32 = _reference32(args, ref_kw)
  numerics.check_rule(tuple(got.get(name, r) for name, r in zip(
      numerics.NAMES, ref32)), *args, **ref_kw)


def _params(runs):
  return [pytest.param(run, id=run.name, marks=(
      () if run.name in PER_COMMIT else [pytest.mark.slow])) for run in runs]


# Base cases whose backward kernels another case builds (the same shapes
# and backward fields): the forward only.
_BASE_PARTS = {"d64-persistent-2wg-causal": "fwd"}  # (d64-causal-2wg's)


def _base_runs():
  return [_case_run(case, part=_BASE_PARTS.get(case[0])) for case in CASES]


@pytest.mark.parametrize("run", _params(_base_runs()))
def test_interpret_with_race_detection(run):
  _run_interpreted(run)


# Cases that only INTERPRET_VARIANTS name (the gpu tests' cross product
# of CASES and configs leaves them out).  d64-gqa-k300: non-causal GQA
# whose last key tile runs past the keys (TMA zero-fills it, the mask
# drops it) with every query row real, so the loop run on across items
# chains there (head_dim 64's default at 1025-2048 keys).
VARIANT_CASES = [
    ("d64-gqa-k300", 256, 300, 4, 2, 64, jnp.bfloat16, False, None, TWO_WG),
    # (330 queries: three consumers' 192-row groups chain only where no
    # consumer's rows are all padding, more than 384 - 64 queries.)
    ("d64-gqa-q330-k300", 330, 300, 4, 2, 64, jnp.bfloat16, False, None,
     TWO_WG),
]

# Options of the Hopper kernels, each run in the interpreter (race
# detection) over the CASES that exercise it: {id: (MosaicConfig fields
# over the case's own config, case names)}.
INTERPRET_VARIANTS = {
    # S_t and P_{t-1} V_{t-1} issued together, prologue and epilogue under
    # lax.cond, K and V released apart: one and two consumers, causal,
    # windows, GQA, rows that see no key.
    "intra_wg_overlap": (dict(intra_wg_overlap=True), [
        "d64-full", "d64-causal-2wg", "d96-gqa-q200-k300", "d128-window",
        "d64-len1", "d64-stages4-window-far", "d32-tiny-window-empty",
        "d256-causal-q300-k100", "d64-persistent-2wg-causal",
        "d128-persistent-window-q200-k300"]),
    # P computed under dP's wgmma (S's waited for alone), dS^T after dV's
    # wgmma is issued: the dK/dV and dQ kernels with one and two
    # consumers (the dQ kernel at head_dim 256 beside the paired dK/dV
    # kernel), GQA, causal, windows, rows that see no key, empty tiles.
    "bwd_softmax_overlap": (dict(bwd_softmax_overlap=True), [
        "d64-causal-2wg", "d96-gqa-q200-k300", "d128-window", "d64-len1",
        "d32-tiny-window-empty", "d256-split-dkv-gqa",
        "d64-2wg-window-f16", "d64-full"]),
    # ... with dV's wgmma issued before the wait for dP^T (a wait_n=1
    # leaves it in flight): one and two consumers, GQA, causal, windows,
    # rows that see no key, empty tiles.
    "bwd_early_dv": (dict(bwd_softmax_overlap=True, bwd_early_dv=True), [
        "d64-causal-2wg", "d96-gqa-q200-k300", "d128-window", "d64-len1",
        "d32-tiny-window-empty", "d64-2wg-window-f16", "d64-full"]),
    # The dK/dV kernel over whole GQA/MQA groups (what calls with many key
    # tiles run; the interpreter's small calls split each group by
    # default) and over half groups (MQA: two parts of two query heads),
    # one and two consumers, causal, windows.
    "bwd_head_splits=1": (dict(bwd_head_splits=1), [
        "d96-gqa-q200-k300", "d128-mqa-2wg", "d128-window"]),
    "bwd_head_splits=2": (dict(bwd_head_splits=2), ["d128-mqa-2wg"]),
}
# The output in 64-column chunks through two slots per consumer (one,
# three and four chunks: head_dim 64, 192, 256), rows with no key.
_CHUNKED_OUT_CASES = ["d64-full", "d64-causal-2wg", "d96-gqa-q200-k300",
                      "d192-q113-k17", "d256-causal-q300-k100", "d64-len1",
                      "d32-tiny-window-empty", "d64-persistent-2wg-causal",
                      "d128-persistent-window-q200-k300"]
# The persistent grid with the producer's Q prefetch; with the overlap
# and "done with Q" before the last P V turn (the H200's head_dim 128
# form); item_overlap's two consumers with the ping-pong.
_PQ = dict(persistent=True, prefetch_q=True)
_PQ_OVERLAP = dict(_PQ, intra_wg_overlap=True, early_q_release=True)
_ITEM_OVERLAP = dict(_PQ, intra_wg_overlap=True, item_overlap=True,
                     compute_wgs=2, schedule_barrier=True)
INTERPRET_VARIANTS.update({
    # dK and dV by two consumers of one key tile, P^T handed over in
    # shared memory: head_dim 256 (beside the one-consumer dQ kernel),
    # GQA, causal, windows, rows that see no key, a deep ring.
    "bwd_paired_dkv": (dict(bwd_paired_dkv=True), [
        "d64-full", "d64-causal-2wg", "d96-gqa-q200-k300", "d128-window",
        "d256-causal-q300-k100", "d64-stages4-window-far",
        "d32-tiny-window-empty", "d64-len1"]),
    # dQ by two consumers of one query tile, P handed over in shared
    # memory: beside the dK/dV kernel (one and two consumers) and the
    # paired dK/dV kernel (head_dim 256); GQA, causal,
    # windows, rows that see no key, a deep ring.
    "bwd_paired_dq": (dict(bwd_paired_dq=True), [
        "d64-full", "d64-causal-2wg", "d96-gqa-q200-k300", "d128-window",
        "d256-split-dkv-gqa", "d64-stages4-window-far",
        "d32-tiny-window-empty", "d64-len1"]),
    "bwd_paired_dq+dkv": (dict(bwd_paired_dq=True, bwd_paired_dkv=True),
                          ["d256-causal-q300-k100", "d96-gqa-q200-k300"]),
    # The persistent grid (2 programs, several items each): the producer
    # loads the next item's Q once both consumers are done with the last.
    "prefetch_q": (dict(persistent=True, prefetch_q=True),
                   _CHUNKED_OUT_CASES),
    # Any grid (the cases' own): the reciprocal normalisation and the
    # read-only last wait.
    "lean_epilogue": (dict(lean_epilogue=True), _CHUNKED_OUT_CASES),
    # The H200's head_dim 256 non-causal defaults: the intra-warpgroup
    # overlap on the persistent grid with the next item's Q prefetched,
    # and on the plain grid with the lean epilogue (one and two
    # consumers, causal skip steps, windows, GQA).
    "intra_wg_overlap+prefetch_q": (
        dict(intra_wg_overlap=True, persistent=True, prefetch_q=True),
        ["d64-persistent-2wg-causal", "d128-persistent-window-q200-k300",
         "d256-causal-q300-k100", "d96-gqa-q200-k300"]),
    # The same with "done with Q" signalled before the last P V turn.
    "intra_wg_overlap+prefetch_q+early_q_release": (
        dict(intra_wg_overlap=True, persistent=True, prefetch_q=True,
             early_q_release=True),
        ["d64-persistent-2wg-causal", "d128-persistent-window-q200-k300",
         "d256-causal-q300-k100", "d128-full-6tiles"]),
    # Two Q buffers per consumer, alternate items (eight items per
    # program: each buffer refilled three times): one and two consumers,
    # a consumer whose rows are all padding (q130), causal skips,
    # windows, GQA; the H200 head_dim 128 form; the clusters' grid; and
    # the causal pairs, which keep one buffer.
    "prefetch_q+q_double_buffer": (
        dict(_PQ, q_double_buffer=True),
        ["d128-mqa-2wg", "d64-persistent-2wg-causal",
         "d128-persistent-window-q200-k300", "d96-gqa-q200-k300"]),
    "intra_wg_overlap+prefetch_q+early_q_release+q_double_buffer": (
        dict(_PQ_OVERLAP, q_double_buffer=True),
        ["d128-mqa-2wg", "d64-persistent-2wg-causal",
         "d128-persistent-window-q200-k300"]),
    "kv_multicast+persistent+q_double_buffer": (
        dict(_PQ, kv_multicast=True, q_double_buffer=True),
        ["d128-mqa-2wg"]),
    "persistent_pairs+prefetch_q+q_double_buffer": (
        dict(_PQ, persistent_pairs=True, q_double_buffer=True),
        ["d64-persistent-2wg-causal"]),
    # The overlapped loop run on across items (item_overlap): two
    # consumers; several key tiles and four items per program (d64), a
    # single key tile per item (k17), the head_dim 128 form; with one Q
    # buffer (early_q_release) and two.  Calls it does not apply to run
    # as without it (q130: a consumer of padding rows; causal).
    "item_overlap": (
        dict(_ITEM_OVERLAP, early_q_release=True),
        ["d64-full", "d192-q113-k17", "d128-full-6tiles", "d128-mqa-2wg",
         "d64-causal-2wg"]),
    "kv_multicast+item_overlap": (
        dict(_ITEM_OVERLAP, early_q_release=True, kv_multicast=True),
        ["d64-full"]),
    "item_overlap+q_double_buffer": (
        dict(_ITEM_OVERLAP, q_double_buffer=True),
        ["d64-full", "d128-full-6tiles", "d192-q113-k17"]),
    # The default (plain) loop run on across items (item_overlap without
    # intra_wg_overlap, the head_dim 64 form): two consumers with the
    # ping-pong, one consumer, three without it; several key tiles and
    # four items per program (d64), one key tile per item (k17), six; one
    # Q buffer and two.  (A causal call runs as without it: the kernels of
    # prefetch_q-d64-causal-2wg.)
    "item_overlap_plain": (
        dict(_PQ, item_overlap=True, compute_wgs=2, schedule_barrier=True),
        ["d64-full", "d192-q113-k17", "d128-full-6tiles"]),
    "item_overlap_plain+q_double_buffer": (  # (head_dim 64's default
        # at 1025-2048 non-causal keys: GQA, a zero-filled last key tile)
        dict(_PQ, item_overlap=True, q_double_buffer=True, compute_wgs=2,
             schedule_barrier=True),
        ["d64-full", "d192-q113-k17", "d64-gqa-k300"]),
    "item_overlap_plain_one_wg": (
        dict(_PQ, item_overlap=True, compute_wgs=1, schedule_barrier=False),
        ["d64-full", "d128-full-6tiles"]),
    "kv_multicast+item_overlap_plain": (
        dict(_PQ, item_overlap=True, kv_multicast=True, compute_wgs=2,
             schedule_barrier=True),
        ["d64-full"]),
    "three_wgs+item_overlap_plain": (  # (q130: 192-row groups chain)
        dict(_PQ, item_overlap=True, compute_wgs=3, schedule_barrier=False),
        ["d128-mqa-2wg"]),
    "three_wgs+item_overlap_plain+q_double_buffer": (  # (the H100's head_dim
        # 64 non-causal default at 1025-2048 keys)
        dict(_PQ, item_overlap=True, q_double_buffer=True, compute_wgs=3,
             schedule_barrier=False),
        ["d64-gqa-q330-k300"]),
    # Pairs of query groups per unit on the causal persistent grid (the
    # p-th longest, then the p-th shortest): an odd group count's middle
    # group alone (d256, 5 groups), GQA, two consumers, the Q prefetch
    # and the overlap.
    "persistent_pairs": (
        dict(persistent=True, persistent_pairs=True),
        ["d256-causal-q300-k100", "d64-persistent-2wg-causal",
         "d96-gqa-q200-k300"]),
    "persistent_pairs+intra_wg_overlap+prefetch_q": (
        dict(persistent=True, persistent_pairs=True, intra_wg_overlap=True,
             prefetch_q=True),
        ["d256-causal-q300-k100", "d64-persistent-2wg-causal"]),
    # The H200 head_dim 128 causal default of up to 1024 keys: the pairs
    # with the overlap and the lean epilogue (no Q prefetch on causal calls).
    "persistent_pairs+intra_wg_overlap+lean_epilogue": (
        dict(persistent=True, persistent_pairs=True, intra_wg_overlap=True,
             lean_epilogue=True),
        ["d64-persistent-2wg-causal", "d96-gqa-q200-k300"]),
    # Two-CTA clusters sharing each K/V tile by TMA multicast, with the
    # rings' free signals as cluster barriers: one and two consumers, a
    # last key tile cut by the key length (17 keys), MQA; on the
    # persistent grid (two clusters, each looping over pairs of query
    # groups), with the next Q prefetched.  Causal, windowed and odd
    # group counts run without clusters (on d64-causal-2wg the kernels of
    # that case itself; test_multicast_clusters_only_where_*).
    "kv_multicast": (
        dict(kv_multicast=True),
        ["d64-full", "d128-mqa-2wg", "d192-q113-k17"]),
    "kv_multicast+persistent": (
        dict(kv_multicast=True, persistent=True, prefetch_q=True),
        ["d64-full", "d128-mqa-2wg"]),
    "intra_wg_overlap+lean_epilogue": (
        dict(intra_wg_overlap=True, lean_epilogue=True),
        ["d256-causal-q300-k100", "d64-causal-2wg", "d128-window"]),
    # Key tiles that are not a multiple of 64 (FlashAttention-3's 80 and
    # 176; V and the staged P in the 32-byte swizzle): a last tile cut by
    # the key length, causal diagonals and windows across 80-key tiles,
    # GQA, rows that see no key, head_dim 256.
    "block_kv_80": (dict(block_kv=80), [
        "d32-tiny-window-empty", "d64-causal-2wg", "d96-gqa-q200-k300",
        "d128-window", "d256-causal-q300-k100", "d64-full"]),
    "block_kv_176": (dict(block_kv=176), [
        "d128-full-6tiles", "d128-window"]),
    # The 176-key tiles with the intra-warpgroup overlap (FlashAttention-3's
    # head_dim 128 forward form).
    "block_kv_176+intra_wg_overlap": (
        dict(block_kv=176, intra_wg_overlap=True),
        ["d128-window", "d128-full-6tiles"]),
    # Three consumers (no ping-pong): 192-row query groups, a group that
    # is mostly padding, skip steps of a causal diagonal, rows that see
    # no key, and the persistent grid with the producer's Q prefetch.
    "three_wgs": (dict(compute_wgs=3, schedule_barrier=False), [
        "d64-causal-2wg", "d96-gqa-q200-k300", "d64-full", "d64-len1",
        "d32-tiny-window-empty", "d64-stages4-window-far"]),
    "three_wgs+prefetch_q": (dict(compute_wgs=3, schedule_barrier=False,
                                  persistent=True, prefetch_q=True),
                             ["d64-persistent-2wg-causal", "d64-full"]),
    # ... without it and with two Q buffers (the H100's head_dim 64
    # causal defaults at 2048-4096 keys and at 1024).
    "three_wgs+persistent": (dict(compute_wgs=3, schedule_barrier=False,
                                  persistent=True),
                             ["d64-persistent-2wg-causal",
                              "d64-stages4-window-far"]),
    "three_wgs+q_double_buffer": (dict(_PQ, compute_wgs=3,
                                       schedule_barrier=False,
                                       q_double_buffer=True),
                                  ["d64-persistent-2wg-causal",
                                   "d64-stages4-window-far"]),
    # The intra-warpgroup overlap in three consumers (no ping-pong).
    "three_wgs+intra_wg_overlap": (dict(compute_wgs=3, schedule_barrier=False,
                                        intra_wg_overlap=True),
                                   ["d64-causal-2wg", "d96-gqa-q200-k300"]),
    # The dK/dV kernel in FlashAttention-3's 80-query steps (Q and dO in
    # the 32-byte swizzle; the interpreter pads the queries to a multiple
    # of 80 and of the dQ kernel's group): one and two consumers, GQA,
    # causal diagonals and windows across 80-row steps, rows that see no
    # key; over the d128 default's step order.
    "bwd_dkv_block_q_80": (dict(bwd_dkv_block_q=80), [
        "d64-causal-2wg", "d96-gqa-q200-k300", "d128-window", "d64-len1",
        "d32-tiny-window-empty", "d64-2wg-window-f16"]),
    "bwd_dkv_block_q_80+early_dv": (
        dict(bwd_dkv_block_q=80, bwd_softmax_overlap=True,
             bwd_early_dv=True),
        ["d128-full-6tiles", "d96-gqa-q200-k300"]),
    # FlashAttention-4's conditional rescaling (the reference max moves
    # only past 2^8): causal diagonals, GQA, windows, rows that see no key,
    # the persistent grid; with the intra-warpgroup overlap (the head_dim
    # 128/256 defaults' loop).  The interpreter multiplies by alpha = 1
    # where the GPU skips (test_rescale_threshold_* below).
    "rescale_threshold": (dict(rescale_threshold=8), [
        "d64-causal-2wg", "d32-tiny-window-empty", "d96-gqa-q200-k300",
        "d64-persistent-2wg-causal"]),
    "rescale_threshold+intra_wg_overlap": (
        dict(rescale_threshold=8, intra_wg_overlap=True),
        ["d128-window", "d256-causal-q300-k100", "d64-full"]),
})


def _variant_part(fields) -> str:
  """The part of the kernels an option changes: ``bwd_*`` fields the
  backward kernels only, the others the forward kernel only (p_in_smem,
  which both read, is no option here: the base configs set it)."""
  bwd = [name.startswith("bwd_") for name in fields]
  return "bwd" if all(bwd) else "fwd+bwd" if any(bwd) else "fwd"


def _variant_runs():
  cases = {case[0]: case for case in CASES + VARIANT_CASES}
  return [_case_run(cases[name], part=_variant_part(fields),
                    config=dataclasses.replace(cases[name][-1], **fields),
                    name=f"{variant}-{name}")
          for variant, (fields, names) in INTERPRET_VARIANTS.items()
          for name in names]


@pytest.mark.parametrize("run", _params(_variant_runs()))
def test_interpret_variant(run):
  """One kernel option on one case, in the interpreter with race
  detection (INTERPRET_VARIANTS says which cases and why): the forward
  kernel for a forward option, the backward kernels for a backward
  option."""
  _run_interpreted(run)


@pytest.mark.parametrize("variant,name", [
    ("item_overlap_plain+q_double_buffer", "d64-gqa-k300"),
    ("three_wgs+item_overlap_plain+q_double_buffer", "d64-gqa-q330-k300")])
def test_interpret_variant_d64_gqa_chains(variant, name):
  """The interpreter cases of head_dim 64's 1025-2048-key default forms
  (the H200's two consumers and the H100's three) run the chained loop,
  as VARIANT_CASES says: traced only (the chain is decided while the
  kernel traces)."""
  case = next(c for c in VARIANT_CASES if c[0] == name)
  _, t, s, h, kh, d, dtype, _, _, cfg = case
  config = dataclasses.replace(cfg, **INTERPRET_VARIANTS[variant][0])
  q = jax.ShapeDtypeStruct((2, t, h, d), dtype)
  kv = jax.ShapeDtypeStruct((2, s, kh, d), dtype)
  with _forward_spy("_chains_items") as seen:
    jax.jit(_case_fn(case, RACES, config)).trace(q, kv, kv)
  assert seen and all(seen)


def _max_jump_inputs(t, h, d, jump_key, jump_query):
  """Random inputs whose keys grow along the sequence (each row's max
  creeps up by less than 2^8 from tile to tile) and whose key
  ``jump_key`` scores 20 x |q|^2 against query ``jump_query`` (a jump
  that overflows float32 if the reference max never moves)."""
  q, k, v, do, dlse = numerics.random_inputs(
      jax.random.key(29), batch=1, q_len=t, kv_len=t, heads=h, kv_heads=h,
      head_dim=d, dtype=jnp.bfloat16)
  ramp = jnp.linspace(0.2, 3.0, t)[None, :, None, None]
  k = (k.astype(jnp.float32) * ramp).at[:, jump_key].set(
      20.0 * q[:, jump_query].astype(jnp.float32)).astype(jnp.bfloat16)
  return q, k, v, do, dlse


def _check_max_jump(config, args, causal, interpret, grads=True):
  """The numerics rule on the max-jump inputs: out and LSE, and the
  gradients unless ``grads`` is False (the forward's options leave the
  backward kernels as they are); returns out."""
  q = args[0]
  t, d = q.shape[1], q.shape[3]
  spec = masks.MaskSpec(t, t, causal, None, None, None)

  def fn(q, k, v):
    return mosaic_attention(q, k, v, mask=spec, softmax_scale=d ** -0.5,
                                config=config, interpret=interpret)

  if not grads:
    out, lse = jax.jit(fn)(*args[:3])
    _check_parts(dict(out=out, lse=lse), args, dict(causal=causal))
    return out
  got = numerics.outputs_and_grads(fn, *args)
  numerics.check_rule(got, *args, causal=causal)
  return got[0]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_rescale_threshold_where_the_row_max_jumps(overlap):
  """``rescale_threshold``: keys whose scale grows along the sequence (each
  row's max creeps up by less than 2^8 from tile to tile: the reference
  stays and P runs above 1) and one key per head whose score jumps far
  past it in the fourth tile (the reference moves and O is rescaled):
  outputs and LSE by the numerics rule (the forward kernel alone: the
  option leaves the backward kernels as they are), causal and not."""
  args = _max_jump_inputs(320, 2, 64, jump_key=200, jump_query=250)
  config = dataclasses.replace(TWO_WG, rescale_threshold=8,
                               intra_wg_overlap=overlap)
  for causal in (False, True):
    out = _check_max_jump(config, args, causal, RACES, grads=False)
  # The threshold is in force: P against a stale reference rounds
  # differently from the exact update's (not a silent no-op).
  exact = _check_max_jump(dataclasses.replace(config, rescale_threshold=0),
                          args, True, RACES, grads=False)
  assert not np.array_equal(np.asarray(out), np.asarray(exact))


def _gpu_form(head_dim, form, causal, t, **fields):
  """The H200's tuned config for a call with ``fields`` over it
  (``tuned``), or over that three consumers or the plain loop (no
  intra-warpgroup overlap) on the plain grid."""
  plain = dict(intra_wg_overlap=False, early_q_release=False,
               consumer_registers=None, persistent=False,
               persistent_pairs=False, kv_multicast=False)
  config = dataclasses.replace(
      mosaic_gpu.default_config("NVIDIA H200", -(-head_dim // 64) * 64,
                                causal=causal, kv_len=t), **fields)
  return dataclasses.replace(config, **{
      "tuned": {},
      "three-wg": dict(compute_wgs=3, schedule_barrier=False,
                       persistent=False, consumer_registers=None),
      "plain-loop": plain,
  }[form])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,form", [
    (64, "tuned"), (128, "tuned"), (256, "tuned"), (64, "three-wg"),
    (128, "plain-loop")])
def test_gpu_rescale_threshold_where_the_row_max_jumps(head_dim, form):
  """The same kind of inputs as test_rescale_threshold_where_the_row_max_jumps
  on the GPU, where each warp skips O's rescale while its rows' reference
  stays (and multiplies a non-zero O where it moves): 2048 keys, causal
  and not, in the forms of :func:`_gpu_form`."""
  t = 2048
  args = _max_jump_inputs(t, 4, head_dim, jump_key=1500, jump_query=1700)
  for causal in (False, True):
    _check_max_jump(_gpu_form(head_dim, form, causal, t,
                              rescale_threshold=8), args, causal, False)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,form,threshold", [
    (64, "tuned", 0), (128, "tuned", 0), (256, "tuned", 0),
    (128, "tuned", 8), (256, "tuned", 8), (64, "three-wg", 8),
    (128, "plain-loop", 0), (256, "plain-loop", 8)])
def test_gpu_deferred_row_sum(head_dim, form, threshold):
  """``deferred_row_sum`` (each lane's share of ``l`` added across the
  row's lanes once, after the tile loop; GPU only) in every loop form
  that sums ``P``'s rows, alone and under ``rescale_threshold``, on the
  max-jump inputs (``P`` up to 2^8 under the threshold): 2048 keys,
  causal and not.  12 heads make 192 work items, more than the H200's
  132 SMs, so the persistent forms (the tuned non-causal ones at
  head_dim 64 and 128) run several items per program.  A partial sum
  lost or counted twice moves O / l by a share of the row, far outside
  the numerics rule."""
  t = 2048
  args = _max_jump_inputs(t, 12, head_dim, jump_key=1500, jump_query=1700)
  for causal in (False, True):
    _check_max_jump(_gpu_form(head_dim, form, causal, t,
                              deferred_row_sum=True,
                              rescale_threshold=threshold),
                    args, causal, False)


def test_rescale_threshold_is_checked():
  """Out of range: ValueError naming the value."""
  with pytest.raises(ValueError, match="rescale_threshold=9"):
    mosaic_gpu.MosaicConfig(rescale_threshold=9)
  with pytest.raises(ValueError, match="rescale_threshold=-1"):
    mosaic_gpu.MosaicConfig(rescale_threshold=-1)
  assert mosaic_gpu.MosaicConfig(rescale_threshold=8).rescale_threshold == 8


def test_forward_smem_rules():
  """head_dim 256 with prefetch_q fits in shared memory only without the
  reduction scratch: the count says so, and without persistent the option
  adds nothing."""
  cfg = mosaic_gpu.MosaicConfig(persistent=True, prefetch_q=True)
  assert cfg.smem_bytes(256) <= 227 * 1024
  assert cfg.smem_bytes(256) > dataclasses.replace(
      cfg, prefetch_q=False).smem_bytes(256)
  plain = mosaic_gpu.MosaicConfig(prefetch_q=True)
  assert plain.smem_bytes(256) == mosaic_gpu.MosaicConfig().smem_bytes(256)
  assert cfg.out_chunks(192) == (64, 3, 2)
  assert cfg.out_chunks(64) == (64, 1, 1)
  # The forward's own head_dims: chunks of the swizzle's width.
  assert cfg.out_chunks(96) == (32, 3, 2)
  assert cfg.out_chunks(80) == (16, 5, 2)
  # The reduction scratch is dropped only where the buffers need its room
  # (and always with prefetch_q): the tuned defaults keep it, but on the
  # persistent grid with prefetch_q and at head_dim 256 with the lean
  # epilogue's output slots (the non-causal default from 1025 keys).
  assert cfg.fwd_reduction_scratch(64) == 0
  wide = mosaic_gpu.MosaicConfig(block_kv=192)
  assert wide.fwd_reduction_scratch(128) == 0
  assert wide.fwd_reduction_scratch(64) is None
  assert wide.smem_bytes(128) <= 227 * 1024
  for d in (64, 128, 256):
    for kv in (1024, 4096, 16384):
      dflt = mosaic_gpu.default_config("NVIDIA H200", d, kv_len=kv)
      dropped = dflt.prefetches_q or (d == 256 and dflt.lean_epilogue)
      assert dflt.fwd_reduction_scratch(d) == (0 if dropped else None), (
          d, kv)


def test_gpu_only_options_are_refused_in_the_interpreter():
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  for name in ("named_barriers", "unpadded_kv", "unpadded_q"):
    with pytest.raises(NotImplementedError, match=name):
      jaxflash.flash_attention(
          q, q, q, implementation="mosaic_gpu", interpret=True,
          config=mosaic_gpu.MosaicConfig(**{name: True}))


# The backward fields of the tuned d128 default (tuning.json, H200).
_D128_BWD = dict(bwd_stats_in_acc=True, bwd_softmax_overlap=True,
                 bwd_consumer_registers=240, bwd_early_dv=True)

# The head_dim 256 non-causal forward's two forms (64-key tiles, the
# overlap at 240 registers): the plain grid with the lean epilogue (the
# H200 default from 1025 keys, with kv_multicast) and the persistent grid
# with the next Q prefetched and loaded early (once the default from 2049
# keys); several GPU_CONFIGS are one option over them.
_D256_PLAIN = mosaic_gpu.MosaicConfig(
    intra_wg_overlap=True, named_barriers=True, block_kv=64,
    consumer_registers=240, lean_epilogue=True)
_D256_PERSISTENT = mosaic_gpu.MosaicConfig(
    intra_wg_overlap=True, named_barriers=True, block_kv=64,
    consumer_registers=240, persistent=True, prefetch_q=True,
    early_q_release=True)
# The head_dim 128 non-causal short calls' form (persistent, the next Q
# prefetched and released early, the lean epilogue) and three consumers
# without the ping-pong (the d64 long calls' form), each also under an
# option below.
_D128_PERSISTENT = mosaic_gpu.MosaicConfig(
    intra_wg_overlap=True, named_barriers=True, block_kv=128,
    consumer_registers=240, persistent=True, prefetch_q=True,
    early_q_release=True, lean_epilogue=True)
_THREE_WG = mosaic_gpu.MosaicConfig(named_barriers=True, compute_wgs=3,
                                    block_kv=128)
GPU_CONFIGS = {
    "default": None,
    "p-in-smem": mosaic_gpu.MosaicConfig(p_in_smem=True),
    "one-wg": mosaic_gpu.MosaicConfig(compute_wgs=1, schedule_barrier=False),
    "deep": mosaic_gpu.MosaicConfig(block_kv=64, stages=4),
    "persistent": mosaic_gpu.MosaicConfig(persistent=True),
    # dQ by TMA reduce-add from the dK/dV kernel (no interpreter support).
    "atomic-dq": mosaic_gpu.MosaicConfig(bwd_atomic_dq=True),
    "atomic-dq-one-wg": mosaic_gpu.MosaicConfig(
        bwd_atomic_dq=True, bwd_compute_wgs=1, bwd_block_kv=128),
    # FlashAttention-3's intra-warpgroup overlap in the forward.
    "overlap": mosaic_gpu.MosaicConfig(intra_wg_overlap=True),
    "overlap-kv128": mosaic_gpu.MosaicConfig(intra_wg_overlap=True,
                                             block_kv=128),
    # The same with FlashAttention-3's named-barrier ping-pong (each turn
    # issues both matmuls, then hands over).
    "named-overlap": mosaic_gpu.MosaicConfig(intra_wg_overlap=True,
                                             named_barriers=True),
    "named-overlap-kv128": mosaic_gpu.MosaicConfig(
        intra_wg_overlap=True, named_barriers=True, block_kv=128),
    # FlashAttention-3's head_dim 256 form: 80-key tiles at 240 registers.
    "named-overlap-kv80-regs240": mosaic_gpu.MosaicConfig(
        intra_wg_overlap=True, named_barriers=True, block_kv=80,
        unpadded_kv=True, consumer_registers=240),
    # Persistent, the next item's Q prefetched (the short calls' form).
    "named-overlap-persistent-prefetch-q": mosaic_gpu.MosaicConfig(
        intra_wg_overlap=True, named_barriers=True, block_kv=128,
        consumer_registers=240, persistent=True, prefetch_q=True),
    # The same, "done with Q" before the last P V and Q loaded first
    # (early_q_release; the H200 default at head_dim 128 up to 2048 keys).
    "named-overlap-persistent-early-q": _D128_PERSISTENT,
    # The clusters' persistent grid with the next Q prefetched.
    "multicast-persistent": mosaic_gpu.MosaicConfig(
        named_barriers=True, block_kv=128, persistent=True, prefetch_q=True,
        kv_multicast=True),
    # Two Q buffers per consumer, alternate items (q_double_buffer): the
    # head_dim 128 form and the head_dim 64 form (no overlap).
    "named-overlap-persistent-early-q-double-q": dataclasses.replace(
        _D128_PERSISTENT, q_double_buffer=True),
    "named-persistent-double-q": mosaic_gpu.MosaicConfig(
        named_barriers=True, block_kv=128, persistent=True, prefetch_q=True,
        q_double_buffer=True),
    # The overlapped loop run on across items (item_overlap), with one Q
    # buffer and two.
    "named-overlap-persistent-early-q-item-overlap": dataclasses.replace(
        _D128_PERSISTENT, item_overlap=True),
    "named-overlap-persistent-double-q-item-overlap": dataclasses.replace(
        _D128_PERSISTENT, q_double_buffer=True, item_overlap=True),
    # The default loop run on across items (item_overlap without the
    # overlap): the head_dim 64 persistent default with one Q buffer and
    # two, and three consumers (the
    # head_dim 64 form from 4096 keys) without the ping-pong.
    "named-persistent-item-overlap": mosaic_gpu.MosaicConfig(
        named_barriers=True, block_kv=128, persistent=True, prefetch_q=True,
        item_overlap=True),
    "named-persistent-double-q-item-overlap": mosaic_gpu.MosaicConfig(
        named_barriers=True, block_kv=128, persistent=True, prefetch_q=True,
        q_double_buffer=True, item_overlap=True),
    "named-three-wg-prefetch-q-item-overlap": mosaic_gpu.MosaicConfig(
        named_barriers=True, compute_wgs=3, block_kv=128, unpadded_kv=True,
        persistent=True, prefetch_q=True, item_overlap=True),
    # The head_dim 256 non-causal form of 2049+ keys with the lean
    # epilogue (a candidate of the tuning log's "Next" 1,
    # docs/benchmarks/h200-2026-12-06-e1d21d8-tuning-log.md).
    "named-overlap-persistent-early-q-lean-kv64": mosaic_gpu.MosaicConfig(
        intra_wg_overlap=True, named_barriers=True, block_kv=64,
        consumer_registers=240, persistent=True, prefetch_q=True,
        early_q_release=True, lean_epilogue=True),
    # The head_dim 128 causal default of up to 1024 keys: the persistent
    # grid dealing out pairs of query groups (persistent_pairs).
    "named-overlap-persistent-pairs": mosaic_gpu.MosaicConfig(
        intra_wg_overlap=True, named_barriers=True, block_kv=128,
        consumer_registers=240, persistent=True, persistent_pairs=True,
        lean_epilogue=True),
    # FlashAttention-4's conditional rescaling, with each warp's branch
    # around O's rescale (GPU only): the head_dim 256 non-causal default's
    # form, the head_dim 128 short non-causal one, and three consumers
    # (the head_dim 64 long form; the non-overlapped loop's rescale).
    # On CASES' random inputs a reference moves only at a row's first
    # tile (O still zero); test_gpu_rescale_threshold_* moves it later.
    "named-overlap-lean-epilogue-kv64-multicast-rescale":
        dataclasses.replace(_D256_PLAIN, kv_multicast=True,
                            rescale_threshold=8),
    "named-overlap-persistent-early-q-rescale": dataclasses.replace(
        _D128_PERSISTENT, rescale_threshold=8),
    "named-three-wg-rescale": dataclasses.replace(_THREE_WG,
                                                  rescale_threshold=8),
    # The row sum kept per lane and added across each row's lanes after
    # the tile loop (deferred_row_sum, GPU only), with the threshold: the
    # head_dim 256 non-causal default's form and three consumers (rows
    # that see no key keep l = 0 in every lane).
    "named-overlap-lean-epilogue-kv64-multicast-rescale-deferred-sum":
        dataclasses.replace(_D256_PLAIN, kv_multicast=True,
                            rescale_threshold=8, deferred_row_sum=True),
    "named-three-wg-deferred-sum": dataclasses.replace(
        _THREE_WG, deferred_row_sum=True),
    # The head_dim 256 non-causal defaults' two forms in two-CTA clusters
    # sharing each K/V tile by TMA multicast (kv_multicast).
    "named-overlap-lean-epilogue-kv64-multicast": dataclasses.replace(
        _D256_PLAIN, kv_multicast=True),
    "named-overlap-persistent-early-q-kv64-multicast": dataclasses.replace(
        _D256_PERSISTENT, kv_multicast=True),
    # The head_dim 256 non-causal defaults' two forms at every head_dim:
    # 64-key tiles at 240 registers, persistent with the next Q
    # prefetched, or on the plain grid with the lean epilogue.
    "named-overlap-persistent-prefetch-q-kv64": mosaic_gpu.MosaicConfig(
        intra_wg_overlap=True, named_barriers=True, block_kv=64,
        consumer_registers=240, persistent=True, prefetch_q=True),
    "named-overlap-lean-epilogue-kv64": _D256_PLAIN,
    # Three consumers with the overlap (the d64 long calls' candidate; 64
    # keys: no spills at their 160 registers, 128 spill 72 bytes).
    "named-three-wg-overlap-kv64": mosaic_gpu.MosaicConfig(
        compute_wgs=3, intra_wg_overlap=True, named_barriers=True,
        block_kv=64),
    # P through shared memory, stored after the wait for the P V that read
    # it last (FlashAttention-3's head_dim 64 form: 192-row groups, P V
    # from shared memory), with two and three consumers.
    "named-overlap-p-in-smem": mosaic_gpu.MosaicConfig(
        intra_wg_overlap=True, named_barriers=True, p_in_smem=True,
        block_kv=128),
    "named-three-wg-overlap-p-in-smem": mosaic_gpu.MosaicConfig(
        compute_wgs=3, intra_wg_overlap=True, named_barriers=True,
        p_in_smem=True, block_kv=128),
    # Hardware named barriers for the ping-pong and the consumed signals
    # (inline PTX: no interpreter).
    "named": mosaic_gpu.MosaicConfig(named_barriers=True),
    "named-persistent": mosaic_gpu.MosaicConfig(named_barriers=True,
                                                persistent=True),
    "named-one-wg-deep": mosaic_gpu.MosaicConfig(
        named_barriers=True, compute_wgs=1, schedule_barrier=False,
        block_kv=64, stages=5),
    # The next item's Q loaded by the producer, the output in chunks.
    "named-prefetch-q": mosaic_gpu.MosaicConfig(
        named_barriers=True, persistent=True, prefetch_q=True),
    # A key tile of 192 rows: at head_dim 128 it fits only without the
    # reduction scratch.
    "named-kv192": mosaic_gpu.MosaicConfig(named_barriers=True,
                                           block_kv=192),
    # Three consumers without the ping-pong (FA3's 192-row tile at d64):
    # the H200 d64 default's two forms with it.
    "named-three-wg": _THREE_WG,
    "named-three-wg-prefetch-q": dataclasses.replace(
        _THREE_WG, persistent=True, prefetch_q=True),
    # tokamax's epilogue: reciprocal, chunked stores, read-only last wait.
    "named-lean-epilogue": mosaic_gpu.MosaicConfig(named_barriers=True,
                                                   lean_epilogue=True),
    "named-lean-epilogue-persistent": mosaic_gpu.MosaicConfig(
        named_barriers=True, lean_epilogue=True, persistent=True),
    # FlashAttention-3's register split in the backward (240 / 32).
    "bwd-regs240": mosaic_gpu.MosaicConfig(bwd_consumer_registers=240),
    "bwd-regs240-atomic": mosaic_gpu.MosaicConfig(
        bwd_consumer_registers=240, bwd_atomic_dq=True),
    # dK and dV by two consumers of one key tile (P^T handed over), next to
    # a one- or two-consumer dQ kernel, P^T from registers or staged.
    "bwd-paired": mosaic_gpu.MosaicConfig(bwd_paired_dkv=True,
                                          bwd_compute_wgs=1),
    "bwd-paired-2wg-dq": mosaic_gpu.MosaicConfig(bwd_paired_dkv=True),
    "bwd-paired-smem": mosaic_gpu.MosaicConfig(
        bwd_paired_dkv=True, bwd_compute_wgs=1, p_in_smem=True,
        bwd_stages=3),
    # dQ by two consumers of one query tile (P handed over), beside the
    # paired dK/dV kernel or the two-consumer one.
    "bwd-paired-dq": mosaic_gpu.MosaicConfig(
        bwd_paired_dkv=True, bwd_paired_dq=True, bwd_compute_wgs=1),
    "bwd-paired-dq-2wg-dkv": mosaic_gpu.MosaicConfig(bwd_paired_dq=True),
    "bwd-paired-dq-smem": mosaic_gpu.MosaicConfig(
        bwd_paired_dkv=True, bwd_paired_dq=True, bwd_compute_wgs=1,
        p_in_smem=True),
    # P under dP's wgmma, dS under dV's (FlashAttention-3's backward
    # order): the dQ kernel, atomic dQ.
    "bwd-softmax-overlap": mosaic_gpu.MosaicConfig(bwd_softmax_overlap=True),
    "bwd-softmax-overlap-atomic": mosaic_gpu.MosaicConfig(
        bwd_softmax_overlap=True, bwd_atomic_dq=True),
    # ... with FlashAttention-3's register split (+0.2-3% at d128 on the
    # H200, 2026-12-02; 15 passed at af3998b).
    "bwd-softmax-overlap-regs240": mosaic_gpu.MosaicConfig(
        bwd_softmax_overlap=True, bwd_consumer_registers=240),
    # LSE and delta folded into the dK/dV kernel's accumulators: the
    # default step order and FA3's, atomic dQ.
    "bwd-stats-in-acc": mosaic_gpu.MosaicConfig(bwd_stats_in_acc=True),
    "bwd-stats-in-acc-overlap": mosaic_gpu.MosaicConfig(
        bwd_stats_in_acc=True, bwd_softmax_overlap=True),
    "bwd-stats-in-acc-overlap-atomic": mosaic_gpu.MosaicConfig(
        bwd_stats_in_acc=True, bwd_softmax_overlap=True, bwd_atomic_dq=True),
    # The d128 default before bwd_early_dv (2026-12-02).
    "bwd-stats-in-acc-overlap-regs240": mosaic_gpu.MosaicConfig(
        **{**_D128_BWD, "bwd_early_dv": False}),
    "bwd-stats-in-acc-atomic": mosaic_gpu.MosaicConfig(
        bwd_stats_in_acc=True, bwd_atomic_dq=True),
    # 128-query tiles at head_dim 64: Sᵀ and dPᵀ 64 x 128 per consumer,
    # with the dQ kernel and with atomic dQ (the d64 rule's form).
    "bwd-stats-in-acc-bq128": mosaic_gpu.MosaicConfig(
        bwd_stats_in_acc=True, bwd_block_q=128),
    "bwd-stats-in-acc-bq128-atomic": mosaic_gpu.MosaicConfig(
        bwd_stats_in_acc=True, bwd_block_q=128, bwd_atomic_dq=True),
    # The head_dim 128 default with a third backward stage (passed
    # before bwd_early_dv joined the default; with it not yet run).
    "bwd-d128-default-stages3": mosaic_gpu.MosaicConfig(
        **_D128_BWD, bwd_stages=3),
    # FlashAttention-3's forward tiles: 80 keys (its head_dim 256 tile)
    # and 176 (its head_dim 128 tile; over shared memory at 192 and 256,
    # skipped there), K and V padded by XLA or zero-filled by TMA.
    "named-kv80": mosaic_gpu.MosaicConfig(named_barriers=True, block_kv=80),
    "named-kv80-unpadded": mosaic_gpu.MosaicConfig(
        named_barriers=True, block_kv=80, unpadded_kv=True),
    "named-kv176-unpadded": mosaic_gpu.MosaicConfig(
        named_barriers=True, block_kv=176, unpadded_kv=True),
    # FlashAttention-3's head_dim 128 form: 176 keys, the overlap, 240
    # registers.
    "named-overlap-kv176-regs240": mosaic_gpu.MosaicConfig(
        named_barriers=True, block_kv=176, unpadded_kv=True,
        intra_wg_overlap=True, consumer_registers=240),
    "unpadded-kv": mosaic_gpu.MosaicConfig(unpadded_kv=True),
    # FlashAttention-3's register split (240 per consumer, the producer
    # 24) over the head_dim 256 default's 80-key form.
    "named-kv80-unpadded-regs240": mosaic_gpu.MosaicConfig(
        named_barriers=True, block_kv=80, unpadded_kv=True,
        consumer_registers=240),
    # Q and O unpadded too (TMA zero-fills Q, clips O's store): two
    # consumers, and the d64 default's three-consumer forms.
    "unpadded-q": mosaic_gpu.MosaicConfig(unpadded_kv=True, unpadded_q=True),
    "named-three-wg-unpadded-q": mosaic_gpu.MosaicConfig(
        named_barriers=True, compute_wgs=3, block_kv=128, unpadded_kv=True,
        unpadded_q=True),
    "named-three-wg-prefetch-q-unpadded-q": mosaic_gpu.MosaicConfig(
        named_barriers=True, compute_wgs=3, block_kv=128, persistent=True,
        prefetch_q=True, unpadded_kv=True, unpadded_q=True),
    # The H100 SXM's head_dim 64 forms from 1024 keys: three consumers on
    # the persistent grid (causal calls from 2048 keys), and with the next
    # Q in a second buffer and the loop run on across items (non-causal
    # 1025-2048).
    "named-three-wg-persistent-unpadded-q": mosaic_gpu.MosaicConfig(
        named_barriers=True, compute_wgs=3, block_kv=128, persistent=True,
        unpadded_kv=True, unpadded_q=True),
    "named-three-wg-double-q-item-overlap-unpadded-q": mosaic_gpu.MosaicConfig(
        named_barriers=True, compute_wgs=3, block_kv=128, persistent=True,
        prefetch_q=True, q_double_buffer=True, item_overlap=True,
        unpadded_kv=True, unpadded_q=True),
    # FlashAttention-3's 80-query steps of the dK/dV kernel (the last one
    # zero-filled by TMA past the padded queries) over the d128 default.
    "bwd-d128-dkv-q80": mosaic_gpu.MosaicConfig(
        **_D128_BWD, bwd_dkv_block_q=80),
}


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", list(GPU_CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gpu(case, cfg):
  config = GPU_CONFIGS[cfg]
  dp = -(-case[5] // 64) * 64
  why = config is not None and head_dim_problem(config, dp)
  if why:  # refused with this reason: test_head_dim_validation
    pytest.skip(f"{cfg}: {why}")
  _run(case, False, config)


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1024, 2000, 4096])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_long(seq, causal, head_dim):
  case = (f"long-{seq}-{head_dim}", seq, seq, 8, 2, head_dim, jnp.bfloat16,
          causal, None, None)
  _run(case, False, None)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,seq", [(True, 1000), (False, 2049)])
@pytest.mark.parametrize("head_dim", [48, 80, 96, 112])
def test_gpu_own_head_dims(head_dim, causal, seq):
  """Head_dims that 64 does not divide: the forward at the head_dim
  rounded up to 16 (narrower swizzles, output chunks of their width),
  and the backward at the same head_dim, by the numerics rule."""
  case = (f"own-{head_dim}", seq, seq, 8, 2, head_dim, jnp.bfloat16,
          causal, None, None)
  _run(case, False, None)


# (q_len, kv_len, heads, kv_heads, head_dim, causal, overrides of the
# device's tuned config)
_ROWS_CASES = {
    "vit577": (577, 577, 12, 12, 64, False, ""),
    "vit577-causal": (577, 577, 12, 12, 64, True, ""),
    "vit197": (197, 197, 12, 12, 64, False, ""),
    "clip257-d32": (257, 257, 8, 8, 32, True, ""),
    "q577-k1000": (577, 1000, 8, 2, 64, False, ""),
    "q1000-k577-causal": (1000, 577, 8, 2, 64, True, ""),
    "three-wg-double-q-overlap": (
        577, 577, 8, 8, 64, False,
        "compute_wgs=3,persistent=1,prefetch_q=1,q_double_buffer=1,"
        "item_overlap=1"),
    "multicast": (1577, 1577, 4, 4, 64, False,
                  "persistent=0,prefetch_q=0,q_double_buffer=0,"
                  "item_overlap=0,kv_multicast=1"),
    "mqa-head-splits": (577, 577, 16, 1, 64, True, "bwd_head_splits=4"),
    "dq-kernel": (577, 577, 8, 8, 64, False, "bwd_atomic_dq=0"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_ROWS_CASES))
def test_gpu_rows_at_any_length(name):
  """Q, K, V, O, dO and the gradients copied by rows
  (forward.row_copies, backward.row_copies) at lengths that 8 does not
  divide, by the numerics rule: the TMA copies zero-fill past the rows
  and clip the stores, with every form the head_dim 64 configs take
  (persistent, prefetched and double Q, chained items, three consumers,
  K/V multicast, the dK/dV kernel's head splits, atomic or separate
  dQ).  The interpreter gives a RefUnion's views buffers of their own,
  so only the GPU runs these copies."""
  t, s, h, kh, d, causal, overrides = _ROWS_CASES[name]
  config = dataclasses.replace(
      mosaic_gpu.default_config(jax.devices()[0].device_kind, 64,
                                causal=causal, kv_len=s),
      **parse_overrides(overrides))
  prob = fwd_lib.Problem(mask=masks.MaskSpec(t, s, causal),
                         softmax_scale=1.0, batch=2, num_heads=h,
                         num_kv_heads=kh, q_pad=round_up(t, 256),
                         kv_pad=round_up(s, 256), head_dim_padded=d)
  assert fwd_lib.row_copies(prob, config, t, s, False) != fwd_lib.RowCopies()
  case = (f"rows-{name}", t, s, h, kh, d, jnp.bfloat16, causal, None,
          config)
  _run(case, False, config)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_mqa_backward(head_dim, splits):
  """MQA with few key tiles: the dK/dV kernel's split of the group (the
  default's, from dkv_head_splits: float32 partials summed after it) and
  whole groups, both by the numerics rule (head_dim 64 with the H200
  entry's atomic dQ)."""
  causal, seq = True, 1536
  config = None
  if splits is not None:
    config = dataclasses.replace(mosaic_gpu.default_config(
        jax.devices()[0].device_kind, head_dim, causal=causal, kv_len=seq),
        bwd_head_splits=splits)
  case = (f"mqa-{head_dim}", seq, seq, 16, 1, head_dim, jnp.bfloat16,
          causal, None, config)
  _run(case, False, config)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_long_three_consumers(causal):
  """16384 keys at head_dim 64 (MQA): on the H200 the tuned default runs
  three consumers there, causal or not (tuning.json's kv_rules), both
  on the plain grid (the non-causal one once persistent); gradients
  too."""
  case = ("long-16384-64-mqa", 16384, 16384, 2, 1, 64, jnp.bfloat16, causal,
          None, None)
  _run(case, False, None)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [8195, 16384])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_long_fa3_tiles(head_dim, kv_len):
  """Non-causal calls from 8192 keys at head_dim 128 and 256 with the
  H200's tuned config, on whichever Hopper card runs the test:
  FlashAttention-3's 176- and 80-key tiles with K and V unpadded (the
  176-key tiles by tuning.json's kv_rules; the 80-key ones, a default
  until the intra-warpgroup overlap beat them, set here), so the last
  tile runs past the keys (TMA zero-fills it; 8195 keys are first padded
  to 8 rows); GQA, gradients too."""
  config = mosaic_gpu.default_config("NVIDIA H200", head_dim, causal=False,
                                     kv_len=kv_len)
  if head_dim == 256:  # the 80-key tiles: no longer the tuned default there
    # (on the plain grid without output slots: the persistent grid's and
    # the lean epilogue's leave no room for 80-key tiles,
    # config.head_dim_problem; without the default's two-CTA clusters, as
    # when this form was the default)
    config = dataclasses.replace(config, block_kv=80, intra_wg_overlap=False,
                                 consumer_registers=None, persistent=False,
                                 early_q_release=False, lean_epilogue=False,
                                 kv_multicast=False)
  assert config.block_kv == {128: 176, 256: 80}[head_dim]
  assert config.unpadded_kv
  case = (f"long-{kv_len}-{head_dim}", 2048, kv_len, 4, 2, head_dim,
          jnp.bfloat16, False, None, None)
  _run(case, False, config)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [1024, 8195])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_long_overlap(head_dim, causal, kv_len):
  """FlashAttention-3's intra-warpgroup overlap with its ping-pong on long
  calls: the H200's tuned config for the call (persistent with the next
  Q prefetched at 1024 keys non-causal, unpadded K and V past 8195 keys)
  with ``intra_wg_overlap`` at 240 registers, two consumers and 128-key
  tiles (64 at head_dim 256); GQA, gradients too."""
  config = dataclasses.replace(
      mosaic_gpu.default_config("NVIDIA H200", head_dim, causal=causal,
                                kv_len=kv_len),
      intra_wg_overlap=True, consumer_registers=240, compute_wgs=2,
      block_kv=64 if head_dim == 256 else 128)
  case = (f"long-overlap-{kv_len}-{head_dim}", 2048, kv_len, 4, 2, head_dim,
          jnp.bfloat16, causal, None, None)
  _run(case, False, config)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    dict(q_double_buffer=True),
    dict(item_overlap=True),
    dict(item_overlap=True, q_double_buffer=True),
], ids=["double-q", "item-overlap", "double-q-item-overlap"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_long_persistent_items(head_dim, options):
  """The persistent grid's options across work items on the H200's
  tuned non-causal config of 1024 keys (persistent, the next Q
  prefetched): 8192 queries make 512 items over 132 SMs at head_dim 128
  (344 of 192 rows at 64, three consumers), so each program
  runs two to four and every Q buffer is refilled (the CASES give a
  program one item at most on a GPU); GQA, gradients too.  item_overlap
  chains the overlapped loop (head_dim 128's default) or the plain one
  (64's)."""
  config = dataclasses.replace(
      mosaic_gpu.default_config("NVIDIA H200", head_dim, causal=False,
                                kv_len=1024), **options)
  assert config.persistent and config.prefetch_q
  case = (f"long-items-{head_dim}", 8192, 1024, 4, 2, head_dim,
          jnp.bfloat16, False, None, None)
  _run(case, False, config)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [1024, 2000, 2048])
def test_gpu_long_persistent_default_items(kv_len):
  """head_dim 64's tuned non-causal default on the persistent grid with
  many items per program: three consumers, two Q buffers up to 2048
  keys and, from 1025, the plain loop run on across items (at 2000 keys
  the last key tile is zero-filled by TMA, and the loop still
  chains).  8250 queries (not 8192: the 192-row groups then
  leave no consumer of padding rows only, which the chain needs) make
  344 items over 132 SMs (two or three per program, every Q buffer
  refilled); GQA, gradients too.  The chain is checked to be in force
  from 1025 keys."""
  config = mosaic_gpu.default_config("NVIDIA H200", 64, causal=False,
                                     kv_len=kv_len)
  assert config.prefetches_q and config.q_double_buffer
  assert config.item_overlap == (kv_len > 1024)
  case = (f"long-items-default-{kv_len}", 8250, kv_len, 4, 2, 64,
          jnp.bfloat16, False, None, None)
  with _forward_spy("_chains_items") as seen:
    _run(case, False, config)
  assert seen and all(seen) == config.item_overlap


@pytest.mark.gpu
@pytest.mark.parametrize("causal,q_len,kv_len,chains", [
    (False, 8192, 1024, False), (False, 8192, 2048, False),
    (False, 8250, 2000, True), (True, 1024, 1024, False),
    (True, 2048, 2048, False), (True, 4096, 4096, False),
    (True, 8192, 8192, False), (True, 16384, 16384, False)])
def test_gpu_h100_three_consumers(causal, q_len, kv_len, chains):
  """head_dim 64's default from 1024 keys on the H100 SXM and the H200
  (the H200 entry's rules, which the H100 SXM's alias follows):
  three consumers of 192 query rows over each call's two-consumer form.
  Non-causal: 8192 queries on the persistent grid with the Q prefetch
  and two Q buffers (43 items of 192 rows a head over 132 SMs);
  at 1025-2048 keys the loop runs on across items only where no
  consumer's rows are all padding (8250 queries, not 8192: ``chains``),
  the last key tile zero-filled by TMA at 2000 keys.  Causal: on the
  persistent grid at every length (two Q buffers at 1024; by the
  entry's persistent_max_kv up to 4096 keys, by a kv rule from 4097);
  16 heads at
  4096 keys (64 at 1024, 32 at 2048, 8 at 8192; 2 heads of one K/V head
  at 16384, the reference's memory) and a batch of 2, so programs run
  items of unequal length.  GQA, gradients too, on whichever Hopper card
  runs the test."""
  config = mosaic_gpu.default_config("NVIDIA H100 80GB HBM3", 64,
                                     causal=causal, kv_len=kv_len)
  assert config.compute_wgs == 3
  assert config.persistent
  assert config.item_overlap == (not causal and kv_len > 1024)
  heads, kv_heads = ((4, 2) if not causal else (2, 1) if kv_len > 8192
                     else (16 * 4096 // kv_len, 2))
  case = (f"h100-three-wg-{causal}-{q_len}-{kv_len}", q_len, kv_len, heads,
          kv_heads, 64, jnp.bfloat16, causal, None, None)
  with _forward_spy("_chains_items") as seen:
    _run(case, False, config)
  assert seen and all(seen) == chains


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    dict(prefetch_q=True),
    dict(prefetch_q=True, q_double_buffer=True),
], ids=["prefetch-q", "double-q"])
@pytest.mark.parametrize("kv_len", [1024, 2048, 4096])
def test_gpu_long_persistent_causal_items(kv_len, options):
  """The next item's Q loaded ahead (one buffer, and two used by
  alternate items) on head_dim 64's persistent causal grid, the H200's
  default up to 4096 keys: 24 heads at 1024 keys, 12 at 2048 and 6 at
  4096 make 288, 264 and 264 items of 192 queries (three consumers,
  dealt longest first) over 132 SMs,
  so every program runs two or three items of unequal length (along the
  causal diagonal) and every Q buffer is refilled; GQA, gradients too.
  (8 heads at 4096 keys ran out of memory in the reference beside three
  other test workers on an H100.)"""
  config = dataclasses.replace(
      mosaic_gpu.default_config("NVIDIA H200", 64, causal=True,
                                kv_len=kv_len), **options)
  assert config.persistent and config.prefetches_q
  heads = 24 * 1024 // kv_len
  case = (f"long-causal-items-{kv_len}", kv_len, kv_len, heads, 2, 64,
          jnp.bfloat16, True, None, None)
  _run(case, False, config)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len,kv_len,fields", [
    (8192, 100, {}), (8192, 100, dict(q_double_buffer=True)),
    (8192, 1000, dict(compute_wgs=1)), (8256, 1000, dict(compute_wgs=3)),
    (8192, 1000, dict(kv_multicast=True))],
    ids=["one-tile", "one-tile-double-q", "one-wg", "three-wg",
         "multicast"])
def test_gpu_item_overlap_plain_chains(q_len, kv_len, fields):
  """item_overlap's plain-loop chain across several items per
  program on the H200's head_dim 64 non-causal config: items of one key
  tile (the chain without middle tiles), one consumer, three (8256
  queries: whole 192-row groups, so no consumer of padding only) and
  two-CTA clusters; GQA, gradients too.  The chain is checked to be in
  force.  (Two consumers unless said: the default has three.)"""
  config = dataclasses.replace(
      mosaic_gpu.default_config("NVIDIA H200", 64, causal=False,
                                kv_len=1024),
      item_overlap=True, **{"compute_wgs": 2, **fields})
  case = (f"chain-{q_len}-{kv_len}", q_len, kv_len, 4, 2, 64, jnp.bfloat16,
          False, None, None)
  with _forward_spy("_chains_items") as seen:
    _run(case, False, config)
  assert seen and all(seen)


def test_item_overlap_only_where_consumers_take_the_same_turns():
  """item_overlap chains the items of calls on which every consumer
  computes every key tile of every item (no causal mask, window, segment
  ids, or consumer of padding rows only), on the persistent grid with
  the Q prefetch; the overlapped loop with the ping-pong and the next Q
  loadable before an item's last turn (early_q_release or
  q_double_buffer), the plain loop with any consumer count."""
  on = mosaic_gpu.MosaicConfig(
      item_overlap=True, intra_wg_overlap=True, persistent=True,
      prefetch_q=True, early_q_release=True, compute_wgs=2)

  def chains(cfg=on, q_len=2048, q_pad=2048, segments=False, **mask):
    spec = masks.MaskSpec(q_len, 2048, **mask)
    prob = fwd_lib.Problem(mask=spec, softmax_scale=0.1, batch=1,
                           num_heads=2, num_kv_heads=2, q_pad=q_pad,
                           kv_pad=2048, head_dim_padded=128,
                           has_segment_ids=segments)
    return fwd_lib._chains_items(cfg, prob)

  assert chains()
  assert chains(dataclasses.replace(on, early_q_release=False,
                                    q_double_buffer=True))
  assert chains(q_len=1985, q_pad=2048)  # the last consumer has one row
  assert not chains(q_len=1984, q_pad=2048)  # ... and here none
  assert not chains(causal=True)
  assert not chains(window_left=64) and not chains(window_right=0)
  assert not chains(segments=True)
  for off in (dict(item_overlap=False), dict(early_q_release=False),
              dict(prefetch_q=False), dict(persistent=False),
              dict(schedule_barrier=False)):
    assert not chains(dataclasses.replace(on, **off)), off
  plain = dataclasses.replace(on, intra_wg_overlap=False,
                              early_q_release=False)
  for cfg in (plain, dataclasses.replace(plain, compute_wgs=1),
              dataclasses.replace(plain, compute_wgs=3,
                                  schedule_barrier=False)):
    assert chains(cfg)
  assert not chains(plain, causal=True)
  assert not chains(plain, q_len=1984, q_pad=2048)
  for off in (dict(prefetch_q=False), dict(persistent=False),
              dict(item_overlap=False)):
    assert not chains(dataclasses.replace(plain, **off)), off


@pytest.mark.parametrize("batch,heads,kv_heads,q_len,programs,l2", [
    (8, 12, 12, 2112, 132, None),  # GPT-2 small's 12 x 11 = 132 alias
    (3, 8, 2, 640, 7, 4 * 640 * 64 * 2 * 2),  # sections of 4 KV heads' 16
    (2, 5, 1, 384, 4, 1),  # one KV head per section; a ragged last round
])
def test_causal_persistent_order_is_longest_first_and_covers_every_item(
    monkeypatch, batch, heads, kv_heads, q_len, programs, l2):
  """The causal persistent grid's order (FlashAttention-3's LPT): every
  work item once over the programs' rounds, each program's items longest
  first within a section, and no program far above the mean."""
  if l2 is not None:
    monkeypatch.setattr(fwd_lib, "LPT_L2_BYTES", l2)
  cfg = mosaic_gpu.MosaicConfig(block_q=64, compute_wgs=3, persistent=True)
  prob = fwd_lib.Problem(masks.MaskSpec(q_len, q_len, causal=True), 1.0,
                         batch, heads, kv_heads, q_len, q_len, 64)
  sched = fwd_lib._Schedule(prob, cfg, programs, 1, None)
  assert sched.lpt
  units = batch * heads * sched.units_per_bh
  seen, work = [], []
  for sm in range(programs):
    mine = []
    for i in range(int(sched.rounds(sm, units))):
      b, h, u = (int(x) for x in sched.unit_coords(sched.unit_of(sm, i)))
      seen.append((b, h, u))
      mine.append(sched.n_groups - u)  # key tiles of the u-th longest
    work.append(sum(mine))
  assert sorted(seen) == [(b, h, u) for b in range(batch)
                          for h in range(heads)
                          for u in range(sched.units_per_bh)]
  mean = sum(work) / programs
  assert max(work) <= mean + sched.n_groups, (max(work), mean)


def test_causal_order_rule():
  """The H200 entry (the H100 runs it) keeps the heads-first order up to
  1024 causal keys and deals longest first beyond; a config that asks
  for heads-first still gets LPT where heads-first would alias (12 heads
  x 11 groups on 132 programs), not where it is near balanced."""
  entry = lambda kv: mosaic_gpu.default_config("NVIDIA H200", 64,
                                               causal=True, kv_len=kv)
  assert not entry(1024).causal_lpt and entry(1025).causal_lpt
  heads_first = dataclasses.replace(entry(1024), causal_lpt=False)

  def lpt(batch, heads, q_len):
    prob = fwd_lib.Problem(masks.MaskSpec(q_len, q_len, causal=True), 1.0,
                           batch, heads, heads, q_len, q_len, 64)
    return fwd_lib._Schedule(prob, heads_first, 132, 1, None).lpt

  assert lpt(8, 12, 2112)  # GPT-2 small: 1.83x the mean
  assert lpt(16, 11, 1152)  # 11 heads x 6 groups = 66: 1.71x
  assert not lpt(16, 32, 1152)  # 1.11x
  assert not lpt(8, 16, 1152)  # GPT-2 medium: 1.28x


def test_multicast_clusters_only_where_both_ctas_stream_the_same_tiles():
  """kv_multicast pairs CTAs only on calls whose query groups all stream
  every key tile (no causal mask, window or segment ids), with an even
  group count, and with one consumer or the ping-pong (a cluster
  barrier takes one arrival per warpgroup, so a consumer's warps must
  be kept together by a wgmma or a schedule barrier)."""
  on = mosaic_gpu.MosaicConfig(kv_multicast=True, compute_wgs=2)

  def size(cfg=on, n_groups=16, segments=False, **mask):
    spec = masks.MaskSpec(2048, 2048, **mask)
    prob = fwd_lib.Problem(mask=spec, softmax_scale=0.1, batch=1,
                           num_heads=2, num_kv_heads=2, q_pad=2048,
                           kv_pad=2048, head_dim_padded=128,
                           has_segment_ids=segments)
    return fwd_lib._cluster_size(cfg, prob, n_groups)

  assert size() == 2
  assert size(dataclasses.replace(on, compute_wgs=1,
                                  schedule_barrier=False)) == 2
  assert size(dataclasses.replace(on, kv_multicast=False)) == 1
  assert size(n_groups=15) == 1
  assert size(causal=True) == 1
  assert size(window_left=64) == 1 and size(window_right=0) == 1
  assert size(segments=True) == 1
  assert size(dataclasses.replace(on, schedule_barrier=False)) == 1
  assert size(dataclasses.replace(on, compute_wgs=3,
                                  schedule_barrier=False)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kv_len", [2048, 8195])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_long_multicast(head_dim, kv_len, persistent):
  """Two-CTA clusters sharing each K/V tile by TMA multicast
  (``kv_multicast``) over the H200's tuned non-causal config, on the
  plain and the persistent grid: 16 query groups per (batch, head), each
  CTA's half of a tile landing in both CTAs; at 8195 keys with K and V
  unpadded, so TMA zero-fills the last tile's halves past the keys; GQA,
  gradients too.  (At head_dim 64 from 1024 keys the three consumers'
  192-row groups are 11, an odd count: those calls run without clusters;
  the 176-key tiles at head_dim 128 do not fit the persistent grid.)"""
  config = dataclasses.replace(
      mosaic_gpu.default_config("NVIDIA H200", head_dim, causal=False,
                                kv_len=kv_len),
      kv_multicast=True, persistent=persistent)
  why = head_dim_problem(config, head_dim)
  if why:
    pytest.skip(f"kv_multicast, persistent={persistent}: {why}")
  case = (f"long-multicast-{kv_len}-{head_dim}", 2048, kv_len, 4, 2,
          head_dim, jnp.bfloat16, False, None, None)
  _run(case, False, config)


def test_config_validation():
  for bad, match in [(dict(block_q=32), "block_q=32"),
                     (dict(block_kv=100), "block_kv=100"),
                     (dict(block_kv=48), "block_kv=48"),
                     (dict(stages=1), "stages=1"),
                     (dict(compute_wgs=4), "compute_wgs=4"),
                     (dict(bwd_compute_wgs=3), "bwd_compute_wgs=3"),
                     (dict(bwd_block_q=32), "bwd_block_q=32"),
                     (dict(bwd_stages=1), "bwd_stages=1"),
                     (dict(named_barriers=True, stages=6), "stages=6"),
                     (dict(bwd_consumer_registers=248), "got 248"),
                     (dict(consumer_registers=248),
                      "consumer_registers=248"),
                     (dict(consumer_registers=236),
                      "consumer_registers=236"),
                     (dict(consumer_registers=160),
                      "consumer_registers=160"),
                     (dict(compute_wgs=1, consumer_registers=232),
                      "compute_wgs=1"),
                     (dict(compute_wgs=3, consumer_registers=168),
                      "consumer_registers=168"),
                     (dict(bwd_paired_dkv=True, bwd_atomic_dq=True),
                      "bwd_atomic_dq=False"),
                     (dict(bwd_early_dv=True), "bwd_softmax_overlap=True"),
                     (dict(early_q_release=True), "intra_wg_overlap=True"),
                     (dict(bwd_dkv_block_q=72), "bwd_dkv_block_q=72"),
                     (dict(bwd_dkv_block_q=48), "bwd_dkv_block_q=48"),
                     (dict(bwd_dkv_block_q=272), "bwd_dkv_block_q=272"),
                     (dict(bwd_dkv_block_q=80, bwd_atomic_dq=True),
                      "multiple of 64"),
                     (dict(bwd_dkv_block_q=128, bwd_paired_dkv=True),
                      "bwd_dkv_block_q=None"),
                     (dict(bwd_head_splits=0), "bwd_head_splits=0"),
                     (dict(bwd_head_splits=2, bwd_paired_dkv=True),
                      "whole groups")]:
    with pytest.raises(ValueError, match=match):
      mosaic_gpu.MosaicConfig(**bad)
  assert mosaic_gpu.MosaicConfig(bwd_block_q=128).dkv_block_q == 128
  assert mosaic_gpu.MosaicConfig(bwd_dkv_block_q=80).dkv_block_q == 80
  cfg = mosaic_gpu.default_config("NVIDIA H200", 128)
  assert cfg.smem_bytes(128) <= 227 * 1024
  assert mosaic_gpu.default_config("some future GPU", 256).block_q % 64 == 0


def test_dkv_head_splits_rule():
  """The dK/dV kernel splits a GQA/MQA group where its programs are fewer
  than two waves of the SMs: the least divisor of the group that reaches
  them, the whole group where none does, none where the float32 staging
  tile does not fit or the paired kernel runs; a forced split must divide
  the group."""
  from jaxflash.mosaic_gpu.config import dkv_head_splits
  cfg = mosaic_gpu.default_config("NVIDIA H200", 128, causal=True,
                                  kv_len=8192)
  rule = functools.partial(dkv_head_splits, sm_count=132,
                           head_dim_padded=128)
  # MQA, 16 query heads, batch 1, 8k keys in 128-key programs: 64.
  assert rule(cfg, group_size=16, programs=64) == 8
  assert rule(cfg, group_size=16, programs=33) == 8
  assert rule(cfg, group_size=16, programs=32) == 16
  assert rule(cfg, group_size=16, programs=8) == 16
  assert rule(cfg, group_size=16, programs=264) == 1
  assert rule(cfg, group_size=12, programs=50) == 6
  assert rule(cfg, group_size=1, programs=8) == 1
  paired = mosaic_gpu.MosaicConfig(bwd_paired_dkv=True)
  assert rule(paired, group_size=8, programs=8) == 1
  big = mosaic_gpu.MosaicConfig(bwd_block_kv=128)
  assert big.bwd_smem_bytes(128) <= 227 * 1024
  assert big.bwd_smem_bytes(128, head_splits=4) > 227 * 1024
  assert rule(big, group_size=8, programs=8) == 1
  forced = dataclasses.replace(cfg, bwd_head_splits=4)
  assert rule(forced, group_size=16, programs=10_000) == 4
  with pytest.raises(ValueError, match="bwd_head_splits=4 must divide.*6"):
    rule(forced, group_size=6, programs=8)


def test_paired_dkv_smem():
  """bwd_paired_dkv at head_dim 256: one K and one V tile, the ring and
  the hand-over fit beside a one-consumer dQ kernel (two consumers' Q and
  dO do not), and the count covers the dK/dV kernel's buffers."""
  cfg = mosaic_gpu.MosaicConfig(bwd_paired_dkv=True, bwd_compute_wgs=1)
  assert needed_smem_bytes(cfg, 256) <= 227 * 1024
  assert cfg.bwd_smem_bytes(256) >= (2 * 64 * 256 + 2 * (2 * 64 * 256
                                                         + 64 * 64)) * 2
  two = dataclasses.replace(cfg, bwd_compute_wgs=2)
  assert needed_smem_bytes(two, 256) > 227 * 1024
  assert needed_smem_bytes(two, 128) <= 227 * 1024


def test_paired_dq_smem():
  """bwd_paired_dq at head_dim 256: one Q and one dO tile, the K/V ring and
  the hand-over fit (the two-consumer dQ kernel's do not), and the count
  covers the kernel's buffers; it excludes atomic dQ."""
  cfg = mosaic_gpu.MosaicConfig(bwd_paired_dkv=True, bwd_paired_dq=True)
  assert needed_smem_bytes(cfg, 256) <= 227 * 1024
  assert cfg.bwd_smem_bytes(256) >= (2 * 64 * 256 + 2 * (2 * 64 * 256
                                                         + 64 * 64)) * 2
  plain = dataclasses.replace(cfg, bwd_paired_dq=False)
  assert needed_smem_bytes(plain, 256) > 227 * 1024
  with pytest.raises(ValueError, match="bwd_paired_dq.*bwd_atomic_dq=False"):
    mosaic_gpu.MosaicConfig(bwd_paired_dq=True, bwd_atomic_dq=True)


def test_register_split_fits_the_launch_allocation():
  """setmaxnreg moves registers only within the CTA's launch allocation
  (3 x 168 per thread here): the consumers' increase must equal what the
  producer gave back, or they wait forever (seen on the H200 with a
  producer of 32 next to 240)."""
  from jaxflash.mosaic_gpu import config
  assert config.launch_registers(3) == 168
  for consumer, producer in [(232, 40), (240, 24)]:
    assert config.producer_registers(consumer, 2) == producer
    assert 2 * consumer + producer <= 3 * config.launch_registers(3)
  # Three consumers (4 x 128 at launch): 3 x 160 + 32, FlashAttention-3's.
  assert config.launch_registers(4) == 128
  assert config.THREE_CONSUMER_REGISTERS == 160
  assert config.producer_registers(160, 3) == 32 >= config.MIN_REGISTERS


@pytest.mark.parametrize("n,asked,want", [
    (1, 240, []),  # one consumer: the launch split (no setmaxnreg)
    (2, 232, [(40, "decrease"), (232, "increase")]),
    (2, 240, [(24, "decrease"), (240, "increase")]),
    (3, None, [(32, "decrease"), (160, "increase")]),  # the default, 160
])
def test_split_registers_requests(monkeypatch, n, asked, want):
  """What pipeline.split_registers asks setmaxnreg for, producer then
  consumer: within the launch allocation of n + 1 warpgroups."""
  from jaxflash.mosaic_gpu import config
  calls = []
  monkeypatch.setattr(pipeline.plgpu, "set_max_registers",
                      lambda regs, *, action: calls.append((regs, action)))
  pipeline.split_registers(True, n, asked)
  pipeline.split_registers(False, n, asked)
  assert calls == want
  if want:
    (producer, _), (consumer, _) = want
    assert n * consumer + producer <= (n + 1) * config.launch_registers(n + 1)


def test_split_registers_refuses_more_than_the_launch_allocation():
  """Three consumers of 240 registers would leave the producer nothing
  (and hang in setmaxnreg.inc): a ValueError before any request."""
  from jaxflash.mosaic_gpu import pipeline
  with pytest.raises(ValueError, match="3 consumers of 240 registers"):
    pipeline.split_registers(True, 3, 240)


def test_default_config_rules():
  """tuning.json's rules: the persistent forward on non-causal calls
  only (up to 2048 keys at head_dim 128), the d256 backward's paired kernels,
  the d128 folded statistics, and the d64 128-query backward tiles
  (``kv_rules``)."""
  dflt = functools.partial(mosaic_gpu.default_config, "NVIDIA H200")
  other = functools.partial(mosaic_gpu.default_config, "some future GPU")
  assert dflt(128, causal=False, kv_len=2048).persistent
  assert not dflt(128, causal=False, kv_len=2049).persistent
  assert not dflt(128, causal=False, kv_len=4096).persistent
  assert not dflt(128, causal=False, kv_len=8192).persistent
  # d64 non-causal: persistent with prefetch_q up to 2048 keys; the plain
  # grid from 4096 (+3-5% under sustained load).
  assert dflt(64, causal=False, kv_len=2048).prefetches_q
  assert not dflt(64, causal=False, kv_len=2049).persistent
  # ... with two Q buffers up to 1024 keys (+6.3% in rounds, +4.5%
  # sustained at 1024 keys; level at 2048).
  assert dflt(64, causal=False, kv_len=1024).q_double_buffer
  assert not dflt(64, causal=False, kv_len=1024).item_overlap
  # ... and from 1025 to 2048 keys with the loop run on across items too
  # (+2.3% / +2.6% in rounds, +0.4% / +1.2% sustained at 2048 keys on the
  # H200 / an H100).
  for kv_len in (1025, 2048):
    d64nc = dflt(64, causal=False, kv_len=kv_len)
    assert d64nc.prefetches_q and d64nc.q_double_buffer
    assert d64nc.item_overlap
  assert not dflt(64, causal=False, kv_len=2049).q_double_buffer
  assert not dflt(64, causal=False, kv_len=2049).item_overlap
  assert not dflt(64, causal=False, kv_len=16384).persistent
  # d256 non-causal: persistent with prefetch_q up to 1024 keys; from 1025
  # the plain grid in two-CTA clusters with K/V multicast and the lean
  # epilogue (level in 20 ms samples, +4-6% under sustained load).
  assert dflt(256, causal=False, kv_len=1024).prefetches_q
  for kv_len in (1025, 2048, 4096, 16384):
    d256nc = dflt(256, causal=False, kv_len=kv_len)
    assert d256nc.kv_multicast and d256nc.lean_epilogue
    assert not d256nc.persistent
  assert not dflt(256, causal=True, kv_len=4096).prefetches_q
  # d64 causal persistent calls: the next Q prefetched into two buffers up
  # to 1024 keys (+4.0% in rounds, +1.7% sustained on an H100), not
  # beyond (prefetch_q alone -3%; both +1.4% / -0.5% at 2048 keys).
  d64c = dflt(64, causal=True, kv_len=1024)
  assert d64c.persistent and d64c.prefetches_q and d64c.q_double_buffer
  for kv_len in (1025, 2048, 4096):
    d64c = dflt(64, causal=True, kv_len=kv_len)
    assert d64c.persistent and not d64c.prefetch_q
    assert not d64c.q_double_buffer
  # d128 causal: persistent with query-block pairs up to 1024 keys (+3.5-4%
  # over the plain grid in two replicates); the plain grid above.
  d128c = dflt(128, causal=True, kv_len=1024)
  assert d128c.persistent and d128c.persistent_pairs
  assert not dflt(128, causal=True, kv_len=1025).persistent
  assert not dflt(128, causal=False, kv_len=1024).persistent_pairs
  # d128 non-causal up to 1024 keys: two-CTA clusters with K/V multicast
  # (+1.2 to +4% in four runs, level at 2048 keys).
  assert dflt(128, causal=False, kv_len=1024).kv_multicast
  assert not dflt(128, causal=False, kv_len=1025).kv_multicast
  assert not dflt(128, causal=True, kv_len=1024).kv_multicast
  assert not dflt(128).kv_multicast and not dflt(256, kv_len=1024).kv_multicast
  assert not dflt(256, causal=True, kv_len=4096).kv_multicast
  assert not dflt(128).persistent  # no call to judge: the plain grid
  # d64 causal: persistent up to 4096 keys by persistent_max_kv (+7.5% at
  # 2048, +2% at 4096), and beyond by a kv rule (below).
  assert dflt(64, causal=True, kv_len=4096).persistent
  assert dflt(64, causal=True, kv_len=4097).persistent
  assert not dflt(64, causal=True).persistent  # length unknown
  d256 = dflt(256, causal=True, kv_len=8192)
  assert d256.bwd_paired_dkv and d256.bwd_compute_wgs == 1
  assert d256.bwd_paired_dq and not dflt(128).bwd_paired_dq
  # dQ by TMA reduce-add: measured faster at padded head_dim 64 only.
  assert dflt(64).bwd_atomic_dq and dflt(32, causal=True).bwd_atomic_dq
  assert not dflt(128).bwd_atomic_dq and not dflt(256).bwd_atomic_dq
  # The statistics folded into the dK/dV accumulators, with
  # FlashAttention-3's register split: measured faster at 128 only.
  for causal in (False, True):
    d128 = dflt(128, causal=causal, kv_len=8192)
    assert d128.bwd_stats_in_acc and d128.bwd_consumer_registers == 240
    assert d128.bwd_early_dv and d128.bwd_softmax_overlap
  assert not dflt(64).bwd_stats_in_acc and not dflt(256).bwd_stats_in_acc
  assert dflt(64).bwd_consumer_registers == 232
  # kv_rules: 128-query backward tiles at head_dim 64 (with the folded
  # statistics) on every non-causal call and on causal calls from 4096
  # keys; none where the call is not known.
  for causal, kv, big in [(False, 64, True), (False, 16384, True),
                          (True, 2048, False), (True, 4095, False),
                          (True, 4096, True), (True, 16384, True),
                          (False, None, False), (True, None, False)]:
    d64 = dflt(64, causal=causal, kv_len=kv)
    assert (d64.bwd_block_q == 128) == big, (causal, kv)
    assert d64.bwd_stats_in_acc == big and d64.bwd_atomic_dq
  assert dflt(64).bwd_block_q == 64 and dflt(128, kv_len=8192).bwd_block_q == 64
  # kv_rules: three consumers in the d64 forward from 1024 keys; two at
  # the other head_dims and on other devices.
  for causal, kv, three in [(False, 1023, False), (False, 1024, True),
                            (False, 4096, True), (False, 65536, True),
                            (True, 1000, False), (True, 8192, True),
                            (True, 16384, True), (False, None, False)]:
    assert (dflt(64, causal=causal, kv_len=kv).compute_wgs == 3) == three
  assert dflt(128, kv_len=16384).compute_wgs == 2
  assert other(64, kv_len=16384).compute_wgs == 2
  assert other(64, kv_len=8192).bwd_block_q == 64
  # kv_rules: FlashAttention-3's 176-key forward tiles at head_dim 128 on
  # non-causal calls from 8192 keys (measured slower causal), without the
  # intra-warpgroup overlap, which runs everywhere else at 128 (128-key
  # tiles, 240 registers); K and V unpadded on the H200 at every head_dim.
  for causal, kv, fa3 in [(False, 4096, False), (False, 8191, False),
                          (False, 8192, True), (False, 65536, True),
                          (True, 1024, False), (True, 16384, False),
                          (False, None, False), (True, None, False)]:
    cfg = dflt(128, causal=causal, kv_len=kv)
    assert (cfg.block_kv == 176) == fa3, (causal, kv)
    assert cfg.intra_wg_overlap != fa3, (causal, kv)
    # The lean epilogue on every overlapped call of known length (below
    # 8192 keys non-causal; at every length causal).
    assert cfg.lean_epilogue == (kv is not None and not fa3), (causal, kv)
    assert cfg.consumer_registers == (None if fa3 else 240), (causal, kv)
    assert cfg.unpadded_kv
    # early_q_release on every overlapped non-causal call (it acts on the
    # persistent ones, up to 2048 keys).
    assert cfg.early_q_release == (kv is not None and not fa3
                                   and not causal), (causal, kv)
  assert dflt(128, causal=False, kv_len=2048).prefetches_q
  # FlashAttention-4's conditional rescale with the deferred row sum at
  # head_dim 128 on causal calls of up to 8192 keys and non-causal ones of
  # 1025-2048 keys (+1.3-2.6% causal 1024-4096 in rounds, +1.6%
  # non-causal 2048 sustained; -2% non-causal at 1024, -1-3% from 8192).
  for causal, kv, rtd in [(True, 1024, True), (True, 8192, True),
                          (True, 8193, False), (True, 16384, False),
                          (False, 1024, False), (False, 1025, True),
                          (False, 2048, True), (False, 2049, False),
                          (False, 8192, False), (True, None, False)]:
    cfg = dflt(128, causal=causal, kv_len=kv)
    assert cfg.rescale_threshold == (8 if rtd else 0), (causal, kv)
    assert cfg.deferred_row_sum == rtd, (causal, kv)
  assert other(128, causal=True, kv_len=2048).rescale_threshold == 0
  # head_dim 256: the overlap (64-key tiles, 240 registers) on causal calls
  # and on non-causal ones from 1025 keys; up to 1024 the persistent grid
  # without it (measured faster there); neither where the call is unknown.
  # Non-causal: the persistent grid with the next Q prefetched up to 1024
  # keys; from 1025 the plain grid with the lean epilogue, in two-CTA
  # clusters sharing K/V by multicast.  Causal: the lean epilogue at every
  # length, no clusters.
  for causal, kv, ov, pers, lean in [
      (False, 1024, False, True, False), (False, 1025, True, False, True),
      (False, 2048, True, False, True), (False, 2049, True, False, True),
      (False, 16384, True, False, True), (True, 1024, True, False, True),
      (True, 16384, True, False, True), (False, None, False, False, False),
      (True, None, False, False, False)]:
    cfg = dflt(256, causal=causal, kv_len=kv)
    assert cfg.intra_wg_overlap == ov, (causal, kv)
    assert cfg.consumer_registers == (240 if ov else None), (causal, kv)
    assert cfg.persistent == pers, (causal, kv)
    assert cfg.prefetches_q == pers and cfg.lean_epilogue == lean, (causal,
                                                                    kv)
    assert cfg.kv_multicast == (ov and not causal), (causal, kv)
    assert not cfg.early_q_release, (causal, kv)
    assert cfg.block_kv == 64 and cfg.unpadded_kv
  assert not dflt(64, kv_len=16384).intra_wg_overlap
  assert dflt(64, kv_len=16384).block_kv == 128 and dflt(64).unpadded_kv
  # Q and O unpadded at head_dim 64 on the H200 (its three-consumer
  # groups of 192 rows divide no power-of-two length).
  assert dflt(64, kv_len=16384).unpadded_q and dflt(64).unpadded_q
  assert not dflt(128).unpadded_q and not other(64).unpadded_q
  assert not other(128, kv_len=16384).unpadded_kv
  assert other(128, kv_len=16384).block_kv == 128
  # Unlisted devices: the persistent rule is the H200's alone; the split
  # backward at head_dim 256 is carried over.
  assert not other(128, kv_len=1024).persistent
  assert other(256).bwd_paired_dkv and other(256).bwd_paired_dq
  assert not other(64).bwd_atomic_dq
  # The H100 SXM runs the H200's entry (aliases: 1.05-1.30x of the default
  # entry's forward on an H100); other Hopper parts keep the default.
  h100 = functools.partial(mosaic_gpu.default_config, "NVIDIA H100 80GB HBM3")
  for d, causal, kv in [(64, True, 1000), (128, False, 2048),
                        (128, True, 4096), (256, False, 8192), (128, True,
                                                                None)]:
    assert h100(d, causal=causal, kv_len=kv) == dflt(d, causal=causal,
                                                     kv_len=kv)
  # Three head_dim 64 consumers from 1024 keys (+5-10% on an H100, +4-11%
  # on the H200, where without unpadded_q they lose below 4096 keys
  # non-causal and 16384 causal), and the persistent grid on every causal
  # call (from 4097 keys after persistent_max_kv's 4096: +5% on an H100 at
  # 8192, +11% / +6% on the H200 at 8192 / 16384); the rest of each
  # call's form is the two-consumer one's.
  for causal in (False, True):
    for kv in (1024, 2048, 4096, 8192, 16384):
      assert dflt(64, causal=causal, kv_len=kv).compute_wgs == 3
      assert h100(64, causal=causal, kv_len=kv) == dflt(
          64, causal=causal, kv_len=kv)
    assert dflt(64, causal=causal, kv_len=1000).compute_wgs == 2
    assert dflt(64, causal=causal).compute_wgs == 2  # length unknown
  for kv in (1024, 4096, 4097, 6144, 8192, 16384):
    assert dflt(64, causal=True, kv_len=kv).persistent
  assert dflt(64, causal=True, kv_len=2048) == dataclasses.replace(
      dflt(64, causal=True, kv_len=1000), compute_wgs=3, prefetch_q=False,
      q_double_buffer=False, causal_lpt=True)
  assert dflt(64, kv_len=2048) == dataclasses.replace(
      dflt(64, kv_len=1100), compute_wgs=3)
  assert dflt(64, kv_len=1100).compute_wgs == 3
  assert dflt(64, kv_len=1023).compute_wgs == 2
  assert h100(64, causal=True, kv_len=1024).q_double_buffer
  assert h100(64, kv_len=2048).item_overlap
  assert h100(128, kv_len=1024).persistent
  assert not mosaic_gpu.default_config("NVIDIA H100 PCIe", 128,
                                       kv_len=1024).persistent
  assert "NVIDIA H100 80GB HBM3" in mosaic_gpu.config.tuned_device_kinds()


def test_tuning_rules_checked():
  """tuning.json's rules are checked when it is read (this file's
  passes), and a malformed rule or an alias to a kind without an entry
  is a ValueError naming it."""
  import copy

  from jaxflash.mosaic_gpu import config
  good = config._tuning()
  config.check_tuning(good)

  def bad(edit, match):
    tuning = copy.deepcopy(good)
    edit(tuning)
    with pytest.raises(ValueError, match=match):
      config.check_tuning(tuning)

  entry = lambda t: t["devices"]["NVIDIA H200"]["64"]  # noqa: E731
  rules = lambda t: entry(t)["kv_rules"]  # noqa: E731
  bad(lambda t: t["aliases"].update({"NVIDIA H100": "NVIDIA H300"}),
      "'NVIDIA H100' names 'NVIDIA H300', which has no entry")
  bad(lambda t: entry(t).update(kv_rules={"causal": True}),
      "a list of rules")
  bad(lambda t: rules(t)[0].update(min_kv="1024"), "is not")
  bad(lambda t: rules(t)[0].update(causal=1), "is not")
  bad(lambda t: rules(t)[0]["fields"].update(compute_wg=3),
      r"\['compute_wg'\] are not MosaicConfig fields")
  bad(lambda t: rules(t).append(
      {"causal": False, "min_kv": -1, "fields": {}}),
      "NVIDIA H200 64 kv_rules")
  # A key given twice (json.loads would keep the last silently).
  with pytest.raises(ValueError, match=r"given twice.*\['about'\]"):
    config.load_tuning('{"about": "", "devices": {}, "about": ""}')


def test_deterministic_turns_off_atomic_dq(monkeypatch):
  """deterministic=True: the tuned default's atomic dQ becomes the dQ
  kernel; a config that asks for atomics conflicts (ValueError); None
  follows XLA's --xla_gpu_deterministic_ops."""
  from jaxflash import checks
  from jaxflash.masks import MaskSpec
  from jaxflash.mosaic_gpu import backend
  monkeypatch.setattr(backend, "_device_kind", lambda: "NVIDIA H200")
  mask = MaskSpec(q_len=4096, kv_len=4096, causal=True)
  resolve = functools.partial(backend._resolve_config, None, False, 64, mask)
  assert resolve().bwd_atomic_dq
  assert not resolve(deterministic=True).bwd_atomic_dq
  assert resolve(deterministic=True) == dataclasses.replace(
      resolve(), bwd_atomic_dq=False)
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  atomic = mosaic_gpu.MosaicConfig(bwd_atomic_dq=True)
  for impl in ("mosaic_gpu", None):
    with pytest.raises(ValueError, match="bwd_atomic_dq=True"):
      jaxflash.flash_attention(q, q, q, config=atomic, deterministic=True,
                               implementation=impl, interpret=True)
  with pytest.raises(ValueError, match="deterministic must be a bool"):
    jaxflash.flash_attention(q, q, q, deterministic="yes")
  with pytest.raises(ValueError, match="bwd_atomic_dq=True"):
    jaxflash.dot_product_attention(q, q, q, config=atomic,
                                   deterministic=True, interpret=True)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
  assert checks.resolve_deterministic(None)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
  assert not checks.resolve_deterministic(None)
  monkeypatch.delenv("XLA_FLAGS")
  assert not checks.resolve_deterministic(None)
  assert checks.resolve_deterministic(True)


def test_atomic_dq_needs_one_pass_and_a_gpu():
  with pytest.raises(ValueError, match="bwd_paired_dkv=True"):
    mosaic_gpu.MosaicConfig(bwd_atomic_dq=True, bwd_paired_dkv=True)
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="no TMA reduce-add"):
    jaxflash.flash_attention(
        q, q, q, implementation="mosaic_gpu", interpret=True,
        config=dataclasses.replace(ONE_WG, bwd_atomic_dq=True))


def test_stats_in_acc_needs_a_gpu():
  """The interpreter rejects stores into a wgmma accumulator (seen with
  jax 0.11.2: "Accumulator shape (6,) does not match value shape"): the
  backend refuses the option there with the reason."""
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="stores into a wgmma"):
    jaxflash.flash_attention(
        q, q, q, implementation="mosaic_gpu", interpret=True,
        config=dataclasses.replace(ONE_WG, bwd_stats_in_acc=True))


def test_head_dim_validation():
  """Three consumers stop at padded head_dim 192 (registers): refused
  with the reason at 256, so implementation=None falls back."""
  three = mosaic_gpu.MosaicConfig(compute_wgs=3, block_kv=64)
  q = jnp.ones((1, 64, 2, 256), jnp.bfloat16)
  with pytest.raises(NotImplementedError,
                     match="compute_wgs=3 serves padded head_dim up to 192"
                           ", got 256"):
    jaxflash.flash_attention(q, q, q, implementation="mosaic_gpu",
                             interpret=True, config=three)
  assert head_dim_problem(three, 192) is None


def test_atomic_dq_refused_above_head_dim_128():
  """Above padded head_dim 128 the atomic dQ has no Hopper backward to
  run in: refused, not handed silently to the Triton backward."""
  atomic = mosaic_gpu.MosaicConfig(bwd_atomic_dq=True)
  assert head_dim_problem(atomic, 128) is None
  wide = jnp.ones((1, 64, 2, 256), jnp.bfloat16)
  with pytest.raises(NotImplementedError,
                     match="serve padded head_dim up to 128, got 256"):
    jaxflash.flash_attention(wide, wide, wide, implementation="mosaic_gpu",
                             interpret=True, config=atomic)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_atomic_dq_matches_deterministic(causal):
  """The TMA reduce-add dQ agrees with the two-kernel dQ to float32
  summation-order noise (dK and dV come from the same kernel code)."""
  args = numerics.random_inputs(jax.random.key(3), batch=2, q_len=1000,
                                kv_len=1000, heads=8, kv_heads=2,
                                head_dim=128, dtype=jnp.bfloat16)[:3]

  def grads(cfg):
    loss = lambda q, k, v: jaxflash.flash_attention(
        q, k, v, causal=causal, implementation="mosaic_gpu",
        config=cfg).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, (0, 1, 2)))(*args)

  base = mosaic_gpu.MosaicConfig()
  want = grads(base)
  got = grads(dataclasses.replace(base, bwd_atomic_dq=True))
  for name, g, w in zip("qkv", got, want):
    scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
    err = numerics.max_abs_diff(g, w)
    assert err <= 2 ** -7 * scale, (name, err, scale)


def test_dispatch_refuses_what_it_cannot_serve():
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  attend = functools.partial(jaxflash.flash_attention,
                             implementation="mosaic_gpu", interpret=True)
  with pytest.raises(NotImplementedError, match="bfloat16 and float16"):
    attend(q.astype(jnp.float32), q.astype(jnp.float32),
           q.astype(jnp.float32))
  if jax.default_backend() != "gpu":
    with pytest.raises(NotImplementedError, match="needs an sm90 GPU"):
      jaxflash.flash_attention(q, q, q, implementation="mosaic_gpu")
  # A sequence falls through to the next backend that can serve the call.
  out = jaxflash.flash_attention(
      q.astype(jnp.float32), q.astype(jnp.float32), q.astype(jnp.float32),
      implementation=("mosaic_gpu", "triton"), interpret=True)
  assert out.shape == q.shape


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_through_flash_attention_interpret(soft_cap):
  args = numerics.random_inputs(jax.random.key(5), batch=1, q_len=128,
                                kv_len=128, heads=2, kv_heads=1, head_dim=64,
                                dtype=jnp.bfloat16)
  fn = functools.partial(jaxflash.flash_attention, causal=True,
                         return_lse=True, implementation="mosaic_gpu",
                         interpret=True, logits_soft_cap=soft_cap)
  numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                      causal=True, logits_soft_cap=soft_cap)


# Backward forms under a soft cap, in the interpreter: (head_dim, config).
_SOFT_CAP_FORMS = {
    # Consumer 0 hands over P^T (1 - tanh^2) (P (1 - tanh^2)), which
    # consumer 1's dS needs and cannot compute without S.
    "paired-dkv-d64": (64, dataclasses.replace(ONE_WG, bwd_paired_dkv=True)),
    "paired-dkv-d256": (256, dataclasses.replace(ONE_WG,
                                                 bwd_paired_dkv=True)),
    "paired-dq-d64": (64, dataclasses.replace(ONE_WG, bwd_paired_dkv=True,
                                              bwd_paired_dq=True)),
    "paired-dq-d256": (256, dataclasses.replace(ONE_WG, bwd_paired_dkv=True,
                                                bwd_paired_dq=True)),
    # P and tanh computed under dP's wgmma, dS (times 1 - tanh^2) under
    # dV's; the dQ kernel's at head_dim 256.
    "softmax-overlap-d64-2wg": (64, dataclasses.replace(
        TWO_WG, bwd_softmax_overlap=True)),
    "softmax-overlap-d256-paired-dkv": (256, dataclasses.replace(
        PAIRED_DKV, bwd_softmax_overlap=True)),
}


# Soft-cap forms whose forward kernel another form builds (the paired
# forms' forward is ONE_WG's): the backward only.
_SOFT_CAP_PARTS = {"paired-dq-d64": "bwd", "paired-dq-d256": "bwd",
                   "softmax-overlap-d256-paired-dkv": "bwd"}


def _soft_cap_runs():
  return [Run(form, _SOFT_CAP_PARTS.get(form, "fwd+bwd"),
              (1, 100, 130, 2, 1, head_dim), jnp.bfloat16, cfg, seed=6,
              causal=True, soft_cap=2.0)
          for form, (head_dim, cfg) in _SOFT_CAP_FORMS.items()]


@pytest.mark.parametrize("run", _params(_soft_cap_runs()))
def test_soft_cap_interpret(run):
  _run_interpreted(run)


@pytest.mark.gpu
@pytest.mark.parametrize("paired_dq", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_paired_soft_cap(causal, paired_dq):
  """The H200 form of test_soft_cap_interpret's paired forms, at head_dim
  256."""
  args = numerics.random_inputs(jax.random.key(9), batch=2, q_len=1000,
                                kv_len=1000, heads=8, kv_heads=2,
                                head_dim=256, dtype=jnp.bfloat16)
  cfg = dataclasses.replace(
      mosaic_gpu.default_config(jax.devices()[0].device_kind, 256),
      bwd_paired_dkv=True, bwd_paired_dq=paired_dq)
  fn = functools.partial(jaxflash.flash_attention, causal=causal,
                         return_lse=True, implementation="mosaic_gpu",
                         logits_soft_cap=30.0, config=cfg)
  numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                      causal=causal, logits_soft_cap=30.0)


@pytest.mark.gpu
def test_gpu_default_dispatch_is_mosaic_on_hopper():
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  text = str(jax.make_jaxpr(jaxflash.flash_attention)(q, q, q))
  kind = jax.devices()[0].device_kind
  if "H100" in kind or "H200" in kind:
    assert "mosaic" in text.lower()


def test_interpreter_thread_guard(monkeypatch):
  """Too few host devices would deadlock the interpreter: refused."""
  from jaxflash.mosaic_gpu import backend
  monkeypatch.setattr(backend.jax, "devices", lambda *a: [None, None])
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="needs >= 4 host devices"):
    mosaic_attention(q, q, q, mask=masks.MaskSpec(64, 64),
                         softmax_scale=0.1, config=TWO_WG, interpret=True)


def test_interpreter_thread_guard_hands_over(monkeypatch):
  """The guard is part of the backend's check_supported, so a list of
  backends moves on to the next instead of failing inside the call."""
  from jaxflash.mosaic_gpu import backend
  real = jax.devices
  monkeypatch.setattr(backend.jax, "devices", lambda *a: (
      [None, None] if a == ("cpu",) else real(*a)))
  q = jax.random.normal(jax.random.key(0), (1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="host devices"):
    jaxflash.flash_attention(q, q, q, implementation="mosaic_gpu",
                             interpret=True)
  got = jaxflash.flash_attention(q, q, q, implementation=(
      "mosaic_gpu", "triton"), interpret=True)
  want = jaxflash.flash_attention(q, q, q, implementation="triton",
                                  interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("stats_in_acc", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_soft_cap(causal, overlap, stats_in_acc):
  args = numerics.random_inputs(jax.random.key(9), batch=2, q_len=1000,
                                kv_len=1000, heads=8, kv_heads=2,
                                head_dim=128, dtype=jnp.bfloat16)
  # The call's tuned default, with and without bwd_softmax_overlap (and
  # its bwd_early_dv) and bwd_stats_in_acc (which folds only delta under
  # a soft cap).
  cfg = mosaic_gpu.default_config(jax.devices()[0].device_kind, 128,
                                  causal=causal, kv_len=1000)
  cfg = dataclasses.replace(
      cfg, bwd_softmax_overlap=overlap, bwd_stats_in_acc=stats_in_acc,
      bwd_early_dv=overlap and cfg.bwd_early_dv)
  fn = functools.partial(jaxflash.flash_attention, causal=causal,
                         return_lse=True, implementation="mosaic_gpu",
                         logits_soft_cap=30.0, config=cfg)
  numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                      causal=causal, logits_soft_cap=30.0)


SEG_CASES = [
    ("packed-causal-2wg", 256, 256, True, None, dict(docs=5, pad=9), TWO_WG),
    ("lengths-q200-k300", 200, 300, False, None,
     dict(q_len=[150, 200], kv_len=[300, 7]), ONE_WG),
    ("packed-lengths-window", 256, 256, True, (60, 0),
     dict(docs=4, pad=0, kv_len=[256, 100]), DEEP),
    ("packed-causal-persistent", 256, 256, True, None, dict(docs=5, pad=9),
     PERSISTENT_2WG),
    ("packed-causal-2wg-overlap", 256, 256, True, None, dict(docs=5, pad=9),
     dataclasses.replace(TWO_WG, intra_wg_overlap=True)),
    ("packed-causal-2wg-softmax-overlap", 256, 256, True, None,
     dict(docs=5, pad=9),
     dataclasses.replace(TWO_WG, bwd_softmax_overlap=True)),
    # Three consumers (the d64 default from 4096 keys): 192-row groups'
    # key-tile ranges.
    ("packed-causal-3wg", 256, 256, True, None, dict(docs=5, pad=9),
     dataclasses.replace(TWO_WG, compute_wgs=3, schedule_barrier=False)),
    # One key tile per dK/dV program: the group range narrows per tile.
    ("packed-lengths-paired-dkv", 256, 256, True, None,
     dict(docs=4, pad=7, kv_len=[256, 150]),
     dataclasses.replace(ONE_WG, bwd_paired_dkv=True)),
    # One query tile per dQ program: the group range narrows per tile.
    ("packed-lengths-paired-dq", 256, 256, True, None,
     dict(docs=4, pad=7, q_len=[256, 130]),
     dataclasses.replace(TWO_WG, bwd_paired_dq=True)),
    # 80-query steps of the dK/dV kernel: each key group's range of
    # 80-row steps (the interpreter pads the queries to 640, a multiple of
    # both kernels' tiles; the GPU form, GPU_SEG_OVERRIDES, also pads the
    # segment ids past q_pad to whole steps).
    ("packed-lengths-dkv-q80", 256, 256, False, None,
     dict(docs=4, pad=7, q_len=[256, 130]),
     dataclasses.replace(TWO_WG, bwd_dkv_block_q=80)),
]


# SEG_CASES entries whose forward or backward kernels another entry
# builds (packed-causal-2wg's: the same shapes, a forward or a backward
# option over TWO_WG): the other part only.
_SEG_PARTS = {"packed-causal-persistent": "fwd",
              "packed-causal-2wg-overlap": "fwd", "packed-causal-3wg": "fwd",
              "packed-causal-2wg-softmax-overlap": "bwd",
              "packed-lengths-paired-dq": "bwd"}


def _segment_runs():
  return [Run(name, _SEG_PARTS.get(name, "fwd+bwd"), (2, t, s, 4, 2, 64),
              jnp.bfloat16, cfg, seed=t + s, causal=causal, window=window,
              segments=spec_kw, softmax_scale=0.125)
          for name, t, s, causal, window, spec_kw, cfg in SEG_CASES]


# FlashMask in the Hopper kernels: its columns' element mask on the
# computed tiles outside the run it leaves fully visible (on every one
# with lengths, as segment ids), each group's tile range narrowed to the
# tiles it leaves.
FLASH_RUNS = [
    Run("flashmask-prefix-2wg", "fwd+bwd", (1, 256, 256, 2, 1, 64),
        jnp.bfloat16, TWO_WG, seed=5, flash="prefix"),
    Run("flashmask-question-lengths", "fwd+bwd", (2, 256, 256, 4, 2, 64),
        jnp.bfloat16, ONE_WG, seed=6, flash="question",
        segments=dict(kv_len=[256, 200])),
    Run("flashmask-blocks-causal-paired", "fwd+bwd", (2, 256, 256, 4, 2, 64),
        jnp.bfloat16, dataclasses.replace(ONE_WG, bwd_paired_dkv=True,
                                          bwd_paired_dq=True),
        seed=7, causal=True, flash="blocks"),
    # Gaps in the persistent forward's chained, overlapped loop: the ring's
    # steps run on across items that skip different tiles.
    Run("flashmask-global-window-persistent", "fwd", (2, 384, 384, 4, 2, 64),
        jnp.bfloat16, dataclasses.replace(TWO_WG, persistent=True,
                                          intra_wg_overlap=True,
                                          item_overlap=True),
        seed=9, flash="global-window"),
    # The paired dQ kernel over a shared question's gaps.
    Run("flashmask-question-paired-dq", "bwd", (1, 256, 256, 2, 1, 64),
        jnp.bfloat16, dataclasses.replace(ONE_WG, bwd_paired_dq=True),
        seed=10, flash="question"),
]


@pytest.mark.parametrize("run", _params(FLASH_RUNS))
def test_flashmask_interpret(run):
  _run_interpreted(run)


# ALiBi in the Hopper forward: the plain and overlapped loops, causal and
# not, q_len != kv_len (the backward's: TERMS_RUNS).
ALIBI_RUNS = [
    Run("alibi-causal-2wg", "fwd", (2, 200, 300, 4, 2, 64), jnp.bfloat16,
        TWO_WG, seed=8, causal=True, alibi=True),
    Run("alibi-overlap-full", "fwd", (2, 256, 256, 4, 4, 64), jnp.bfloat16,
        dataclasses.replace(TWO_WG, intra_wg_overlap=True), seed=9,
        alibi=True),
]


@pytest.mark.parametrize("run", _params(ALIBI_RUNS))
def test_alibi_interpret(run):
  _run_interpreted(run)


# A dense bias in the Hopper kernels: its tiles streamed beside V in the
# forward's plain, overlapped and persistent loops, per head and per
# batch row, or one row of keys read from GMEM, with -inf entries.
BIAS_RUNS = [
    Run("bias-causal-2wg", "fwd", (2, 200, 300, 4, 2, 64), jnp.bfloat16,
        TWO_WG, seed=11, causal=True, bias="head"),
    Run("bias-overlap-persistent", "fwd", (2, 256, 256, 4, 4, 64),
        jnp.bfloat16, dataclasses.replace(PERSISTENT_2WG,
                                          intra_wg_overlap=True),
        seed=12, bias="batch"),
    Run("bias-grads-1wg", "fwd+bwd", (2, 130, 100, 2, 1, 32), jnp.bfloat16,
        ONE_WG, seed=13, causal=True, bias="head"),
    Run("bias-row-overlap", "fwd", (1, 200, 300, 2, 1, 128), jnp.bfloat16,
        dataclasses.replace(TWO_WG, intra_wg_overlap=True), seed=16,
        bias="row"),
    Run("bias-packed-flashmask", "fwd", (2, 256, 256, 4, 2, 64),
        jnp.bfloat16, TWO_WG, seed=17, causal=True, bias="batch",
        segments=dict(docs=3, pad=10, kv_len=[256, 200]), flash="prefix"),
    # The Hopper backward with the bias: its rings beside K/V (dQ) and
    # beside Q (dK/dV, read transposed), one row of keys from GMEM, and
    # dbias from the dQ kernel's dS tiles (bfloat16, or float32 for
    # float16 inputs; summed over broadcast axes).
    Run("bias-dbias-full-2wg", "bwd", (1, 200, 160, 2, 1, 64), jnp.bfloat16,
        TWO_WG, seed=27, causal=True, bias="full", bias_grad=True),
    Run("bias-dbias-row-segments-fp16", "bwd", (2, 130, 100, 2, 1, 32),
        jnp.float16, ONE_WG, seed=28, bias="row", bias_grad=True,
        segments=dict(kv_len=[100, 70])),
]


@pytest.mark.parametrize("run", _params(BIAS_RUNS))
def test_bias_interpret(run):
  _run_interpreted(run)


# Attention dropout in the Hopper forward (the keep mask hashed per tile,
# the backward regenerating it): the plain and overlapped loops, per head
# and shared, the seeds' row and head offsets.
DROPOUT_RUNS = [
    Run("dropout-causal-2wg", "fwd+bwd", (2, 200, 300, 4, 2, 64),
        jnp.bfloat16, TWO_WG, seed=18, causal=True, dropout=0.25),
    Run("dropout-overlap-shared", "fwd", (2, 256, 256, 4, 4, 64),
        jnp.bfloat16, dataclasses.replace(TWO_WG, intra_wg_overlap=True),
        seed=19, dropout=0.5, dropout_shared=True),
]


@pytest.mark.parametrize("run", _params(DROPOUT_RUNS))
def test_dropout_interpret(run):
  _run_interpreted(run)


# The Hopper backward's mask terms together: a dense mask (its tile ranges
# per query group and per key group, its elements from GMEM, transposed
# for dK/dV), ALiBi's bias from the index vectors and dropout's keep mask
# regenerated in both kernels; per batch row with lengths, and one row of
# keys with a keep mask shared by the heads.
TERMS_RUNS = [
    Run("terms-bwd-documents-2wg", "bwd", (1, 200, 300, 2, 1, 64),
        jnp.bfloat16, TWO_WG, seed=29, causal=True, dense="documents",
        alibi=True, dropout=0.2, segments=dict(kv_len=[250])),
    Run("terms-bwd-keys-1wg", "bwd", (2, 130, 100, 2, 1, 32), jnp.bfloat16,
        ONE_WG, seed=30, dense="keys", dropout=0.3, dropout_shared=True),
]


@pytest.mark.parametrize("run", _params(TERMS_RUNS))
def test_backward_terms_interpret(run):
  _run_interpreted(run)


# A dense boolean mask in the Hopper forward: the tiles it hides skipped
# and its fully visible run left unmasked (its tile ranges in
# seg_range), its tiles read from GMEM elsewhere; per batch row with
# lengths, one row of keys (per head: _dense_mask_call; the backward's:
# TERMS_RUNS).
DENSE_RUNS = [
    Run("dense-documents-overlap", "fwd", (2, 256, 300, 2, 1, 64),
        jnp.bfloat16, dataclasses.replace(TWO_WG, intra_wg_overlap=True),
        seed=24, causal=True, dense="documents",
        segments=dict(kv_len=[300, 250])),
    Run("dense-keys-persistent", "fwd", (2, 256, 256, 2, 1, 96),
        jnp.bfloat16, PERSISTENT_2WG, seed=26, dense="keys"),
]


@pytest.mark.parametrize("run", _params(DENSE_RUNS))
def test_dense_mask_interpret(run):
  _run_interpreted(run)


# FP8 (FlashAttention-3's low-precision forward): e4m3 Q K^T, V^T's tiles
# K-major, P rounded to e4m3 in shared memory, the dequantization scales
# folded into the softmax scale and the epilogue; the plain and
# overlapped loops, GQA, e5m2 keys and values, the soft cap and masks.
FP8_RUNS = [
    Run("fp8-causal-2wg", "fwd", (1, 200, 300, 4, 2, 64),
        jnp.float8_e4m3fn, TWO_WG, seed=21, causal=True,
        fp8_kv=jnp.float8_e4m3fn),
    Run("fp8-e5m2-persistent-overlap", "fwd", (2, 256, 256, 2, 1, 96),
        jnp.float8_e4m3fn,
        dataclasses.replace(PERSISTENT_2WG, intra_wg_overlap=True),
        seed=23, causal=True, soft_cap=20.0,
        segments=dict(docs=3, pad=10, kv_len=[256, 200]),
        fp8_kv=jnp.float8_e5m2),
]


@pytest.mark.parametrize("run", _params(FP8_RUNS))
def test_fp8_interpret(run):
  _run_interpreted(run)


def test_fp8_default_configs():
  """The FP8 forward's default config is the tuned 16-bit one through
  with_fp8, with 256-key tiles at padded head_dim 128 (FP8_BLOCK_KV) from
  FP8_WIDE_MIN_KV keys, for every device kind and call class; each fits
  (fp8_problem)."""
  import json
  from importlib import resources

  from jaxflash.mosaic_gpu import config as cfg_lib
  tuning = json.loads(resources.files("jaxflash.mosaic_gpu")
                      .joinpath("tuning.json").read_text())
  for kind in (*tuning["devices"], *tuning["aliases"]):
    for dp in (64, 96, 128, 256):
      for causal in (False, True):
        for kv_len in (1024, 8192, 32768):
          tuned = cfg_lib.default_config(kind, dp, causal=causal,
                                         kv_len=kv_len)
          got = cfg_lib.fp8_default(tuned, dp, kv_len)
          assert cfg_lib.fp8_problem(got, dp) is None, (kind, dp, causal)
          want = cfg_lib.with_fp8(tuned)
          if dp == 128 and kv_len >= cfg_lib.FP8_WIDE_MIN_KV:
            want = dataclasses.replace(want, block_kv=256)
          assert got == want, (kind, dp, causal, kv_len, got)


def test_mask_tiles_default(monkeypatch):
  """A call with a FlashMask or a dense mask and no config of its own
  takes the tuned config with its key tile rounded down to a power of
  two (with_mask_tiles: 176 becomes 128); other calls, configs the
  caller gives and jaxflash.autotune's stored winners keep theirs."""
  from jaxflash import checks, flashmask
  from jaxflash.masks import MaskArrays
  from jaxflash.mosaic_gpu import backend
  from jaxflash.mosaic_gpu import config as cfg_lib
  for bk, want in ((176, 128), (128, 128), (64, 64), (256, 256)):
    cfg = dataclasses.replace(cfg_lib.INTERPRET_CONFIG, block_kv=bk)
    assert cfg_lib.with_mask_tiles(cfg).block_kv == want
  wide = dataclasses.replace(cfg_lib.INTERPRET_CONFIG, block_kv=176)
  stored = {}
  monkeypatch.setattr(backend, "default_config", lambda *a, **kw: wide)
  monkeypatch.setattr(backend.autotuned, "lookup",
                      lambda *a: stored.get("config"))
  q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  spec = checks.mask_spec(256, 256, causal=False, offset=None,
                          local_window_size=None)
  cols = flashmask.columns(jaxflash.FlashMask.document(
      jnp.zeros((1, 256), jnp.int32)).check(1, 2, 256, 256))
  dense = jnp.ones((1, 1, 256, 256), bool)
  plan = lambda config=None, **arrays: backend._plan(
      q, q, spec, 0.1, config, False, arrays=MaskArrays(**arrays)).config
  assert plan(flash_mask=cols).block_kv == 128
  assert plan(dense_mask=dense).block_kv == 128
  assert plan().block_kv == 176
  assert plan(wide, flash_mask=cols).block_kv == 176
  stored["config"] = wide
  assert plan(flash_mask=cols).block_kv == 176


def _bias_call(interpret, t=200, s=300, d=64, form="head", causal=True):
  """flash_attention with a dense bias (with -inf entries; ``form`` as
  :func:`_dense_bias`'s) on the Hopper kernels: out and dq, dk, dv by the
  numerics rule, dbias against the XLA path's."""
  args = numerics.random_inputs(jax.random.key(14), batch=2, q_len=t,
                                kv_len=s, heads=4, kv_heads=2, head_dim=d,
                                dtype=jnp.bfloat16)
  bias = _dense_bias(Run("b", "fwd", (2, t, s, 4, 2, d), jnp.bfloat16,
                         ONE_WG, seed=15, bias=form))
  attend = lambda impl, q, k, v, bias: jaxflash.flash_attention(
      q, k, v, causal=causal, bias=bias, return_lse=True,
      implementation=impl, interpret=interpret and impl != "xla")
  fn = lambda q, k, v: attend("mosaic_gpu", q, k, v, bias)
  numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                      causal=causal,
                      bias=bias.astype(jnp.bfloat16).astype(jnp.float32))
  q, k, v, do, _ = args

  def dbias(impl):
    out, vjp = jax.vjp(lambda b: attend(impl, q, k, v, b)[0], bias)
    return vjp(do.astype(out.dtype))[0]
  got, want = dbias("mosaic_gpu"), dbias("xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                             atol=2e-2 * float(np.abs(want).max()))


@pytest.mark.slow
def test_bias_gradients_through_the_hopper_backward():
  """The dense bias's forward and backward on the Hopper kernels, dbias
  included, through flash_attention's VJP (interpreted)."""
  _bias_call(True)


@pytest.mark.gpu
@pytest.mark.parametrize("d,form,causal", [
    (128, "head", True), (64, "full", False), (128, "row", True),
    (96, "batch", False)])
def test_bias_gpu(d, form, causal):
  _bias_call(False, t=1000, s=1500, d=d, form=form, causal=causal)


def _dense_mask_call(interpret, t=256, s=300, d=64):
  """flash_attention with a dense boolean mask (per head, one row hidden
  entirely) on the Hopper forward and backward: out, LSE and dq, dk, dv
  by the numerics rule."""
  args = numerics.random_inputs(jax.random.key(16), batch=2, q_len=t,
                                kv_len=s, heads=4, kv_heads=2, head_dim=d,
                                dtype=jnp.bfloat16)
  mask = _dense_mask(Run("m", "fwd", (2, t, s, 4, 2, d), jnp.bfloat16,
                         ONE_WG, seed=17, dense="head"))
  fn = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, causal=True, mask=mask, return_lse=True,
      implementation="mosaic_gpu", interpret=interpret)
  numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                      causal=True, dense_mask=mask)


@pytest.mark.slow
def test_dense_mask_gradients_through_the_hopper_backward():
  """A per-head dense mask through the Hopper forward and backward
  (interpreted)."""
  _dense_mask_call(True)


@pytest.mark.gpu
def test_dense_mask_gpu():
  _dense_mask_call(False, t=1000, s=1500, d=128)


def _alibi_call(interpret, t=200, s=300, d=64):
  args = numerics.random_inputs(jax.random.key(10), batch=2, q_len=t,
                                kv_len=s, heads=4, kv_heads=2, head_dim=d,
                                dtype=jnp.bfloat16)
  slopes = 2.0 ** -jnp.arange(1, 5, dtype=jnp.float32)
  fn = functools.partial(jaxflash.flash_attention, return_lse=True,
                         causal=True, alibi_slopes=slopes,
                         implementation="mosaic_gpu", interpret=interpret)
  bias = masks.alibi_bias(slopes[None, :, None, None], jnp.arange(t)[:, None],
                          jnp.arange(s)[None, :], s - t)
  numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                      causal=True, bias=bias)


@pytest.mark.slow
def test_alibi_gradients_through_the_triton_backward():
  """ALiBi's forward on the Hopper kernel, its gradients from the Triton
  backward kernels on the same residuals (interpreted)."""
  _alibi_call(True)


@pytest.mark.gpu
def test_alibi_gpu():
  _alibi_call(False, t=1000, s=1500, d=128)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,causal", [("prefix", False),
                                            ("question", False),
                                            ("blocks", True),
                                            ("documents", True)])
def test_flashmask_gpu(pattern, causal):
  """The Hopper kernels' FlashMask at head_dim 128, the tuned default."""
  args = numerics.random_inputs(jax.random.key(8), batch=2, q_len=1000,
                                kv_len=1000, heads=8, kv_heads=2,
                                head_dim=128, dtype=jnp.bfloat16)
  fm = FLASH_PATTERNS[pattern](2, 1000)
  fn = functools.partial(jaxflash.flash_attention, return_lse=True,
                         causal=causal, mask=fm, implementation="mosaic_gpu")
  numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                      causal=causal, dense_mask=fm.dense(1000))


@pytest.mark.parametrize("run", _params(_segment_runs()))
def test_segments_and_lengths_interpret(run):
  """Segment ids (packed documents, padding) and sequence lengths, which
  the kernel folds into segment ids; the group's key-tile range narrows to
  the tiles whose ids can match."""
  _run_interpreted(run)


# What the GPU form of a SEG_CASES entry changes in the tuned default
# (the entries' own configs are interpreter configs); options that exclude
# the head_dim 128 default's intra_wg_overlap turn it off.
GPU_SEG_OVERRIDES = {
    "packed-causal-persistent": dict(persistent=True),
    "packed-causal-2wg-overlap": dict(intra_wg_overlap=True,
                                      persistent=False),
    "packed-causal-2wg-softmax-overlap": dict(bwd_softmax_overlap=True),
    "packed-lengths-paired-dkv": dict(bwd_paired_dkv=True),
    "packed-lengths-paired-dq": dict(bwd_paired_dq=True),
    # (Three consumers share the registers 3 ways: not the 2-way 240.)
    "packed-causal-3wg": dict(compute_wgs=3, intra_wg_overlap=False,
                              consumer_registers=None),
    "packed-lengths-dkv-q80": dict(bwd_dkv_block_q=80),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", SEG_CASES, ids=[c[0] for c in SEG_CASES])
def test_segments_and_lengths_gpu(case):
  """The Hopper path at head_dim 128 with the tuned default, changed as
  ``GPU_SEG_OVERRIDES`` says for the entries that test an option."""
  name, t, s, causal, window, spec_kw, _ = case
  from test_mask_features import packed_segments
  args = numerics.random_inputs(jax.random.key(7), batch=2, q_len=t,
                                kv_len=s, heads=8, kv_heads=2, head_dim=128,
                                dtype=jnp.bfloat16)
  kw = dict(causal=causal, local_window_size=window)
  if "docs" in spec_kw:
    kw["segment_ids"] = packed_segments(jax.random.key(3), 2, t,
                                        spec_kw["docs"],
                                        pad_tail=spec_kw["pad"])
  if "q_len" in spec_kw:
    kw["q_seq_lengths"] = jnp.array(spec_kw["q_len"])
  if "kv_len" in spec_kw:
    kw["kv_seq_lengths"] = jnp.array(spec_kw["kv_len"])
  config = None
  if name in GPU_SEG_OVERRIDES:
    config = dataclasses.replace(
        mosaic_gpu.default_config(jax.devices()[0].device_kind, 128,
                                  causal=causal, kv_len=s),
        **GPU_SEG_OVERRIDES[name])
  fn = functools.partial(jaxflash.flash_attention, return_lse=True,
                         implementation="mosaic_gpu", config=config, **kw)
  kw.pop("local_window_size")
  numerics.check_rule(numerics.outputs_and_grads(fn, *args), *args,
                      **numerics.reference_kwargs(
                          local_window_size=window, **kw))


# -- backward ------------------------------------------------------------------

def _grads_twice(shape, config, interpret, causal=True, segments=False,
                 deterministic=None):
  t, h, kh, d = shape
  args = numerics.random_inputs(jax.random.key(11), batch=2, q_len=t,
                                kv_len=t, heads=h, kv_heads=kh, head_dim=d,
                                dtype=jnp.bfloat16)
  kw = {}
  if segments:
    from test_mask_features import packed_segments
    kw["segment_ids"] = packed_segments(jax.random.key(4), 2, t, 3,
                                        pad_tail=5)
  fn = functools.partial(jaxflash.flash_attention, causal=causal,
                         return_lse=True, implementation="mosaic_gpu",
                         interpret=interpret, config=config,
                         deterministic=deterministic, **kw)
  first = numerics.outputs_and_grads(fn, *args)
  # A second, separately compiled run of the same inputs.
  second = jax.jit(lambda *a: numerics.outputs_and_grads(fn, *a))(*args)
  for name, a, b in zip(numerics.NAMES, first, second):
    assert jnp.array_equal(a, b, equal_nan=True), f"{name} differs"


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_backward_is_deterministic(segments, head_dim):
  """deterministic=True: bitwise-equal gradients with the tuned default
  (whose d64 backward on the H200 otherwise adds dQ atomically)."""
  _grads_twice((2048, 8, 2, head_dim), None, False, segments=segments,
               deterministic=True)


def _layer_loss(params, x, attend):
  """A pre-norm self-attention block with a causal jaxflash attention."""
  b, t, width = x.shape
  heads, d = 4, width // 4
  h = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  qkv = (h @ params["qkv"]).reshape(b, t, 3, heads, d)
  q, k, v = (qkv[:, :, i].astype(jnp.bfloat16) for i in range(3))
  o = attend(q, k, v).astype(jnp.float32).reshape(b, t, width)
  y = x + o @ params["out"]
  return jnp.mean((y @ params["head"]) ** 2)


def _check_layer_grads(t, width, attend_kernel):
  ks = jax.random.split(jax.random.key(2), 4)
  params = dict(qkv=jax.random.normal(ks[0], (width, 3 * width)) / width**.5,
                out=jax.random.normal(ks[1], (width, width)) / width**.5,
                head=jax.random.normal(ks[2], (width, 8)) / width**.5)
  x = jax.random.normal(ks[3], (2, t, width))

  def grads(attend):
    return jax.jit(jax.grad(lambda p: _layer_loss(p, x, attend)))(params)

  def ref(upcast):
    def attend(q, k, v):
      if upcast:
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
      return jaxflash.reference.attention(q, k, v, causal=True,
                                          upcast=upcast)[0]
    return attend

  got, r32, rlp = grads(attend_kernel), grads(ref(True)), grads(ref(False))
  for name in params:
    err = numerics.max_abs_diff(got[name], r32[name])
    lp_err = numerics.max_abs_diff(rlp[name], r32[name])
    scale = float(jnp.max(jnp.abs(r32[name])))
    assert err <= 2 * lp_err + 2 ** -8 * scale, (name, err, lp_err, scale)


def test_transformer_layer_grad_interpret():
  """jax.grad of a whole attention block through the Hopper kernels (in
  the interpreter) obeys the numerics rule against the reference."""
  _check_layer_grads(64, 128, functools.partial(
      jaxflash.flash_attention, causal=True, implementation="mosaic_gpu",
      interpret=True))


@pytest.mark.gpu
def test_gpu_transformer_layer_grad():
  _check_layer_grads(1024, 512, functools.partial(
      jaxflash.flash_attention, causal=True, implementation="mosaic_gpu"))


def test_interpreter_refused_inside_multi_device_shard_map():
  """jax 0.11.2's Mosaic GPU interpreter fails inside shard_map over
  several devices (a barrier left allocated): NotImplementedError with the
  reason; on one device it runs."""
  from jax.sharding import PartitionSpec as P
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  q = jax.random.normal(jax.random.key(0), (2, 64, 2, 64), jnp.bfloat16)
  attend = functools.partial(jaxflash.flash_attention,
                             implementation="mosaic_gpu", interpret=True,
                             config=ONE_WG)

  def sharded(n):
    mesh = jax.make_mesh((n,), ("b",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n])
    return jax.jit(jax.shard_map(lambda q: attend(q, q, q), mesh=mesh,
                                 in_specs=P("b"), out_specs=P("b"),
                                 check_vma=False))(q)

  with pytest.raises(NotImplementedError, match="over 2 devices"):
    sharded(2)
  np.testing.assert_array_equal(sharded(1), attend(q, q, q))



# -- the interpreter runs' selection -------------------------------------------

def interpreter_runs() -> list[Run]:
  """Every interpreter run of this file's kernel tests."""
  return (_base_runs() + _variant_runs() + _segment_runs()
          + _soft_cap_runs() + FLASH_RUNS + ALIBI_RUNS + BIAS_RUNS
          + DROPOUT_RUNS + TERMS_RUNS + DENSE_RUNS + FP8_RUNS)


def run_cost(run: Run) -> float:
  """A run's relative cost in the interpreter (mostly XLA compiling the
  interpreted kernels): one forward kernel, two backward ones."""
  return {"fwd": 1.0, "bwd": 2.0, "fwd+bwd": 3.0}[run.part]


def coverage(run: Run, lines) -> frozenset:
  """What a run covers: each line of jaxflash/mosaic_gpu it reaches while
  traced, at its head_dim rounded up to 64 (64, 128 or 256: the shapes
  of the tiles, wgmma operands, output chunks and swizzles each line
  builds; the forward's own 80 or 96 count as 128).
  Lines alone are reached by a handful of runs; with the head_dim, about
  thirty."""
  return frozenset((*line, -(-run.shape[5] // 64) * 64) for line in lines)


def traced_parts(runs=None):
  """``{run name: {part: (kernels' function, abstract arguments)}}`` for
  kernel_coverage.trace_runs."""
  out = {}
  for run in runs or interpreter_runs():
    b, t, s, h, kh, d = run.shape
    q = jax.ShapeDtypeStruct((b, t, h, d), run.dtype)
    kv = jax.ShapeDtypeStruct((b, s, kh, d), run.fp8_kv or run.dtype)
    lse = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
    arrays, _ = _mask_arrays(run)
    parts = {}
    if "fwd" in run.part:
      parts["fwd"] = (_forward_kernel(run, arrays), (q, kv, kv))
    if "bwd" in run.part:
      parts["bwd"] = (_backward_kernels(run, arrays),
                      (q, kv, kv, q, lse, q, lse))
    out[run.name] = parts
  return out


def test_per_commit_runs_reach_every_kernel_line():
  """Traces every interpreter run (no execution; tens of seconds): no two
  runs build the same forward or the same backward kernels, each run's
  backward part is the Hopper backward's, and the PER_COMMIT runs cover
  (:func:`coverage`) all that the runs cover."""
  runs = interpreter_runs()
  names = [run.name for run in runs]
  assert len(set(names)) == len(names), "run names given twice"
  assert all(_serves_backward(run) for run in runs if "bwd" in run.part)
  traced = kernel_coverage.trace_runs(traced_parts(runs))
  dups = kernel_coverage.duplicates(traced)
  assert not dups, "runs that build the kernels of another run:\n" + (
      "\n".join(f"{part}: {name} = {earlier}" for part, name, earlier
                in dups))
  stale = sorted(set(PER_COMMIT) - set(names))
  missing = sorted(kernel_coverage.uncovered(
      {run.name: coverage(run, traced[run.name][0]) for run in runs},
      PER_COMMIT))
  assert not stale and not missing, (
      f"PER_COMMIT names no run {stale} or misses (file, line, head_dim)"
      f" {missing[:20]} ({len(missing)} in all) that other runs reach:"
      f" print the new selection with `{kernel_coverage.REGENERATE}` and"
      " paste it over PER_COMMIT in tests/test_mosaic_gpu.py")


def test_row_buffer_views_share_their_bytes():
  """pipeline.row_buffer's two views of a buffer (tiled for wgmma, rows
  for TMA) must name the same bytes: both start at the union's first
  byte and span it.  jax documents a RefUnion's layout as unspecified; a
  jax that moved a member would fail here instead of writing a tile the
  kernel never reads."""
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  union = pipeline.row_buffer((2, 64, 64), jnp.bfloat16)
  tiled, rows = gpu_core.flatten_ref_union(union.get_ref_aval())
  assert union.shape == (2 * 64 * 64 * 2,)
  for view in (tiled, rows):
    assert view.transforms[0].offset == 0 and view.shape == (2, 64, 64)
  assert [type(t).__name__ for t in tiled.transforms[1:]] == [
      "UnswizzleRef", "UntilingTransform"]
  assert [t.swizzle for t in rows.transforms[1:]] == [128]
  with pytest.raises(ValueError, match="not one swizzle wide"):
    pipeline.row_buffer((64, 96), jnp.bfloat16)


@pytest.mark.parametrize("kw,q,kv", [
    (dict(), True, True),                    # ViT's 577 tokens
    (dict(lengths=(576, 577)), False, True),  # 8 divides the queries
    (dict(interpret=True), False, False),    # the interpreter's views
    (dict(head_dim=96), False, False),       # three 32-column swizzles
    (dict(block_kv=80), True, False),        # V's 16-column swizzle
    (dict(unpadded_q=False), False, True),
    (dict(fp8=True), False, False),
])
def test_row_copies_where_the_rows_match_the_tiles(kw, q, kv):
  """Which arrays the forward copies by rows (forward.row_copies) and
  whether the backward does (backward.row_copies: both flags, the
  unpaired kernels, whole tiles of the head_dim)."""
  from jaxflash.mosaic_gpu import backward as bwd_lib
  t, s = kw.get("lengths", (577, 577))
  d = kw.get("head_dim", 64)
  cfg = dataclasses.replace(
      mosaic_gpu.default_config("NVIDIA H200", 64, causal=False,
                                kv_len=s),
      block_kv=kw.get("block_kv", 128),
      unpadded_q=kw.get("unpadded_q", True))
  prob = fwd_lib.Problem(mask=masks.MaskSpec(t, s, False),
                         softmax_scale=0.125, batch=1, num_heads=2,
                         num_kv_heads=2, q_pad=640, kv_pad=640,
                         head_dim_padded=d, fp8=kw.get("fp8", False))
  interpret = kw.get("interpret", False)
  assert fwd_lib.row_copies(prob, cfg, t, s, interpret) == (
      fwd_lib.RowCopies(q=q, kv=kv))
  back = bwd_lib.row_copies(prob, cfg, t, s, interpret)
  assert back == (cfg.unpadded_q and not interpret and d == 64)
  assert not bwd_lib.row_copies(prob, cfg, 640, 640, interpret)
  assert not bwd_lib.row_copies(
      prob, dataclasses.replace(cfg, bwd_paired_dq=True,
                                bwd_atomic_dq=False), t, s, interpret)


def test_backward_statistics_cover_the_last_dkv_step():
  """lse2 and delta run as long as the dK/dV kernel's last query step
  (bwd_dkv_block_q need not divide q_pad): +inf and 0 past the rows, so
  that P = 0 there whatever a key bias adds (a zero-filled lse2 with a
  bias above 88.7 gave P = inf and NaN gradients)."""
  q = jnp.ones((1, 100, 2, 64), jnp.bfloat16)
  lse = jnp.zeros((1, 2, 100), jnp.float32)
  cfg = dataclasses.replace(TWO_WG, bwd_dkv_block_q=80)
  prob = mosaic_kernels.backward_problem(
      q, q, masks.MaskSpec(100, 100, False), 0.125, cfg)
  *_, lse2, delta = mosaic_kernels.backward_operands(
      q, q, q, q, lse, q, lse, prob, cfg)
  assert prob.q_pad == 128  # two consumers' 64-row tiles; steps of 80
  assert lse2.shape == delta.shape == (1, 2, 160)
  assert np.all(np.isposinf(np.asarray(lse2[..., 100:])))
  np.testing.assert_array_equal(np.asarray(delta[..., 100:]), 0.0)


@pytest.mark.parametrize("form", ["rows", "keys"])
def test_dense_mask_tile_ranges_cover_every_visible_tile(form):
  """A dense mask's tile ranges, per group of held queries (forward, dQ)
  and per group of held keys (dK/dV, from the transposed summary): every
  tile with a visible element of any head lies in the visited range, and
  every tile of the unmasked run is visible throughout, and no tile of
  the gap the forward skips has one (else a tile would be skipped or left
  unmasked wrongly).  Random block-structured masks, brute force in
  NumPy."""
  rng = np.random.default_rng(0 if form == "rows" else 1)
  b, h, t, s = 2, 2, 96, 128
  held_q, bk, held_k, sq = 32, 16, 32, 24  # (rows 96 = 4 steps of 24)
  for _ in range(6):
    # Documents (blocks of 16 x 16 queries and keys, hidden across
    # documents), with 8 x 8 blocks inside them hidden, visible or random,
    # so that all three tile classes occur.
    doc_q = np.cumsum(rng.random(t // 16) < 0.4)
    doc_k = np.cumsum(rng.random(s // 16) < 0.4)
    same = np.repeat(np.repeat(doc_q[:, None] == doc_k[None, :], 2, 0),
                     2, 1)
    kind = np.where(same, rng.choice(3, (b, h, t // 8, s // 8),
                                     p=[0.2, 0.6, 0.2]), 0)
    noise = rng.random((b, h, t, s)) < 0.5
    block = np.repeat(np.repeat(kind, 8, 2), 8, 3)
    mask = np.where(block == 2, noise, block == 1)
    if form == "keys":
      mask = mask[:, :1, :1]
    mask_i8 = jnp.asarray(mask, jnp.int8)
    full_mask = np.broadcast_to(mask, (b, mask.shape[1], t, s))
    for held_is_q in (True, False):
      if held_is_q:
        n_groups, held, streamed = t // held_q, held_q, bk
        ranges = mosaic_kernels._dense_mask_ranges(
            mask_i8, b, n_groups, held, streamed)
        n_tiles = s // streamed
      else:
        n_groups, held, streamed = s // held_k, held_k, sq
        ranges = mosaic_kernels._dense_mask_ranges(
            mask_i8, b, n_groups, held, streamed, held_q=False,
            n_streamed=t // sq)
        n_tiles = t // sq
      ranges = np.asarray(ranges)
      assert ranges.shape == (b, 6, n_groups), (form, held_is_q)
      for bi in range(b):
        for g in range(n_groups):
          lo, hi, full_lo, full_hi, gap_lo, gap_hi = ranges[bi, :, g]
          assert lo <= gap_lo <= gap_hi <= hi
          for u in range(n_tiles):
            held_rows = slice(g * held, (g + 1) * held)
            tile_rows = slice(u * streamed, (u + 1) * streamed)
            elems = (full_mask[bi][:, held_rows, tile_rows] if held_is_q
                     else full_mask[bi][:, tile_rows, held_rows])
            if elems.any():
              assert lo <= u < hi, (form, held_is_q, bi, g, u)
              assert not gap_lo <= u < gap_hi, (form, held_is_q, bi, g, u)
            if full_lo <= u < full_hi:
              assert elems.all(), (form, held_is_q, bi, g, u)
  # A shared question's dense form: the last answer's rows skip the two
  # answers between it and the question.
  ids = jnp.minimum(jnp.arange(128) // 32, 3)[None]
  dense = jaxflash.FlashMask.shared_question(ids).dense(128)
  ranges = mosaic_kernels._dense_mask_ranges(
      jnp.asarray(dense, jnp.int8), 1, 4, 32, 16)
  assert np.asarray(ranges)[0, 4:, 3].tolist() == [2, 6]
