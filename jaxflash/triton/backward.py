"""Backward kernels (Pallas, Triton lowering).

FlashAttention-2 backward (Algorithm 2 of arXiv 2307.08691), split in two
kernels so that neither needs atomics or an N x N buffer:

* ``delta = rowsum(dO * O)`` (minus the log-sum-exp cotangent, when the
  caller differentiates through the LSE) is one fused XLA elementwise pass.
* dK/dV: each program holds one key/value tile of one key/value head and
  streams the query tiles of every query head of its group (GQA: the group
  sum happens on chip, no repeated K/V and no second reduction).
* dQ: each program holds one query tile and streams key/value tiles.

Both recompute ``P = exp(S - lse)`` from the saved log-sum-exp, and visit
only the tiles the mask leaves alive (:func:`jaxflash.triton.tiles.tile_loop`,
the same rule as the forward).  With a soft cap, ``dS`` is multiplied by
the derivative of ``cap * tanh(x / cap)``, ``1 - tanh^2``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxflash._util import LOG2E, out_struct, softmax_delta
from jaxflash.masks import dropout_keep
from jaxflash.triton import dense as dense_lib
from jaxflash.triton import tiles
from jaxflash.triton.common import Problem, dot, logits
from jaxflash.triton.config import TritonConfig


def _dscores(q, k, v, do, lse2, delta, visible, *, prob: Problem,
             keep=None, rate: float = 0.0, bias=None):
  """(P, dS) of one tile, float32; dS is w.r.t. the scaled logits / scale.

  ``visible``: the tile's element mask, or None for a fully visible tile.
  lse2 is +inf for rows that saw no key (see _lse2), so P = 0 there.
  ``keep``: attention dropout's keep mask of the tile; P is then the
  dropped ``P * keep / (1 - rate)`` the forward multiplied V by, and dS
  that of the undropped softmax: ``P (keep dP / (1 - rate) - delta)``,
  with ``delta = rowsum(dO O)`` of the dropped output (FlashAttention-2's
  dropout backward).  ``bias``: ``s2 -> s2`` adding the dense bias's
  tile, or None.
  """
  s, th = logits(q, k, prob)
  if bias is not None:
    s = bias(s)
  if visible is not None:
    s = jnp.where(visible, s, -jnp.inf)
  p = jnp.exp2(s - lse2[:, None])
  dp = dot(do, v, trans_b=True)           # dO V^T
  if keep is not None:
    z = jnp.where(keep, 1.0 / (1.0 - rate), 0.0)
    ds = p * (dp * z - delta[:, None])
    p = p * z
  else:
    ds = p * (dp - delta[:, None])        # softmax backward
  if th is not None:
    ds = ds * (1.0 - th * th)             # through cap * tanh(x / cap)
  return p, ds


def _valid(prob, held_info):
  if not prob.has_lengths:
    return {}
  return dict(q_valid=held_info[tiles.ROW_Q_VALID],
              kv_valid=held_info[tiles.ROW_KV_VALID])


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *rest,
                prob: Problem, block_q: int, block_k: int,
                dropout: tuple | None, dbias: bool):
  held_info, stream_info, kv_seg_ref, q_seg_ref, rest = tiles.split_mask_refs(
      prob.has_segments, prob.has_lengths, rest)
  dense_refs, rest = dense_lib.split_refs(prob, rest)
  biased = dense_lib.has_bias(prob)
  seed = None
  # The group's first query head among all heads, read outside the loops.
  first_head = pl.program_id(2) * prob.group
  row0 = col0 = 0
  if dropout is not None:
    seed, first_head, row0, col0 = (rest[0][0], first_head + rest[0][1],
                                    rest[0][2], rest[0][3])
    rest = rest[1:]
  if dbias:
    rest = rest[1:]  # the zeroed dbias input, aliased to the output
  dk_ref, dv_ref = rest[:2]
  dbias_ref = rest[2] if dbias else None
  k_start = pl.program_id(0) * block_k
  k = k_ref[...]  # [block_k, D]
  v = v_ref[...]
  k_idx = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  valid = _valid(prob, held_info)
  k_seg = None if kv_seg_ref is None else kv_seg_ref[...][None, :]

  def body(t, carry, *, g, masked: bool):
    dk, dv = carry
    q_slice = pl.ds(pl.multiple_of(t * block_q, block_q), block_q)
    q = q_ref[q_slice, g, :]
    do = do_ref[q_slice, g, :]
    rows = t * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k),
                                              0)
    visible = None
    if masked:
      visible = tiles.q_tile_visible(prob.mask, k_idx, t, block_q,
                                     valid=valid, k_seg=k_seg,
                                     q_seg_ref=q_seg_ref)
      dense_vis = dense_lib.visible_tile(dense_refs, prob, held_q=False,
                                         t=t, g=g, block=block_q, q_idx=rows)
      if dense_vis is not None:
        visible = visible & dense_vis
    bias = None
    if biased:
      bias = lambda s: dense_lib.add_bias(
          s, dense_refs, prob, held_q=False, t=t, g=g, block=block_q,
          q_idx=rows, k_idx=k_idx)
    keep, rate = None, 0.0
    if dropout is not None:
      rate, shared = dropout
      head = 0 if shared else first_head + g
      keep = dropout_keep(seed, head, rows + row0, k_idx + col0, rate)
    p, ds = _dscores(q, k, v, do, lse2_ref[g, q_slice],
                     delta_ref[g, q_slice], visible, prob=prob, keep=keep,
                     rate=rate, bias=bias)
    if dbias_ref is not None:
      # dL/dbias is dS itself (the bias adds to the scaled logits; a bias
      # never comes with a soft cap, whose derivative dS holds); each
      # program owns its key columns, so the stores never overlap.
      dbias_ref[g, q_slice, :] = ds
    dv = dv + dot(p.astype(do.dtype), do, trans_a=True)  # P^T dO
    dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)   # dS^T Q
    return dk, dv

  def group_body(g, carry):
    return tiles.tile_loop(
        prob.mask, held_q=False, held_start=k_start, held_block=block_k,
        stream_block=block_q, held_info_ref=held_info,
        stream_info_ref=stream_info, has_lengths=prob.has_lengths,
        body=functools.partial(body, g=g), carry=carry,
        dense_class=dense_lib.tile_class(dense_refs, prob, held_q=False,
                                         g=g),
        dense_range=dense_lib.stream_range(dense_refs, prob, held_q=False,
                                           g=g))

  carry = (jnp.zeros((block_k, prob.head_dim_padded), jnp.float32),
           jnp.zeros((block_k, prob.head_dim_padded), jnp.float32))
  if prob.group == 1:
    dk, dv = group_body(0, carry)
  else:
    dk, dv = lax.fori_loop(0, prob.group, group_body, carry)
  dk_ref[...] = (dk * prob.softmax_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *rest,
               prob: Problem, block_q: int, block_k: int,
               dropout: tuple | None):
  held_info, stream_info, q_seg_ref, kv_seg_ref, rest = tiles.split_mask_refs(
      prob.has_segments, prob.has_lengths, rest)
  dense_refs, rest = dense_lib.split_refs(prob, rest)
  biased = dense_lib.has_bias(prob)
  seed = None
  q_head = pl.program_id(2)  # read outside the loop
  row0 = col0 = 0
  if dropout is not None:
    seed, q_head, row0, col0 = (rest[0][0], q_head + rest[0][1], rest[0][2],
                                rest[0][3])
    rest = rest[1:]
  (dq_ref,) = rest
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  do = do_ref[...]
  lse2 = lse2_ref[...]
  delta = delta_ref[...]
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  valid = _valid(prob, held_info)
  q_seg = None if q_seg_ref is None else q_seg_ref[...][:, None]

  def body(t, dq, *, masked: bool):
    k = tiles.slice_tile(k_ref, t, block_k)
    v = tiles.slice_tile(v_ref, t, block_k)
    visible = None
    if masked:
      visible = tiles.kv_tile_visible(prob.mask, q_idx, t, block_k,
                                      valid=valid, q_seg=q_seg,
                                      kv_seg_ref=kv_seg_ref)
      dense_vis = dense_lib.visible_tile(dense_refs, prob, held_q=True, t=t,
                                         block=block_k, q_idx=q_idx)
      if dense_vis is not None:
        visible = visible & dense_vis
    cols = t * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k),
                                              1)
    bias = None
    if biased:
      bias = lambda s: dense_lib.add_bias(
          s, dense_refs, prob, held_q=True, t=t, block=block_k, q_idx=q_idx,
          k_idx=cols)
    keep, rate = None, 0.0
    if dropout is not None:
      rate, shared = dropout
      keep = dropout_keep(seed, 0 if shared else q_head, q_idx + row0,
                          cols + col0, rate)
    _, ds = _dscores(q, k, v, do, lse2, delta, visible, prob=prob,
                     keep=keep, rate=rate, bias=bias)
    return dq + dot(ds.astype(k.dtype), k)

  dq = tiles.tile_loop(
      prob.mask, held_q=True, held_start=q_start, held_block=block_q,
      stream_block=block_k, held_info_ref=held_info,
      stream_info_ref=stream_info, has_lengths=prob.has_lengths, body=body,
      carry=jnp.zeros((block_q, prob.head_dim_padded), jnp.float32),
      dense_class=dense_lib.tile_class(dense_refs, prob, held_q=True),
      dense_range=dense_lib.stream_range(dense_refs, prob, held_q=True))
  dq_ref[...] = (dq * prob.softmax_scale).astype(dq_ref.dtype)


def _lse2(lse):
  """Base-2 LSE for the backward; +inf where the forward saw no key.

  The forward reports -inf for an empty row (log of an empty sum).  Every
  logit of such a row is masked to -inf, and exp2(-inf - (+inf)) = 0 gives
  P = 0 and zero gradients, where -inf would give NaN.
  """
  return jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)


def backward(q, k, v, o, lse, do, dlse, masks_in: tiles.MaskInputs, *,
             prob: Problem, config: TritonConfig, interpret: bool,
             dropout_seeds=None, dropout: tuple | None = None,
             dense: dense_lib.DenseInputs = dense_lib.NO_DENSE,
             dbias: bool = False):
  """Padded tensors -> (dq, dk, dv), each padded like its input, and with
  ``dbias`` a fourth: the gradient of the logits ``[B, H, T_pad, S_pad]``
  float32 (zero on skipped tiles), which is the dense bias's before its
  broadcast axes are summed.

  ``dlse`` is the cotangent of the log-sum-exp ([B, H, T] float32): since
  d lse_i / d s_ij = P_ij, it enters as ``delta - dlse``.  ``dropout``,
  ``dropout_seeds``, ``dense``: as the forward's.
  """
  seed_args = [] if dropout is None else [dropout_seeds]
  batch = q.shape[0]
  dp = prob.head_dim_padded
  group = prob.group
  delta = softmax_delta(o, do, dlse)  # one fused XLA pass, float32
  lse2 = _lse2(lse)
  params = plt.CompilerParams(num_warps=config.num_warps_bwd,
                              num_stages=config.num_stages_bwd)

  bq, bk = config.block_q_dkv, config.block_k_dkv
  held_info, stream_info = tiles.info_arrays(
      masks_in, held_q=False, held_block=bk, stream_block=bq, batch=batch,
      held_len=prob.kv_pad, stream_len=prob.q_pad)
  mspecs, margs = tiles.mask_specs_and_args(
      masks_in, held_info, stream_info, held_q=False, held_block=bk,
      stream_len=prob.q_pad, index_held=lambda j, b, h: (b, j))
  dspecs, dargs = dense_lib.specs_and_args(dense, prob, held_q=False,
                                           block_q=bq, block_k=bk)
  mspecs, margs = mspecs + dspecs, margs + dargs
  if dropout is not None:
    mspecs = [*mspecs, pl.BlockSpec((None, 4), lambda j, b, h: (b, 0))]
  out_specs = [
      pl.BlockSpec((None, bk, None, dp), lambda j, b, h: (b, j, h, 0)),
      pl.BlockSpec((None, bk, None, dp), lambda j, b, h: (b, j, h, 0))]
  out_shape = [out_struct(k.shape, k.dtype, q, k, v, do),
               out_struct(v.shape, v.dtype, q, k, v, do)]
  extra, aliases = [], {}
  if dbias:
    # Skipped tiles are never written: the output starts as zeros (an
    # input aliased to it).
    ds_spec = pl.BlockSpec((None, group, prob.q_pad, bk),
                           lambda j, b, h: (b, h, 0, j))
    n_in = 6 + len(margs) + (dropout is not None)
    extra = [jnp.zeros((batch, prob.num_heads, prob.q_pad, prob.kv_pad),
                       jnp.float32)]
    mspecs = [*mspecs, ds_spec]
    out_specs.append(ds_spec)
    out_shape.append(out_struct(extra[0].shape, jnp.float32, q, k, v, do))
    aliases = {n_in: 2}
  dkv = pl.pallas_call(
      functools.partial(_dkv_kernel, prob=prob, block_q=bq, block_k=bk,
                        dropout=dropout, dbias=dbias),
      grid=(prob.kv_pad // bk, batch, prob.num_kv_heads),
      in_specs=[
          # All query heads of this key/value head's group.
          pl.BlockSpec((None, prob.q_pad, group, dp),
                       lambda j, b, h: (b, 0, h, 0)),
          pl.BlockSpec((None, bk, None, dp), lambda j, b, h: (b, j, h, 0)),
          pl.BlockSpec((None, bk, None, dp), lambda j, b, h: (b, j, h, 0)),
          pl.BlockSpec((None, prob.q_pad, group, dp),
                       lambda j, b, h: (b, 0, h, 0)),
          pl.BlockSpec((None, group, prob.q_pad), lambda j, b, h: (b, h, 0)),
          pl.BlockSpec((None, group, prob.q_pad), lambda j, b, h: (b, h, 0)),
          *mspecs,
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=params,
      interpret=interpret,
      name="jaxflash_bwd_dkv",
  )(q, k, v, do, lse2, delta, *margs, *seed_args, *extra)
  dk, dv = dkv[:2]

  bq, bk = config.block_q_dq, config.block_k_dq
  held_info, stream_info = tiles.info_arrays(
      masks_in, held_q=True, held_block=bq, stream_block=bk, batch=batch,
      held_len=prob.q_pad, stream_len=prob.kv_pad)
  mspecs, margs = tiles.mask_specs_and_args(
      masks_in, held_info, stream_info, held_q=True, held_block=bq,
      stream_len=prob.kv_pad, index_held=lambda i, b, h: (b, i))
  dspecs, dargs = dense_lib.specs_and_args(dense, prob, held_q=True,
                                           block_q=bq, block_k=bk)
  mspecs, margs = mspecs + dspecs, margs + dargs
  if dropout is not None:
    mspecs = [*mspecs, pl.BlockSpec((None, 4), lambda i, b, h: (b, 0))]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, prob=prob, block_q=bq, block_k=bk,
                        dropout=dropout),
      grid=(prob.q_pad // bq, batch, prob.num_heads),
      in_specs=[
          pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, prob.kv_pad, None, dp),
                       lambda i, b, h: (b, 0, h // group, 0)),
          pl.BlockSpec((None, prob.kv_pad, None, dp),
                       lambda i, b, h: (b, 0, h // group, 0)),
          pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
          *mspecs,
      ],
      out_specs=pl.BlockSpec((None, bq, None, dp),
                             lambda i, b, h: (b, i, h, 0)),
      out_shape=out_struct(q.shape, q.dtype, q, k, v, do),
      compiler_params=params,
      interpret=interpret,
      name="jaxflash_bwd_dq",
  )(q, k, v, do, lse2, delta, *margs, *seed_args)
  if dbias:
    return dq, dk, dv, dkv[2]
  return dq, dk, dv
