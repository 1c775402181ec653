"""The Hopper (sm90) kernels on (local) arrays: padding, the tuned config,
``forward``, ``backward`` and ``check_supported``.  Autodiff, batching and
partitioning are :mod:`jaxflash.op`'s, over these functions.

Both at the head_dim rounded up to 16 (``config.kernel_head_dim``: 80 and
96 run as themselves).  Forward: :mod:`jaxflash.mosaic_gpu.forward`.
Backward: the Hopper dK/dV
and dQ kernels of :mod:`jaxflash.mosaic_gpu.backward` for padded head_dim
<= 128.  Above that their two float32 accumulators (dK, dV) do not fit in
a warpgroup's registers: with ``MosaicConfig(bwd_paired_dkv=True)`` (the
tuned default there) two consumers share a key tile, one accumulating dV
and one dK (``bwd_paired_dq=True``, also the default there, does the same
for dQ: two consumers on one query tile); otherwise :func:`serves_backward`
is False and the backend registry (:mod:`jaxflash.backends`) runs the
Triton backward kernels instead (they need the same residuals: q, k, v,
the output and the log-sum-exp).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxflash import flashmask
from jaxflash import masks as masks_lib
from jaxflash._util import (
  pad_axis,
  require_cuda,
  round_up,
  sm_count,
  softmax_delta,
)
from jaxflash.masks import PAD_SEGMENT_ID, MaskArrays, MaskSpec
from jaxflash.mosaic_gpu import autotuned
from jaxflash.mosaic_gpu import backward as bwd_lib
from jaxflash.mosaic_gpu import forward as fwd_lib
from jaxflash.mosaic_gpu.config import (
  INTERPRET_CONFIG,
  MAX_BWD_HEAD_DIM,
  SMEM_LIMIT,
  MosaicConfig,
  default_config,
  dkv_head_splits,
  fp8_default,
  fp8_head_dim,
  fp8_problem,
  head_dim_problem,
  kernel_head_dim,
  with_bias_ring,
  with_fp8,
  with_mask_tiles,
)
from jaxflash.mosaic_gpu.pipeline import TMA_ROW_TILE

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
# The FP8 forward (q float8_e4m3fn; k, v e4m3 or e5m2: wgmma mixes the two
# formats) writes 16-bit outputs (its output slots' layout).
FP8_KV_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FP8_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
LOG2E = 1.4426950408889634
NO_MASK_ARRAYS = MaskArrays()


@dataclasses.dataclass(frozen=True)
class _Static:
  prob: fwd_lib.Problem
  config: MosaicConfig
  interpret: Any
  head_dim: int


def _interpret_params(interpret):
  if interpret is False or interpret is None:
    return None
  if interpret is True:
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return plgpu.InterpretGPUParams()
  return interpret  # an InterpretGPUParams instance


def _device_kind() -> str:
  return jax.devices()[0].device_kind


def autotune_key(q, k, mask: MaskSpec) -> str:
  """The call's class in the autotune cache (:mod:`.autotuned`)."""
  return autotuned.call_class(
      q, k, causal=mask.causal,
      window=mask.window_left is not None or mask.window_right is not None)


def _resolve_config(config: MosaicConfig | None, interpret,
                    dp: int, mask: MaskSpec,
                    deterministic: bool = False, q=None,
                    k=None, masked: bool = False) -> MosaicConfig:
  """The caller's config, else the interpretable one, else
  :func:`jaxflash.autotune`'s cached winner for this device kind and
  class of call (``q`` and ``k`` given), else the tuned default for this
  device kind, padded head_dim and call (``masked``: a call with a
  FlashMask or dense mask, :func:`config.with_mask_tiles`).
  ``deterministic`` turns a
  TMA reduce-add dQ (``bwd_atomic_dq``, summed in whatever order the
  programs finish) into the dQ kernel, which owns its tiles and sums in
  a fixed order."""
  if config is not None:  # its atomics were checked at the entry point
    return config
  if interpret:
    return INTERPRET_CONFIG
  if q is not None:
    config = autotuned.lookup(_device_kind(), autotune_key(q, k, mask))
  if config is None:
    config = default_config(_device_kind(), dp,
                            causal=mask.causal, kv_len=mask.kv_len)
    if masked:
      config = with_mask_tiles(config)
  if deterministic and config.bwd_atomic_dq:
    config = dataclasses.replace(config, bwd_atomic_dq=False)
  return config


def check_deterministic(config: MosaicConfig | None,
                        deterministic: bool) -> None:
  """ValueError when ``config`` asks for atomics that ``deterministic``
  forbids."""
  if deterministic and config is not None and config.bwd_atomic_dq:
    raise ValueError(
        "deterministic=True asks for bitwise-reproducible gradients, but"
        f" the config sets bwd_atomic_dq=True (dQ by atomic adds): {config}")


def _plan(q, k, mask: MaskSpec, softmax_scale: float,
          config: MosaicConfig | None, interpret,
          logits_soft_cap: float | None = None,
          arrays: MaskArrays = NO_MASK_ARRAYS, dropout_rate: float = 0.0,
          dropout_shared: bool = False, fp8_out_dtype=None) -> _Static:
  """The call's padded problem and config; ``fp8_out_dtype``: an FP8
  call's (its head_dim rounded to 32, the tuned config of that head_dim
  through :func:`config.with_fp8`)."""
  B, T, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  fp8 = fp8_out_dtype is not None
  dp = fp8_head_dim(D) if fp8 else kernel_head_dim(D)
  given = config
  if fp8:
    resolved = _resolve_config(config, interpret, dp, mask)
    config = (with_fp8(resolved) if given is not None or interpret
              else fp8_default(resolved, dp, mask.kv_len))
  else:
    config = _resolve_config(
        config, interpret, dp, mask, q=q, k=k,
        masked=arrays.flash_mask is not None or arrays.dense_mask is not None)
  if arrays.bias is not None and _bias_rows(arrays, T):
    # The bias's ring beside the K/V ring: the tuned config where both
    # fit, else one that gives up what with_bias_ring lists (a config the
    # caller gave is refused instead, by check_supported).
    fitted = with_bias_ring(config, dp)
    if fitted is None or (given is not None and fitted != config):
      raise NotImplementedError(_bias_ring_problem(config, dp))
    config = fitted
  prob = fwd_lib.Problem(
      mask=mask, softmax_scale=float(softmax_scale), batch=B, num_heads=H,
      num_kv_heads=K, q_pad=round_up(T, config.compute_wgs * config.block_q),
      kv_pad=round_up(S, config.block_kv), head_dim_padded=dp,
      logits_soft_cap=logits_soft_cap,
      **_mask_flags(arrays), bias_rows=_bias_rows(arrays, T),
      dropout_rate=float(dropout_rate), dropout_shared=dropout_shared,
      fp8=fp8, out_dtype=jnp.dtype(fp8_out_dtype) if fp8 else None)
  return _Static(prob=prob, config=config, interpret=interpret, head_dim=D)


# The widest padded head_dim whose tuned forward configs leave room for a
# dense bias's ring (with_bias_ring; at 256 the K/V ring alone takes 226
# KiB of 227).
MAX_BIAS_HEAD_DIM = 192


def _alibi_table(arrays: MaskArrays, prob: fwd_lib.Problem, per_unit: float):
  """ALiBi's table as the kernels read it (:func:`pipeline.alibi_tile`):
  ``alibi_slopes [B|1, H, 1, 2]`` -> ``[B, H, 2]`` float32, the slope
  times ``per_unit`` (the units of the logits it is added to), the
  position shift as it is.  (Built from scalars: an array constant
  cannot be closed over under custom_partitioning.)"""
  slopes = arrays.alibi_slopes[:, :, 0, :].astype(jnp.float32)
  return jnp.broadcast_to(
      jnp.stack([slopes[..., 0] * per_unit, slopes[..., 1]], axis=-1),
      (prob.batch, prob.num_heads, 2))


def _dropout_table(arrays: MaskArrays, prob: fwd_lib.Problem):
  """The forward's dropout input ``[B, H + 2]`` int32 from
  ``dropout_seeds [B, 4]`` (seed, first head, first row, first key):
  each head's :func:`jaxflash.masks.dropout_head_key` (head 0's for a
  shared mask), then the first row and key."""
  seeds = arrays.dropout_seeds.astype(jnp.int32)
  heads = jnp.arange(prob.num_heads, dtype=jnp.int32)[None, :]
  heads = 0 * heads if prob.dropout_shared else heads + seeds[:, 1:2]
  keys = masks_lib.dropout_head_key(seeds[:, :1], heads)
  return jnp.concatenate([keys, seeds[:, 2:4]], axis=1)


def _bias_rows(arrays: MaskArrays, q_len: int) -> bool:
  """Whether the bias has rows of its own (its ring), not one row shared
  by every query (read per key tile from GMEM)."""
  return arrays.bias is not None and arrays.bias.shape[2] == q_len > 1


def _bias_ring_problem(config: MosaicConfig, dp: int) -> str:
  return (f"{config} with a dense bias's ring needs"
          f" {config.smem_bytes(dp, bias=True)} bytes of shared memory at"
          f" head_dim {dp} (limit {SMEM_LIMIT})")


def _mask_flags(arrays: MaskArrays) -> dict:
  """The :class:`forward.Problem` flags of the call's mask inputs."""
  return dict(
      has_segment_ids=any(getattr(arrays, f) is not None for f in (
          "q_segment_ids", "kv_segment_ids", "q_seq_lengths",
          "kv_seq_lengths")),
      has_flash_mask=arrays.flash_mask is not None,
      has_alibi=arrays.alibi_slopes is not None,
      has_bias=arrays.bias is not None,
      bias_batched=arrays.bias is not None and arrays.bias.shape[0] > 1,
      bias_per_head=arrays.bias is not None and arrays.bias.shape[1] > 1,
      has_dense_mask=arrays.dense_mask is not None)


def _dense_mask(arrays: MaskArrays, prob: fwd_lib.Problem):
  """The dense boolean mask as the kernel reads it: int8, its rows (where
  it has its own) and keys padded to whole tiles with zeros (hidden)."""
  mask = arrays.dense_mask.astype(jnp.int8)
  rows = prob.q_pad if mask.shape[2] > 1 else 1
  return jnp.pad(mask, ((0, 0), (0, 0), (0, rows - mask.shape[2]),
                        (0, prob.kv_pad - mask.shape[3])))


def _dense_mask_ranges(mask_i8, batch: int, n_groups: int, held: int,
                       streamed: int, *, held_q: bool = True,
                       n_streamed: int | None = None):
  """A dense mask's streamed-tile ranges per group of held rows, ``[B, 6,
  n_groups]`` int32 (:func:`jaxflash.flashmask.tile_runs`): the tiles
  where some head sees a key, the first run where every head sees
  every key of the tile (padding rows hide keys, so a group with padding
  rows has no such run), and the longest run inside the first where no
  head sees one.  ``held_q`` False: the groups are of keys and
  the streamed tiles of queries (the dK/dV kernel), ``held`` keys and
  ``streamed`` rows each, ``n_streamed`` of them (``mask_i8``'s rows
  padded to whole tiles, or one row for every query)."""
  if held_q:
    cls = masks_lib.dense_tile_summary(mask_i8, held, streamed)
  else:
    cls = masks_lib.dense_tile_summary(mask_i8, streamed, held,
                                       transpose=True)
  live = jnp.any(cls != masks_lib.DENSE_HIDDEN, axis=1)  # [b, g, n]
  full = jnp.all(cls == masks_lib.DENSE_FULL, axis=1)
  if not held_q:  # (one row of keys for every query: every query tile)
    live, full = (jnp.broadcast_to(x, (*x.shape[:2], n_streamed))
                  for x in (live, full))
  runs = flashmask.tile_runs(live, full)  # [b | 1, g | 1, 6]
  runs = jnp.broadcast_to(runs, (batch, n_groups, runs.shape[-1]))
  return jnp.swapaxes(runs, 1, 2)


def _segment_ids(arrays: MaskArrays, prob: fwd_lib.Problem, batch: int):
  """Segment ids for the kernels, with the sequence lengths folded in
  (positions past a row's length become PAD_SEGMENT_ID), padded to whole
  tiles: ``(q_seg [B, q_pad], kv_seg [B, kv_pad])`` int32."""

  def ids(seg, lengths, full, padded):
    return jnp.pad(masks_lib.fold_lengths(seg, lengths, batch, full),
                   ((0, 0), (0, padded - full)),
                   constant_values=PAD_SEGMENT_ID)

  return (ids(arrays.q_segment_ids, arrays.q_seq_lengths, prob.mask.q_len,
              prob.q_pad),
          ids(arrays.kv_segment_ids, arrays.kv_seq_lengths, prob.mask.kv_len,
              prob.kv_pad))


def _group_range(held_seg, held_rows: int, streamed_seg, streamed_tile: int):
  """Per group of held rows, the streamed tiles whose segment ids can
  match (masks.overlap_range)."""
  return masks_lib.overlap_range(
      masks_lib.tile_summary(held_seg, held_rows),
      masks_lib.tile_summary(streamed_seg, streamed_tile))


def _check_flash_mask(cols) -> None:
  if cols.shape[1] != 1:
    raise NotImplementedError(
        "the Hopper kernels take a FlashMask shared by the heads (heads"
        f" axis 1), got columns {cols.shape}; the Triton kernels take"
        " per-head ones")


def _flash_columns(arrays: MaskArrays, prob: fwd_lib.Problem, batch: int):
  """The FlashMask's columns for the kernels: ``[B, n, kv_pad]`` int32
  (shared by the heads; padding keys hidden from every row)."""
  _check_flash_mask(arrays.flash_mask)
  cols = flashmask.pad_columns(arrays.flash_mask, prob.kv_pad)[:, 0]
  return jnp.broadcast_to(cols, (batch, *cols.shape[1:]))


def _with_flash(segments, cols, q_pad: int, held: int, streamed: int, *,
                held_q: bool):
  """Segment inputs ``(q_seg, kv_seg, range)`` with a FlashMask's columns
  appended and its :func:`jaxflash.flashmask.tile_ranges` as the range
  (the tiles it leaves, narrowed to the ids' range where there are ids;
  rows 2 and 3 the run it leaves fully visible, read by
  :func:`pipeline.flash_full_range`); unchanged without one."""
  if cols is None:
    return segments
  q_seg, kv_seg, rng = segments
  ranges = flashmask.tile_ranges(cols[:, None], q_pad, held, streamed,
                                 held_q=held_q)[:, 0]
  return q_seg, kv_seg, _narrowed(ranges, rng), cols


def _narrowed(ranges, rng):
  """Tile ranges ``[B, 4, n]`` (a FlashMask's or a dense mask's) with
  their live tiles narrowed to the segment ids' range ``rng [B, 2, n]``
  (None: no ids, nothing to narrow)."""
  if rng is None:
    return ranges
  lo = jnp.maximum(rng[:, 0], ranges[:, 0])
  hi = jnp.maximum(jnp.minimum(rng[:, 1], ranges[:, 1]), lo)
  return jnp.concatenate([lo[:, None], hi[:, None], ranges[:, 2:]], axis=1)


def _segments(arrays: MaskArrays, st: _Static, batch: int):
  """Forward kernel's segment inputs: ids and each query group's key-tile
  range (and a FlashMask's columns)."""
  cfg, prob = st.config, st.prob
  q_seg, kv_seg = _segment_ids(arrays, prob, batch)
  held = cfg.compute_wgs * cfg.block_q
  # (A FlashMask alone: its own live ranges, not the ids' overlap, which
  # would take a dozen more XLA ops to say "every tile".)
  segments = (q_seg, kv_seg,
              _group_range(q_seg, held, kv_seg, cfg.block_kv)
              if prob.has_segment_ids else None)
  cols = (_flash_columns(arrays, prob, batch) if prob.has_flash_mask
          else None)
  segments = _with_flash(segments, cols, prob.q_pad, held, cfg.block_kv,
                         held_q=True)
  if prob.has_dense_mask:  # (a FlashMask with it is refused)
    ranges = _dense_mask_ranges(_dense_mask(arrays, prob), batch,
                                prob.q_pad // held, held, cfg.block_kv)
    q_seg, kv_seg, rng = segments
    segments = (q_seg, kv_seg, _narrowed(ranges, rng))
  return segments


def _tma_rows(rows: int, unpadded: bool, padded: int) -> int:
  """Rows of an array the forward copies by TMA into tiled buffers:
  ``padded`` (whole tiles), or ``unpadded`` the length itself, rounded up
  to ``TMA_ROW_TILE`` (tiled copies refuse other lengths): a copy only at
  such lengths instead of at every length that the tile does not
  divide."""
  return round_up(rows, TMA_ROW_TILE) if unpadded else padded


def _forward(q, k, v, st: _Static, arrays: MaskArrays = NO_MASK_ARRAYS,
             dequant=None):
  prob = st.prob
  pad = lambda x, n: pad_axis(pad_axis(x, 1, n), 3, prob.head_dim_padded)
  segments = (_segments(arrays, st, q.shape[0]) if prob.has_segments
              else None)
  # unpadded_kv / unpadded_q (not the interpreter, refused at dispatch: its
  # slices clamp): the TMA copies zero-fill the last tile past the keys or
  # queries and the store of O drops its rows past them (the LSE stays
  # q_pad long, stored whole).
  # Row copies (row_copies) take the lengths themselves.
  gpu = not st.interpret
  by_rows = fwd_lib.row_copies(prob, st.config, q.shape[1], k.shape[1],
                               st.interpret)
  kv_rows = (k.shape[1] if by_rows.kv else
             _tma_rows(k.shape[1], st.config.unpadded_kv and gpu,
                       prob.kv_pad))
  tiled_q_rows = _tma_rows(q.shape[1], st.config.unpadded_q and gpu,
                           prob.q_pad)
  q_rows = q.shape[1] if by_rows.q else tiled_q_rows
  # ALiBi's slopes in the raw logits' units.
  alibi = (_alibi_table(arrays, prob, 1.0 / prob.softmax_scale)
           if prob.has_alibi else None)
  bias = None
  if prob.bias_ring:
    # In q's dtype (the ring's), its rows and keys padded as Q's and K's
    # (a copy only where the lengths are not whole tiles).
    # The keys whole tiles long: the ring's TMA tiles the key axis by the
    # swizzle's width, which unpadded_kv's row count need not be a
    # multiple of (1504 keys failed on the H100).
    # Its rows a multiple of TMA_ROW_TILE (tiled copies) also where Q's
    # go by row copies.
    bias = arrays.bias.astype(q.dtype)
    bias = jnp.pad(bias, ((0, 0), (0, 0), (0, tiled_q_rows - bias.shape[2]),
                          (0, prob.kv_pad - bias.shape[3])))
  elif prob.has_bias:
    # One row for every query, rounded to q's dtype as the ring's tiles
    # (and the backward's bias) are, read as float32 per key tile; the
    # keys padded to whole tiles (the last tile's loads stay inside).
    bias = arrays.bias.astype(q.dtype).astype(jnp.float32)
    bias = jnp.pad(bias, ((0, 0), (0, 0), (0, 0),
                          (0, prob.kv_pad - bias.shape[3])))
  if prob.fp8:
    # V^T (wgmma takes 8-bit operands K-major only): one pass over V's
    # bytes, whole tiles long (its rows' stride must be a multiple of 16
    # bytes for TMA); with P a register operand, its keys in the order
    # that operand's columns take (fwd_lib.fp8_key_order).
    v = pad(v, prob.kv_pad).transpose(0, 2, 3, 1)
    if not st.config.p_in_smem:
      v = fwd_lib.fp8_key_order(v)
    dequant = dequant.astype(jnp.float32)
  else:
    v = pad(v, kv_rows)
  out, lse = fwd_lib.forward(
      pad(q, q_rows), pad(k, kv_rows), v, segments, alibi,
      bias, _dense_mask(arrays, prob) if prob.has_dense_mask else None,
      _dropout_table(arrays, prob) if prob.dropout_rate else None,
      dequant, prob=prob, cfg=st.config,
      interpret=_interpret_params(st.interpret))
  T = q.shape[1]
  return out[:, :T, :, :st.head_dim], lse[:, :, :T]


def forward(q, k, v, arrays: MaskArrays, *, mask: MaskSpec,
            softmax_scale: float, logits_soft_cap=None,
            config: MosaicConfig | None = None, interpret=False,
            dropout_rate: float = 0.0, dropout_shared: bool = False):
  """The Hopper forward kernel on (local) arrays: ``(out, lse)``; with
  ``dropout_rate`` attention dropout from ``arrays.dropout_seeds``."""
  st = _plan(q, k, mask, softmax_scale, config, interpret, logits_soft_cap,
             arrays, dropout_rate, dropout_shared)
  if interpret:
    _check_interpreter_threads(st.config)
  return _forward(q, k, v, st, arrays)


def forward_fp8(q, k, v, arrays: MaskArrays, *, mask: MaskSpec,
                softmax_scale: float, logits_soft_cap, dequant, out_dtype,
                config: MosaicConfig | None = None, interpret=False):
  """The Hopper forward on FP8 ``q, k, v`` (checked by
  :func:`check_supported_fp8`) with ``dequant [H, 2]`` float32 (``q_scale
  * k_scale`` and ``v_scale`` per query head): ``(out [B, T, H, D] in
  out_dtype, lse)``.  V goes to the kernel transposed, ``[B, K, Dp, S]``
  (wgmma takes 8-bit operands K-major only): one pass over V's bytes
  before the kernel."""
  st = _plan(q, k, mask, softmax_scale, config, interpret, logits_soft_cap,
             arrays, fp8_out_dtype=out_dtype)
  if interpret:
    _check_interpreter_threads(st.config)
  return _forward(q, k, v, st, arrays, dequant)


def _serves_backward(dp: int, config: MosaicConfig) -> bool:
  """Whether the Hopper backward kernels serve padded head_dim ``dp`` with
  ``config``: above MAX_BWD_HEAD_DIM the two float32 accumulators (dK,
  dV) need the paired dK/dV kernel."""
  return dp <= MAX_BWD_HEAD_DIM or config.bwd_paired_dkv


# On the GPU, dropout's backward at padded head_dims below this takes the
# Triton kernels: at head_dim 64 (seq 8192, rate 0.1, H100) they ran the
# backward 8-9% faster than the Hopper kernels, which were level to 6%
# faster at 128 (docs/benchmarks/, 2026-12-07, c62583c).
MIN_DROPOUT_BWD_HEAD_DIM = 128


def _ds_dtype(dtype):
  """The dtype the dQ kernel writes a dense bias's gradient ``dS`` in:
  bfloat16 inputs' own (float32's exponent range, the rounding dQ's and
  dK's matmuls take dS in), float32 for float16 inputs, whose range
  flushes the small dS of long rows (``P`` near 1e-7) to zero."""
  return jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32


def _backward_config(config: MosaicConfig, dp: int, arrays: MaskArrays,
                     q_len: int, dtype, bias_grad: bool,
                     dropout: bool = False, interpret=False):
  """``(config, None)``: the backward config of a call (``config``
  resolved), or ``(None, why)`` where the Hopper backward kernels do not
  serve it.  With a dense bias: the dQ kernel (it writes the bias's
  gradient; ``bwd_atomic_dq`` is turned off, as ``deterministic`` does),
  not the paired kernels, and the bias's rings (and dS's staging) within
  the shared memory.  A dense mask, ALiBi or ``dropout`` need the
  unpaired kernels too; on the GPU dropout below
  :data:`MIN_DROPOUT_BWD_HEAD_DIM` takes the Triton backward."""
  if not _serves_backward(dp, config):
    return None, (f"padded head_dim {dp} > {MAX_BWD_HEAD_DIM} needs"
                  f" bwd_paired_dkv: {config}")
  paired = config.bwd_paired_dkv or config.bwd_paired_dq
  terms = [name for name, on in (
      ("a dense bias", arrays.bias is not None),
      ("a dense mask", arrays.dense_mask is not None),
      ("ALiBi", arrays.alibi_slopes is not None), ("dropout", dropout)) if on]
  if paired and terms:
    return None, (f"the paired kernels (bwd_paired_dkv / bwd_paired_dq)"
                  f" take no {' or '.join(terms)}: {config}")
  if dropout and dp < MIN_DROPOUT_BWD_HEAD_DIM and not interpret:
    return None, (f"dropout at padded head_dim {dp} <"
                  f" {MIN_DROPOUT_BWD_HEAD_DIM} runs faster on the Triton"
                  " backward")
  if arrays.bias is None:
    return config, None
  config = dataclasses.replace(config, bwd_atomic_dq=False)
  ds_itemsize = jnp.dtype(_ds_dtype(dtype)).itemsize if bias_grad else 0
  need = config.bwd_smem_bytes(dp, bias=_bias_rows(arrays, q_len),
                               ds_itemsize=ds_itemsize)
  if need > SMEM_LIMIT:
    return None, (f"a dense bias's rings (and its gradient's staging) need"
                  f" {need} bytes of shared memory with {config} at head_dim"
                  f" {dp} (limit {SMEM_LIMIT})")
  return config, None


def serves_backward(q, k, *, mask: MaskSpec, config: MosaicConfig | None,
                    interpret=False, deterministic: bool = False,
                    arrays: MaskArrays = NO_MASK_ARRAYS,
                    bias_grad: bool = False,
                    dropout_rate: float = 0.0) -> bool:
  """Whether :func:`backward` serves this call; where it does not, the
  Triton backward kernels take the same residuals."""
  dp = kernel_head_dim(q.shape[3])
  return _backward_config(
      _resolve_config(config, interpret, dp, mask, deterministic, q, k),
      dp, arrays, q.shape[1], q.dtype, bias_grad, bool(dropout_rate),
      interpret=bool(interpret))[0] is not None


def backward(q, k, v, arrays: MaskArrays, out, lse, dout, dlse, *,
             mask: MaskSpec, softmax_scale: float, logits_soft_cap=None,
             config: MosaicConfig | None = None, interpret=False,
             deterministic: bool = False, bias_grad: bool = False,
             dropout_rate: float = 0.0, dropout_shared: bool = False):
  """The gradient ``(dq, dk, dv)`` from the forward's residuals;
  bitwise reproducible when ``deterministic`` (no atomic dQ).  With a
  dense bias in ``arrays`` (as the forward read it: in q's dtype), and
  ``bias_grad``, its gradient fourth: float32, summed over the bias's
  broadcast axes (the shape of ``arrays.bias``).  ``dropout_rate``:
  attention dropout's keep mask regenerated from ``arrays.dropout_seeds``
  as the forward made it."""
  B, T, H, D = q.shape
  S = k.shape[1]
  dp = kernel_head_dim(D)
  resolved = _resolve_config(config, interpret, dp, mask, deterministic, q,
                             k)
  config, why = _backward_config(resolved, dp, arrays, T, q.dtype,
                                 bias_grad, bool(dropout_rate),
                                 interpret=bool(interpret))
  if config is None:
    raise NotImplementedError(
        f"the Hopper backward kernels do not serve this call: {why}")
  if interpret:
    _check_interpreter_threads(config)
  n = config.bwd_compute_wgs
  prob = backward_problem(q, k, mask, softmax_scale, config,
                          logits_soft_cap, arrays, interpret=bool(interpret),
                          dropout_rate=dropout_rate,
                          dropout_shared=dropout_shared)
  tensors = backward_operands(q, k, v, out, lse, dout, dlse, prob, config,
                              interpret=bool(interpret))
  seg_dq = seg_dkv = None
  if prob.has_segments:
    q_seg, kv_seg = _segment_ids(arrays, prob, B)
    cols = (_flash_columns(arrays, prob, B) if prob.has_flash_mask
            else None)
    ids = prob.has_segment_ids  # (else the FlashMask's own ranges)
    q_group = 1 if config.bwd_paired_dq else n  # query tiles per program
    seg_dq = _with_flash((q_seg, kv_seg, _group_range(
        q_seg, q_group * config.bwd_block_q, kv_seg, config.bwd_block_kv)
        if ids else None),
        cols, prob.q_pad, q_group * config.bwd_block_q, config.bwd_block_kv,
        held_q=True)
    kv_group = 1 if config.bwd_paired_dkv else n  # key tiles per program
    # The dK/dV kernel's last step of dkv_block_q rows may run past q_pad
    # (bwd_dkv_block_q): its segment ids, read by plain loads, are padded
    # to whole steps.
    q_seg_dkv = jnp.pad(
        q_seg, ((0, 0), (0, round_up(prob.q_pad, config.dkv_block_q)
                         - prob.q_pad)), constant_values=PAD_SEGMENT_ID)
    seg_dkv = _with_flash((q_seg_dkv, kv_seg, _group_range(
        kv_seg, kv_group * config.bwd_block_kv, q_seg_dkv,
        config.dkv_block_q) if ids else None), cols, q_seg_dkv.shape[1],
        kv_group * config.bwd_block_kv, config.dkv_block_q, held_q=False)
    if prob.has_dense_mask:  # (neither a FlashMask nor the paired kernels)
      seg_dq, seg_dkv = _with_dense_backward(
          _dense_mask(arrays, prob), seg_dq, seg_dkv, prob, config, B)
  splits = head_splits(prob, config)
  bias = _backward_bias(arrays, prob, config, q.dtype)
  ds_dtype = _ds_dtype(q.dtype) if bias_grad else None
  # (ALiBi's slopes in the scaled logits' units, to which dS refers.)
  alibi = _alibi_table(arrays, prob, 1.0) if prob.has_alibi else None
  done = {name: run(*tensors) for name, run in backward_passes(
      prob, config, seg_dq, seg_dkv, _interpret_params(interpret),
      head_splits=splits, bias=bias, ds_dtype=ds_dtype, alibi=alibi,
      dropout=_dropout_table(arrays, prob) if dropout_rate else None)}
  if config.bwd_atomic_dq:
    dq, dk, dv = done["dkv+atomic-dq"]
  else:
    dq, *ds = done["dq-paired" if config.bwd_paired_dq else "dq"]
    if config.bwd_paired_dkv:
      dk, dv = done["dkv-paired"]
    else:
      dk, dv = done["dkv"]
  grads = (dq[:, :T, :, :D], dk[:, :S, :, :D], dv[:, :S, :, :D])
  if not bias_grad:
    return grads
  # dS summed over the bias's broadcast axes in float32.
  axes = tuple(a for a in range(4) if arrays.bias.shape[a] == 1)
  dbias = ds[0][:, :, :T, :S].astype(jnp.float32)
  return (*grads, jnp.sum(dbias, axis=axes, keepdims=True))


def _with_dense_backward(mask, seg_dq, seg_dkv, prob: fwd_lib.Problem,
                         config: MosaicConfig, batch: int):
  """Both backward kernels' segment inputs with a dense mask (``mask``:
  :func:`_dense_mask`'s int8 array) appended and its tile ranges (the
  forward's rule, :func:`_dense_mask_ranges`, per query group of the dQ
  kernel and per key group of the dK/dV kernel) narrowed to the ids'.
  The dK/dV kernel reads the mask transposed, ``[B|1, H|1, Sp, rows]``
  (rows padded to its query steps), so that its tiles load in the layout
  of ``S^T``; one row of keys for every query stays as it is."""
  n = config.bwd_compute_wgs
  held_q, bk = n * config.bwd_block_q, config.bwd_block_kv
  dq_ranges = _dense_mask_ranges(mask, batch, prob.q_pad // held_q, held_q,
                                 bk)
  rows = seg_dkv[0].shape[1]  # the dK/dV kernel's padded query rows
  mask_t = mask
  if mask.shape[2] > 1:
    mask_t = jnp.pad(mask, ((0, 0), (0, 0), (0, rows - mask.shape[2]),
                            (0, 0)))
  held_k, sq = n * bk, config.dkv_block_q
  dkv_ranges = _dense_mask_ranges(mask_t, batch, prob.kv_pad // held_k,
                                  held_k, sq, held_q=False,
                                  n_streamed=rows // sq)
  if mask.shape[2] > 1:
    mask_t = jnp.swapaxes(mask_t, 2, 3)
  q_seg, kv_seg, rng = seg_dq
  seg_dq = (q_seg, kv_seg, _narrowed(dq_ranges, rng), mask)
  q_seg, kv_seg, rng = seg_dkv
  return seg_dq, (q_seg, kv_seg, _narrowed(dkv_ranges, rng), mask_t)


def _backward_bias(arrays: MaskArrays, prob: fwd_lib.Problem,
                   config: MosaicConfig, dtype):
  """The dense bias as both backward kernels read it (None without one):
  in ``dtype`` (the forward's rounding), its rows padded to whole steps
  of the dK/dV kernel (``dkv_block_q``, past ``q_pad`` where it does not
  divide it) and its keys to ``kv_pad``; or one float32 row of keys for
  every query (``prob.bias_rows`` False), as the forward reads it."""
  if arrays.bias is None:
    return None
  bias = arrays.bias.astype(dtype)
  keys = prob.kv_pad - bias.shape[3]
  if not prob.bias_rows:
    return jnp.pad(bias.astype(jnp.float32),
                   ((0, 0), (0, 0), (0, 0), (0, keys)))
  rows = round_up(prob.q_pad, config.dkv_block_q) - bias.shape[2]
  return jnp.pad(bias, ((0, 0), (0, 0), (0, rows), (0, keys)))


def backward_problem(q, k, mask: MaskSpec, softmax_scale: float,
                     config: MosaicConfig, logits_soft_cap=None,
                     arrays: MaskArrays = NO_MASK_ARRAYS,
                     interpret=False, dropout_rate: float = 0.0,
                     dropout_shared: bool = False) -> fwd_lib.Problem:
  """The backward kernels' padded problem (tiles of ``bwd_*``)."""
  B, T, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  n = config.bwd_compute_wgs
  q_tile = n * config.bwd_block_q  # the dQ kernel's query group
  if interpret and q_tile % config.dkv_block_q:
    # The interpreter's slices clamp at the end of an array where a TMA
    # copy on the GPU zero-fills: the dK/dV kernel's steps of
    # bwd_dkv_block_q rows must tile the padded queries there.
    q_tile = math.lcm(q_tile, config.dkv_block_q)
  return fwd_lib.Problem(
      mask=mask, softmax_scale=float(softmax_scale), batch=B, num_heads=H,
      num_kv_heads=K, q_pad=round_up(T, q_tile),
      kv_pad=round_up(S, n * config.bwd_block_kv),
      head_dim_padded=kernel_head_dim(D),
      logits_soft_cap=logits_soft_cap, bias_rows=_bias_rows(arrays, T),
      dropout_rate=float(dropout_rate), dropout_shared=dropout_shared,
      **_mask_flags(arrays))


def head_splits(prob: fwd_lib.Problem, config: MosaicConfig) -> int:
  """The dK/dV kernel's split of each GQA/MQA group for this call
  (:func:`config.dkv_head_splits`); whole groups with a dense bias (its
  ring takes the shared memory of the split's staging)."""
  if prob.has_bias:
    return 1
  programs = (prob.num_kv_heads * prob.batch
              * (prob.kv_pad // (config.bwd_compute_wgs
                                 * config.bwd_block_kv)))
  return dkv_head_splits(
      config, group_size=prob.num_heads // prob.num_kv_heads,
      programs=programs, sm_count=sm_count(),
      head_dim_padded=prob.head_dim_padded)


def _sum_parts(partials, splits: int, dtype):
  """dK or dV from the dK/dV kernel's float32 partials ``[B, Sp, K *
  splits, Dp]`` (``head_splits`` > 1): summed over each key/value head's
  parts in float32, in a fixed order, then cast."""
  B, S, KS, D = partials.shape
  return partials.reshape(B, S, KS // splits, splits, D).sum(3).astype(dtype)


def backward_operands(q, k, v, out, lse, dout, dlse, prob: fwd_lib.Problem,
                      config: MosaicConfig, interpret: bool = False):
  """The backward kernels' operands ``(qp, kp, vp, dop, lse2, delta)``
  (one XLA pass before them): Q, K, V and dO padded to whole tiles, or
  where the kernels copy them by rows (:func:`bwd_lib.row_copies`) as
  they are; lse2 and delta as long as the dK/dV kernel's last query step
  reads (+inf and 0 past the rows, so P = 0 there whatever the terms
  add)."""
  T, S = q.shape[1], k.shape[1]
  dp = prob.head_dim_padded
  by_rows = bwd_lib.row_copies(prob, config, T, S, interpret)
  pad = lambda x, n: pad_axis(pad_axis(x, 1, n), 3, dp)
  q_rows, kv_rows = (T, S) if by_rows else (prob.q_pad, prob.kv_pad)
  qp, dop = pad(q, q_rows), pad(dout.astype(q.dtype), q_rows)
  kp, vp = pad(k, kv_rows), pad(v, kv_rows)
  delta = softmax_delta(out, dout, dlse)  # one fused XLA pass, float32
  # Base-2 LSE; +inf for rows that saw no key (and for padding rows), so
  # that P = exp2(-inf - inf) = 0 there rather than NaN.
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
  rows = round_up(prob.q_pad, config.dkv_block_q)
  pad_rows = lambda x, value: jnp.pad(
      x, ((0, 0), (0, 0), (0, rows - T)), constant_values=value)
  lse2, delta = pad_rows(lse2, jnp.inf), pad_rows(delta, 0.0)
  return qp, kp, vp, dop, lse2, delta


def backward_passes(prob: fwd_lib.Problem, config: MosaicConfig, seg_dq,
                    seg_dkv, interpret=None, head_splits: int = 1,
                    bias=None, ds_dtype=None, alibi=None, dropout=None):
  """The Hopper backward's kernel launches in order, ``[(name, run)]``,
  each ``run(qp, kp, vp, dop, lse2, delta)`` on the padded operands
  returning its outputs: ``dq`` (``dq-paired`` with ``bwd_paired_dq``)
  then ``dkv`` (``dkv-paired`` with ``bwd_paired_dkv``), or one
  ``dkv+atomic-dq`` with ``bwd_atomic_dq``.
  :func:`backward` runs them; tools/kernel_times.py times them apart.
  ``head_splits`` > 1: the dK/dV kernel's float32 partials, summed here
  (:func:`head_splits`).  ``bias``: the dense bias
  (:func:`_backward_bias`); ``ds_dtype``: the dQ kernel also returns
  ``dS [B, H, Tp, Sp]`` in that dtype (the bias's gradient); ``alibi``:
  the ALiBi table ``[B, H, 2]``; ``dropout``: the dropout table
  ``[B, H + 2]`` (:func:`_dropout_table`)."""
  split_dkv = functools.partial(bwd_lib.dkv, prob=prob, cfg=config,
                                interpret=interpret, head_splits=head_splits,
                                bias=bias, alibi=alibi, dropout=dropout)

  def dkv(qp, kp, vp, *rest, **kw):
    dk, dv = split_dkv(qp, kp, vp, *rest, **kw)
    if head_splits > 1:
      dk, dv = (_sum_parts(x, head_splits, kp.dtype) for x in (dk, dv))
    return dk, dv
  if config.bwd_atomic_dq:
    # dQ is summed over key tiles by TMA reduce-adds from the dK/dV kernel
    # into a zeroed float32 buffer that the kernel writes in place.  The
    # buffer is a ref of `run_state`, which discharges the state: the
    # traced backward has no effects, as custom_partitioning (sharded
    # jit) requires -- a `jax.new_ref` there fails to lower ("Cannot lower
    # jaxpr with effects").
    def dkv_atomic(qp, kp, vp, dop, lse2, delta):
      def run(refs):
        dq_ref, dk_ref, dv_ref = refs
        dk_ref[...], dv_ref[...] = split_dkv(qp, kp, vp, dop, lse2, delta,
                                             seg_dkv, dq_acc=dq_ref)

      # (dQ's float32 buffer and the partials whole tiles long, also
      # where the operands are not: bwd_lib.row_copies.)
      B, _, H, D = qp.shape
      K = kp.shape[2]
      kv_zeros = (jnp.zeros(kp.shape, qp.dtype) if head_splits == 1 else
                  jnp.zeros((B, prob.kv_pad, K * head_splits, D),
                            jnp.float32))
      dq_acc, dk, dv = pl.run_state(run)(
          (jnp.zeros((B, prob.q_pad, H, D), jnp.float32), kv_zeros,
           kv_zeros))
      dq_acc = dq_acc[:, :qp.shape[1]]
      if head_splits > 1:
        dk, dv = (_sum_parts(x, head_splits, kp.dtype) for x in (dk, dv))
      return (dq_acc * prob.softmax_scale).astype(qp.dtype), dk, dv
    return [("dkv+atomic-dq", dkv_atomic)]
  if config.bwd_paired_dq:
    passes = [("dq-paired", lambda *t: (bwd_lib.paired_dq(
        *t, seg_dq, prob=prob, cfg=config, interpret=interpret),))]
  else:
    def dq(*t):
      run = functools.partial(bwd_lib.dq, *t, seg_dq, prob=prob, cfg=config,
                              interpret=interpret, bias=bias, alibi=alibi,
                              dropout=dropout)
      if ds_dtype is None:
        return (run(),)

      # dS goes to a zeroed buffer (tiles the kernel skips are hidden, their
      # gradient zero) that the kernel writes in place: a ref of
      # run_state, as dkv_atomic's dQ buffer.
      def write(refs):
        ds_ref, dq_ref = refs
        dq_ref[...] = run(ds_acc=ds_ref)
      shape = (prob.batch, prob.num_heads, prob.q_pad, prob.kv_pad)
      ds, dq_out = pl.run_state(write)(
          (jnp.zeros(shape, ds_dtype), jnp.zeros(t[0].shape, t[0].dtype)))
      return dq_out, ds
    passes = [("dq", dq)]
  if config.bwd_paired_dkv:
    return passes + [("dkv-paired", lambda *t: bwd_lib.paired_dkv(
        *t, seg_dkv, prob=prob, cfg=config, interpret=interpret))]
  return passes + [("dkv", lambda *t: dkv(*t, seg_dkv))]


def _check_interpreter_threads(config: MosaicConfig) -> None:
  """The Mosaic GPU interpreter runs each warpgroup as a computation on its
  own CPU thread, and blocks in barrier waits; with fewer host devices than
  warpgroups + 1, jax 0.11.2's CPU runtime has too few threads and the
  kernel deadlocks (seen here).  Refuse instead of hanging."""
  need = max(config.compute_wgs, config.bwd_compute_wgs,
             2 if config.bwd_paired_dkv or config.bwd_paired_dq else 1) + 2
  have = len(jax.devices("cpu"))
  if have < need:
    raise NotImplementedError(
        f"the Mosaic GPU interpreter needs >= {need} host devices for"
        f" {need - 1} warpgroups, this process has {have}: set"
        " XLA_FLAGS=--xla_force_host_platform_device_count=8 before"
        " importing jax")


def _manual_devices() -> int:
  """Devices of the enclosing shard_map's manual axes (1 outside)."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in mesh.manual_axes)


# Options the Mosaic GPU interpreter cannot run, and why.
_GPU_ONLY = (
    ("bwd_atomic_dq", "has no TMA reduce-add"),
    ("named_barriers", "does not run hardware named barriers (inline PTX)"),
    ("bwd_stats_in_acc", "does not run stores into a wgmma accumulator"),
    ("unpadded_kv", "clamps slices past the end of K and V (TMA zero-fills"
     " them)"),
    ("unpadded_q", "clamps slices past the end of Q and O (TMA zero-fills"
     " and clips them)"),
)


def check_supported_fp8(q, k, *, arrays: MaskArrays, out_dtype, config,
                        interpret) -> None:
  """Raises NotImplementedError when the Hopper FP8 forward cannot serve
  the call (its masks are those of the 16-bit kernel without the dense
  terms)."""
  if jnp.dtype(k.dtype) not in FP8_KV_DTYPES:
    raise NotImplementedError(
        f"the Hopper FP8 forward takes float8_e4m3fn or float8_e5m2 keys"
        f" and values, got {k.dtype}")
  if jnp.dtype(out_dtype) not in FP8_OUT_DTYPES:
    raise NotImplementedError(
        f"the Hopper FP8 forward writes bfloat16 or float16, not"
        f" out_dtype={jnp.dtype(out_dtype).name} (the Triton FP8 kernel"
        " writes float32)")
  if arrays.has_dense or arrays.dropout_seeds is not None:
    raise NotImplementedError(
        "the Hopper FP8 forward takes no dense bias or mask, FlashMask,"
        " ALiBi or dropout (causal, windows, segment ids, lengths and the"
        " soft cap it takes)")
  if q.shape[3] > 256:
    raise NotImplementedError(
        f"the Hopper FP8 forward serves head_dim up to 256, got"
        f" {q.shape[3]}")
  dp = fp8_head_dim(q.shape[3])
  if config is not None:
    why = fp8_problem(config, dp)
    if why:
      raise NotImplementedError(why)
  if interpret:
    _check_gpu_only(config)
    if config is not None and not config.p_in_smem:
      raise NotImplementedError(
          "p_in_smem=False needs a GPU with FP8 inputs: the Mosaic GPU"
          " interpreter runs no inline Mosaic GPU code (P's 8-bit register"
          " operand)")
    _check_interpreter_threads(with_fp8(config or INTERPRET_CONFIG))
    return
  _require_hopper()


def _check_gpu_only(config) -> None:
  """NotImplementedError for a config option the interpreter cannot run."""
  for name, why in _GPU_ONLY:
    if config is not None and getattr(config, name):
      raise NotImplementedError(
          f"{name}=True needs a GPU: the Mosaic GPU interpreter {why}")


def _require_hopper() -> None:
  require_cuda("mosaic_gpu", "an sm90 GPU (compute capability 9.x, Hopper)",
               lambda cc: cc.startswith("9"),
               "pass interpret=True to run it in the Mosaic GPU interpreter")


def check_supported(q, k, v, *, arrays: MaskArrays,
                    logits_soft_cap: float | None, config, interpret) -> None:
  """Raises NotImplementedError when this backend cannot serve the call."""
  del logits_soft_cap  # served
  if q.dtype not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"mosaic_gpu backend supports bfloat16 and float16, got {q.dtype}")
  if arrays.has_dense:
    if arrays.dense_mask is not None and arrays.flash_mask is not None:
      raise NotImplementedError(
          "the Hopper forward takes a dense mask or a FlashMask, not both"
          " (the Triton kernels take both)")
    dp = kernel_head_dim(q.shape[3])
    ring = _bias_rows(arrays, q.shape[1])
    if ring and dp > MAX_BIAS_HEAD_DIM:
      raise NotImplementedError(
          f"the Hopper forward has no shared memory for a dense bias's ring"
          f" beside its K/V ring at head_dim {dp} (up to"
          f" {MAX_BIAS_HEAD_DIM}; the Triton kernels serve it)")
    if ring and config is not None and with_bias_ring(config, dp) != config:
      raise NotImplementedError(_bias_ring_problem(config, dp))
    if arrays.flash_mask is not None:
      _check_flash_mask(arrays.flash_mask)
  dp = kernel_head_dim(q.shape[3])
  why = config and head_dim_problem(config, dp)
  if why:
    raise NotImplementedError(why)
  if interpret:
    _check_gpu_only(config)
    # Here as well as in the passes, so that a list of backends moves on
    # to the next one instead of failing inside the call.
    _check_interpreter_threads(config or INTERPRET_CONFIG)
    manual = _manual_devices()
    if manual > 1:
      raise NotImplementedError(
          f"the Mosaic GPU interpreter inside shard_map over {manual}"
          " devices: jax 0.11.2's interpreter fails there (a barrier left"
          " allocated, seen in tests); run the Triton kernels in interpret"
          " mode instead")
    return
  _require_hopper()
