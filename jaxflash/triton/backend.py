"""The Triton-lowering kernels on (local) arrays: padding, configuration,
``forward``, ``backward`` and ``check_supported``.  Autodiff, batching and
partitioning are :mod:`jaxflash.op`'s, over these functions."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jaxflash import flashmask
from jaxflash._util import pad_axis, require_cuda, round_up
from jaxflash.masks import PAD_SEGMENT_ID, MaskArrays, MaskSpec
from jaxflash.triton import backward as bwd_lib
from jaxflash.triton import dense as dense_lib
from jaxflash.triton import forward as fwd_lib
from jaxflash.triton.common import Problem, head_dim_padded
from jaxflash.triton.config import TritonConfig, default_config
from jaxflash.triton.tiles import MaskInputs

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

NO_MASK_ARRAYS = MaskArrays()


@dataclasses.dataclass(frozen=True)
class _Static:
  prob: Problem
  config: TritonConfig
  interpret: bool
  head_dim: int


def _plan(q, k, mask: MaskSpec, arrays: MaskArrays, softmax_scale: float,
          logits_soft_cap: float | None, config: TritonConfig | None,
          interpret: bool) -> _Static:
  _, T, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  dp = head_dim_padded(D)
  cfg = (config or TritonConfig()).merged_with(default_config(
      T, S, dp, q.dtype, bias_itemsize=(
          0 if arrays.bias is None else jnp.dtype(arrays.bias.dtype).itemsize)))
  # Pad each sequence to a whole number of every tile that walks it.
  q_mult = max(cfg.block_q, cfg.block_q_dkv, cfg.block_q_dq)
  kv_mult = max(cfg.block_k, cfg.block_k_dkv, cfg.block_k_dq)
  prob = Problem(
      mask=mask, softmax_scale=float(softmax_scale), num_heads=H,
      num_kv_heads=K, q_pad=round_up(T, q_mult), kv_pad=round_up(S, kv_mult),
      head_dim_padded=dp, logits_soft_cap=logits_soft_cap,
      has_segments=arrays.q_segment_ids is not None,
      has_lengths=(arrays.q_seq_lengths is not None
                   or arrays.kv_seq_lengths is not None),
      bias_axes=_full_axes(arrays.bias), mask_axes=_full_axes(
          arrays.dense_mask),
      flash_axes=(None if arrays.flash_mask is None
                  else _full_axes(arrays.flash_mask)[:2]),
      alibi_batch=(None if arrays.alibi_slopes is None
                   else arrays.alibi_slopes.shape[0] > 1))
  return _Static(prob=prob, config=cfg, interpret=interpret, head_dim=D)


def _full_axes(x):
  """Which of a dense array's (batch, heads, query) axes are not 1."""
  return None if x is None else tuple(n > 1 for n in x.shape[:3])


def _dense_inputs(arrays: MaskArrays, prob: Problem) -> dense_lib.DenseInputs:
  """The dense bias and mask padded to whole tiles (padding: bias 0, mask
  hidden).  A key axis of size 1 is broadcast to the keys here (a bias
  constant over keys is rare; the kernels slice key tiles)."""
  def pad(x, fill):
    x = jnp.broadcast_to(x, (*x.shape[:3], prob.mask.kv_len))
    rows = prob.q_pad if x.shape[2] > 1 else 1
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]),
                       (0, prob.kv_pad - x.shape[3])), constant_values=fill)
  bias = mask = flash = None
  if arrays.bias is not None:
    bias = pad(arrays.bias, 0)
  if arrays.dense_mask is not None:
    mask = pad(arrays.dense_mask.astype(jnp.int8), 0)
  if arrays.flash_mask is not None:
    # Padding keys are hidden from every row; all four rows (the Triton
    # kernels read each).
    flash = flashmask.full_columns(
        flashmask.pad_columns(arrays.flash_mask, prob.kv_pad))
  return dense_lib.DenseInputs(bias, mask, flash, arrays.alibi_slopes)


def _pad(x, seq: int, dp: int):
  return pad_axis(pad_axis(x, 1, seq), 3, dp)


def _mask_inputs(arrays: MaskArrays, prob: Problem, batch: int) -> MaskInputs:
  """Pads segment ids with PAD_SEGMENT_ID and packs the lengths."""
  q_seg = kv_seg = lengths = None
  if prob.has_segments:
    def pad_seg(x, size):
      return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, size - x.shape[1])),
                     constant_values=PAD_SEGMENT_ID)
    q_seg = pad_seg(arrays.q_segment_ids, prob.q_pad)
    kv_seg = pad_seg(arrays.kv_segment_ids, prob.kv_pad)
  if prob.has_lengths:
    def length(x, full):
      if x is None:
        return jnp.full((batch,), full, jnp.int32)
      return jnp.clip(x.astype(jnp.int32), 0, full)
    lengths = jnp.stack([length(arrays.q_seq_lengths, prob.mask.q_len),
                         length(arrays.kv_seq_lengths, prob.mask.kv_len)],
                        axis=1)
  return MaskInputs(q_seg, kv_seg, lengths)


def _dropout(arrays: MaskArrays, rate: float, shared: bool):
  """The kernels' ``(dropout_seeds, dropout)`` arguments."""
  if not rate:
    return None, None
  if arrays.dropout_seeds is None:
    raise ValueError(f"dropout_rate={rate} needs dropout seeds")
  return arrays.dropout_seeds, (float(rate), bool(shared))


def _forward(q, k, v, arrays, st: _Static, count_tiles=False, dequant=None,
             out_dtype=None, dropout_rate=0.0, dropout_shared=False):
  prob = st.prob
  seeds, dropout = _dropout(arrays, dropout_rate, dropout_shared)
  results = fwd_lib.forward(
      _pad(q, prob.q_pad, prob.head_dim_padded),
      _pad(k, prob.kv_pad, prob.head_dim_padded),
      _pad(v, prob.kv_pad, prob.head_dim_padded),
      _mask_inputs(arrays, prob, q.shape[0]),
      prob=prob, config=st.config, interpret=st.interpret,
      count_tiles=count_tiles, dequant=dequant, out_dtype=out_dtype,
      dropout_seeds=seeds, dropout=dropout,
      dense=_dense_inputs(arrays, prob))
  T = q.shape[1]
  out, lse = results[0][:, :T, :, :st.head_dim], results[1][:, :, :T]
  if count_tiles:
    return out, lse, results[2][:, :, :T]
  return out, lse


def forward(q, k, v, arrays: MaskArrays, *, mask: MaskSpec,
            softmax_scale: float, logits_soft_cap: float | None = None,
            config: TritonConfig | None = None, interpret: bool = False,
            dropout_rate: float = 0.0, dropout_shared: bool = False):
  """The forward kernel on (local) arrays: ``(out, lse)``; not
  differentiable by itself (see :mod:`jaxflash.op`).  ``dropout_rate``
  (with ``arrays.dropout_seeds``; ``dropout_shared``: one mask for every
  head): attention dropout."""
  st = _plan(q, k, mask, arrays, softmax_scale, logits_soft_cap, config,
             interpret)
  return _forward(q, k, v, arrays, st, dropout_rate=dropout_rate,
                  dropout_shared=dropout_shared)


def forward_fp8(q, k, v, arrays: MaskArrays, *, mask: MaskSpec,
                softmax_scale: float, logits_soft_cap: float | None,
                dequant, out_dtype, config: TritonConfig | None = None,
                interpret: bool = False):
  """The forward kernel on FP8 ``q, k, v`` with ``dequant [H, 2]`` float32
  (per query head: ``q_scale * k_scale``, ``v_scale``): ``(out`` in
  ``out_dtype``, ``lse)``.  The tiles are bfloat16's
  (``default_config`` by item size: one byte takes the two-byte tiles)."""
  st = _plan(q, k, mask, arrays, softmax_scale, logits_soft_cap, config,
             interpret)
  return _forward(q, k, v, arrays, st, dequant=dequant, out_dtype=out_dtype)


def backward(q, k, v, arrays: MaskArrays, out, lse, dout, dlse, *,
             mask: MaskSpec, softmax_scale: float,
             logits_soft_cap: float | None = None,
             config: TritonConfig | None = None, interpret: bool = False,
             deterministic: bool = False, dropout_rate: float = 0.0,
             dropout_shared: bool = False, bias_grad: bool = False):
  """The backward kernels from the forward's residuals: ``(dq, dk, dv)``,
  and with ``bias_grad`` the dense bias's gradient fourth (its shape and
  dtype; broadcast axes summed).

  Always bitwise reproducible (``deterministic`` is accepted for the
  common interface): dQ and dK/dV are separate kernels that each own their
  output tiles and sum in a fixed order, with no atomics.
  """
  del deterministic
  st = _plan(q, k, mask, arrays, softmax_scale, logits_soft_cap, config,
             interpret)
  seeds, dropout = _dropout(arrays, dropout_rate, dropout_shared)
  prob = st.prob
  dp = prob.head_dim_padded
  T, S = q.shape[1], k.shape[1]
  pq = functools.partial(_pad, seq=prob.q_pad, dp=dp)
  pkv = functools.partial(_pad, seq=prob.kv_pad, dp=dp)
  grads = bwd_lib.backward(
      pq(q), pkv(k), pkv(v), pq(out), pad_axis(lse, 2, prob.q_pad),
      pq(dout.astype(q.dtype)), pad_axis(dlse.astype(jnp.float32), 2,
                                         prob.q_pad),
      _mask_inputs(arrays, prob, q.shape[0]),
      prob=prob, config=st.config, interpret=st.interpret,
      dropout_seeds=seeds, dropout=dropout,
      dense=_dense_inputs(arrays, prob), dbias=bias_grad)
  dq, dk, dv = grads[:3]
  D = st.head_dim
  out = (dq[:, :T, :, :D], dk[:, :S, :, :D], dv[:, :S, :, :D])
  if not bias_grad:
    return out
  bias = arrays.bias
  ds = grads[3][:, :, :T, :S]
  # Summed over the bias's broadcast axes (float32, then its dtype).
  axes = tuple(a for a in range(4) if bias.shape[a] == 1)
  return (*out, jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype))


def count_visited_tiles(q, k, v, *, mask: MaskSpec,
                        arrays: MaskArrays = NO_MASK_ARRAYS,
                        softmax_scale: float = 1.0,
                        config: TritonConfig | None = None,
                        interpret: bool = False):
  """Debug: ``[B, H, T]`` int32, the key tiles the forward kernel visited
  for each query row's tile (tests use it to show tile skipping)."""
  st = _plan(q, k, mask, arrays, softmax_scale, None, config, interpret)
  return _forward(q, k, v, arrays, st, count_tiles=True)[2]


def check_supported(q, k, v, *, interpret: bool, arrays=None,
                    logits_soft_cap=None, config=None) -> None:
  """Raises NotImplementedError when this backend cannot serve the call
  (every mask, soft cap and config is served)."""
  del k, v, arrays, logits_soft_cap, config
  if q.dtype not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"triton backend supports bfloat16, float16 and float32, got"
        f" {q.dtype}")
  if interpret:
    return
  require_cuda("triton", "a CUDA GPU of compute capability >= 8.0",
               lambda cc: float(cc) >= 8.0,
               "pass interpret=True to run its kernels on CPU")


def check_supported_fp8(q, k, *, interpret: bool) -> None:
  """NotImplementedError when the FP8 forward cannot run: it takes e4m3
  alone (Triton lowers no e4m3 x e5m2 product) and needs FP8 tensor cores
  (compute capability 8.9: Ada, Hopper) or the interpreter."""
  if jnp.dtype(k.dtype) != jnp.dtype(jnp.float8_e4m3fn):
    raise NotImplementedError(
        f"the Triton FP8 kernel takes float8_e4m3fn keys and values, got"
        f" {jnp.dtype(k.dtype).name} (the 'xla' backend takes"
        f" float8_e5m2)")
  # Hopper's FP8 MMA takes inner sizes of 32: the head_dim (Q K^T) and the
  # key tile (P V, tiles fitted down to 16 for short keys) must reach it.
  if q.shape[3] < 32 or k.shape[1] < 32:
    raise NotImplementedError(
        f"the Triton FP8 kernel takes head_dim and kv_len from 32, got"
        f" head_dim={q.shape[3]}, kv_len={k.shape[1]}")
  if interpret:
    return
  require_cuda("triton", "a CUDA GPU of compute capability >= 8.9 (FP8"
               " tensor cores)", lambda cc: float(cc) >= 8.9,
               "pass interpret=True to run its kernels on CPU")
