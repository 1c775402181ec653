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
only the tiles the mask leaves alive (same tile ranges as the forward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxflash.triton.common import LOG2E, Problem, dot
from jaxflash.triton.config import TritonConfig


def _probs(q, k, lse2, q_idx, k_idx, *, prob: Problem, masked: bool):
  """P = exp2(S * scale * log2e - lse * log2e) for one tile, in float32."""
  s = dot(q, k, trans_b=True) * (prob.softmax_scale * LOG2E)
  if masked:
    s = jnp.where(prob.mask.visible(q_idx, k_idx), s, -jnp.inf)
  # lse2 is +inf for rows that saw no key (see _lse2), so P = 0 there.
  return jnp.exp2(s - lse2[:, None])


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref,
                dk_ref, dv_ref, *, prob: Problem, block_q: int,
                block_k: int):
  k_start = pl.program_id(0) * block_k
  k = k_ref[...]  # [block_k, D]
  v = v_ref[...]
  k_idx = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)

  def body(t, carry, *, g, masked: bool):
    dk, dv = carry
    q_slice = pl.ds(pl.multiple_of(t * block_q, block_q), block_q)
    q = q_ref[q_slice, g, :]
    do = do_ref[q_slice, g, :]
    lse2 = lse2_ref[g, q_slice]
    delta = delta_ref[g, q_slice]
    q_idx = t * block_q + lax.broadcasted_iota(
        jnp.int32, (block_q, block_k), 0)
    p = _probs(q, k, lse2, q_idx, k_idx, prob=prob, masked=masked)
    dv = dv + dot(p.astype(do.dtype), do, trans_a=True)  # P^T dO
    dp = dot(do, v, trans_b=True)                         # dO V^T
    ds = p * (dp - delta[:, None])                        # dS (no scale)
    dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)    # dS^T Q
    return dk, dv

  lo, full_lo, full_hi, hi = prob.mask.q_block_range(k_start, block_k,
                                                     block_q)
  carry = (jnp.zeros((block_k, prob.head_dim_padded), jnp.float32),
           jnp.zeros((block_k, prob.head_dim_padded), jnp.float32))

  def group_body(g, carry):
    carry = lax.fori_loop(lo, full_lo, functools.partial(
        body, g=g, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(
        body, g=g, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(
        body, g=g, masked=True), carry)

  if prob.group == 1:
    dk, dv = group_body(0, carry)
  else:
    dk, dv = lax.fori_loop(0, prob.group, group_body, carry)
  dk_ref[...] = (dk * prob.softmax_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref, *,
               prob: Problem, block_q: int, block_k: int):
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  do = do_ref[...]
  lse2 = lse2_ref[...]
  delta = delta_ref[...]
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)

  def body(t, dq, *, masked: bool):
    k_slice = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
    k = k_ref[k_slice, :]
    v = v_ref[k_slice, :]
    k_idx = t * block_k + lax.broadcasted_iota(
        jnp.int32, (block_q, block_k), 1)
    p = _probs(q, k, lse2, q_idx, k_idx, prob=prob, masked=masked)
    dp = dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + dot(ds.astype(k.dtype), k)

  lo, full_lo, full_hi, hi = prob.mask.kv_block_range(q_start, block_q,
                                                      block_k)
  dq = jnp.zeros((block_q, prob.head_dim_padded), jnp.float32)
  dq = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), dq)
  dq = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False),
                     dq)
  dq = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), dq)
  dq_ref[...] = (dq * prob.softmax_scale).astype(dq_ref.dtype)


def _lse2(lse):
  """Base-2 LSE for the backward; +inf where the forward saw no key.

  The forward reports -inf for an empty row (log of an empty sum).  Every
  logit of such a row is masked to -inf, and exp2(-inf - (+inf)) = 0 gives
  P = 0 and zero gradients, where -inf would give NaN.
  """
  return jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)


def backward(q, k, v, o, lse, do, dlse, *, prob: Problem,
             config: TritonConfig, interpret: bool):
  """Padded tensors -> (dq, dk, dv), each padded like its input.

  ``dlse`` is the cotangent of the log-sum-exp ([B, H, T] float32): since
  d lse_i / d s_ij = P_ij, it enters as ``delta - dlse``.
  """
  batch = q.shape[0]
  dp = prob.head_dim_padded
  group = prob.group
  # delta_i = sum_d dO_id O_id, in float32: one fused XLA pass.
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32),
                     do.astype(jnp.float32))
  delta = delta - dlse
  lse2 = _lse2(lse)
  params = plt.CompilerParams(num_warps=config.num_warps_bwd,
                              num_stages=config.num_stages_bwd)

  bq, bk = config.block_q_dkv, config.block_k_dkv
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, prob=prob, block_q=bq, block_k=bk),
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
      ],
      out_specs=[
          pl.BlockSpec((None, bk, None, dp), lambda j, b, h: (b, j, h, 0)),
          pl.BlockSpec((None, bk, None, dp), lambda j, b, h: (b, j, h, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params,
      interpret=interpret,
      name="jaxflash_bwd_dkv",
  )(q, k, v, do, lse2, delta)

  bq, bk = config.block_q_dq, config.block_k_dq
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, prob=prob, block_q=bq, block_k=bk),
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
      ],
      out_specs=pl.BlockSpec((None, bq, None, dp),
                             lambda i, b, h: (b, i, h, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params,
      interpret=interpret,
      name="jaxflash_bwd_dq",
  )(q, k, v, do, lse2, delta)
  return dq, dk, dv
