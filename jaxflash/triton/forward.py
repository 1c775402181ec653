"""Forward kernel (Pallas, Triton lowering).

FlashAttention-2 forward (Algorithm 1 of arXiv 2307.08691): each program
holds one query tile of one head on chip and streams the key/value tiles of
its key/value head, keeping a running row max ``m`` and row sum ``l`` of the
exponentials (online softmax), so only O(block) memory is used per program
and the output and log-sum-exp are written once.  Which key tiles are
visited, and which need the per-element mask, is decided by
:func:`jaxflash.triton.tiles.tile_loop`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxflash._util import out_struct
from jaxflash.masks import dropout_keep
from jaxflash.triton import dense as dense_lib
from jaxflash.triton import tiles
from jaxflash.triton.common import LN2, Problem, dot, logits
from jaxflash.triton.config import TritonConfig


def _fwd_kernel(*refs, prob: Problem, block_q: int, block_k: int,
                count_tiles: bool, fp8: bool, dropout: tuple | None):
  q_ref, k_ref, v_ref = refs[:3]
  refs = refs[3:]
  qk_dequant = v_dequant = None
  if fp8:
    # FP8 (FlashAttention-3's low-precision forward): this head's
    # dequantization scales, q_scale * k_scale for the logits and v_scale
    # for the output.
    qk_dequant, v_dequant = refs[0][0], refs[0][1]
    refs = refs[1:]
  held_info, stream_info, q_seg_ref, kv_seg_ref, rest = (
      tiles.split_mask_refs(prob.has_segments, prob.has_lengths, refs))
  dense_refs, rest = dense_lib.split_refs(prob, rest)
  biased = dense_lib.has_bias(prob)
  seed = head = None
  row0 = col0 = 0
  if dropout is not None:
    # The seed, the first head, row and key of this call among the whole
    # attention's (a shard or a context-parallel piece hashes global ones).
    seed, first_head, row0, col0 = (rest[0][i] for i in range(4))
    rest = rest[1:]
    head = 0 if dropout[1] else first_head + pl.program_id(2)
  o_ref, lse_ref = rest[0], rest[1]
  mask = prob.mask

  q_start = pl.program_id(0) * block_q
  q = q_ref[...]  # [block_q, D], stays on chip for the whole loop
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  valid = {}
  if prob.has_lengths:
    valid = dict(q_valid=held_info[tiles.ROW_Q_VALID],
                 kv_valid=held_info[tiles.ROW_KV_VALID])
  q_seg = None if q_seg_ref is None else q_seg_ref[...][:, None]

  def body(t, carry, *, masked: bool):
    acc, m_prev, l_prev = carry
    k = tiles.slice_tile(k_ref, t, block_k)
    # Base-2 logits with the softmax scale folded in: exp(x) = exp2(x log2e).
    s, _ = logits(q, k, prob, qk_dequant)  # [block_q, block_k] float32
    k_idx = t * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k),
                                               1)
    if biased:
      s = dense_lib.add_bias(s, dense_refs, prob, held_q=True, t=t,
                             block=block_k, q_idx=q_idx, k_idx=k_idx)
    if masked:
      visible = tiles.kv_tile_visible(mask, q_idx, t, block_k, valid=valid,
                                      q_seg=q_seg, kv_seg_ref=kv_seg_ref)
      dense_vis = dense_lib.visible_tile(dense_refs, prob, held_q=True, t=t,
                                         block=block_k, q_idx=q_idx)
      if dense_vis is not None:
        visible = visible & dense_vis
      s = jnp.where(visible, s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # A bias may hold -inf (a mask given as a bias) even in a tile the
    # mask leaves whole, so with a bias every tile takes the guard.
    if masked or biased:
      # A row with no visible key so far has m = -inf; subtracting 0
      # instead keeps exp2(-inf - 0) = 0 (not exp2(-inf + inf) = NaN).
      m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    else:
      m_use = m_next
    alpha = jnp.exp2(m_prev - m_use)  # rescales the old accumulator
    p = jnp.exp2(s - m_use[:, None])
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    v = tiles.slice_tile(v_ref, t, block_k)
    pv = p
    if dropout is not None:
      # The row sums (and the LSE) are the undropped ones; the product
      # takes the kept probabilities, scaled by 1 / (1 - rate).
      rate = dropout[0]
      keep = dropout_keep(seed, head, q_idx + row0, k_idx + col0, rate)
      pv = jnp.where(keep, p * (1.0 / (1.0 - rate)), 0.0)
    # With FP8 values P (in [0, 1] after the max subtraction) is rounded to
    # their format for the product, as FlashAttention-3 does.
    acc = acc * alpha[:, None] + dot(pv.astype(v.dtype), v)
    return acc, m_next, l_next

  carry = (jnp.zeros((block_q, prob.head_dim_padded), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  result = tiles.tile_loop(
      mask, held_q=True, held_start=q_start, held_block=block_q,
      stream_block=block_k, held_info_ref=held_info,
      stream_info_ref=stream_info, has_lengths=prob.has_lengths, body=body,
      carry=carry, count_tiles=count_tiles,
      dense_class=dense_lib.tile_class(dense_refs, prob, held_q=True),
      dense_range=dense_lib.stream_range(dense_refs, prob, held_q=True))
  if count_tiles:
    (acc, m, l), count = result
    rest[2][...] = jnp.full((block_q,), count, jnp.int32)
  else:
    acc, m, l = result
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  if fp8:
    acc = acc * v_dequant
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  # Natural-log LSE; -inf for rows that see no key.
  lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)


def forward(q, k, v, masks_in: tiles.MaskInputs, *, prob: Problem,
            config: TritonConfig, interpret: bool,
            count_tiles: bool = False, dequant=None, out_dtype=None,
            dropout_seeds=None, dropout: tuple | None = None,
            dense: dense_lib.DenseInputs = dense_lib.NO_DENSE):
  """Padded inputs [B, T, H, Dp] -> (out [B, T, H, Dp], lse [B, H, T]).

  With ``count_tiles`` also returns ``[B, H, T]`` int32: the number of key
  tiles the program of each query row visited (a debug output for tests).
  ``dequant [H, 2]`` float32: FP8 inputs' scales per query head
  (``q_scale * k_scale``, ``v_scale``); ``out_dtype`` the output's dtype
  (default ``q``'s).  ``dropout = (rate, shared)`` with ``dropout_seeds
  [B, 4]`` int32: attention dropout (:func:`jaxflash.masks.dropout_keep`;
  ``MaskArrays.dropout_seeds``).  ``dense``: the padded dense bias and
  mask (:mod:`jaxflash.triton.dense`).
  """
  batch = q.shape[0]
  bq, bk = config.block_q, config.block_k
  dp = prob.head_dim_padded
  group = prob.group
  grid = (prob.q_pad // bq, batch, prob.num_heads)
  held_info, stream_info = tiles.info_arrays(
      masks_in, held_q=True, held_block=bq, stream_block=bk, batch=batch,
      held_len=prob.q_pad, stream_len=prob.kv_pad)
  in_specs = [
      pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, prob.kv_pad, None, dp),
                   lambda i, b, h: (b, 0, h // group, 0)),
      pl.BlockSpec((None, prob.kv_pad, None, dp),
                   lambda i, b, h: (b, 0, h // group, 0)),
  ]
  args = [q, k, v]
  if dequant is not None:
    in_specs.append(pl.BlockSpec((None, 2), lambda i, b, h: (h, 0)))
    args.append(dequant)
  mspecs, margs = tiles.mask_specs_and_args(
      masks_in, held_info, stream_info, held_q=True, held_block=bq,
      stream_len=prob.kv_pad, index_held=lambda i, b, h: (b, i))
  in_specs += mspecs
  args += margs
  dspecs, dargs = dense_lib.specs_and_args(dense, prob, held_q=True,
                                           block_q=bq, block_k=bk)
  in_specs += dspecs
  args += dargs
  if dropout is not None:
    in_specs.append(pl.BlockSpec((None, 4), lambda i, b, h: (b, 0)))
    args.append(dropout_seeds)
  out_specs = [
      pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
  ]
  out_shape = [
      out_struct(q.shape, out_dtype or q.dtype, q, k, v),
      out_struct((batch, prob.num_heads, prob.q_pad), jnp.float32, q, k, v),
  ]
  if count_tiles:
    out_specs.append(pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)))
    out_shape.append(out_struct(
        (batch, prob.num_heads, prob.q_pad), jnp.int32, q, k, v))
  kernel = functools.partial(_fwd_kernel, prob=prob, block_q=bq, block_k=bk,
                             count_tiles=count_tiles,
                             fp8=dequant is not None, dropout=dropout)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                         num_stages=config.num_stages),
      interpret=interpret,
      name="jaxflash_fwd",
  )(*args)
