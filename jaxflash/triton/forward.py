"""Forward kernel (Pallas, Triton lowering).

FlashAttention-2 forward (Algorithm 1 of arXiv 2307.08691): each program
holds one query tile of one head on chip and streams the key/value tiles of
its key/value head, keeping a running row max ``m`` and row sum ``l`` of the
exponentials (online softmax), so only O(block) memory is used per program
and the output and log-sum-exp are written once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxflash.triton.common import LN2, LOG2E, Problem, dot
from jaxflash.triton.config import TritonConfig


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, prob: Problem,
                block_q: int, block_k: int):
  mask = prob.mask
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]  # [block_q, D], stays on chip for the whole loop
  # Work in base 2: exp(x) = exp2(x * log2(e)), with the softmax scale
  # folded into the same multiplier (one multiply per logit).
  qk_scale = prob.softmax_scale * LOG2E
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)

  def body(t, carry, *, masked: bool):
    acc, m_prev, l_prev = carry
    k_slice = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
    k = k_ref[k_slice, :]
    s = dot(q, k, trans_b=True) * qk_scale  # [block_q, block_k] float32
    if masked:
      k_idx = t * block_k + lax.broadcasted_iota(
          jnp.int32, (block_q, block_k), 1)
      s = jnp.where(mask.visible(q_idx, k_idx), s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    if masked:
      # A row with no visible key so far has m = -inf; subtracting 0
      # instead keeps exp2(-inf - 0) = 0 (not exp2(-inf + inf) = NaN).
      m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    else:
      m_use = m_next
    alpha = jnp.exp2(m_prev - m_use)  # rescales the old accumulator
    p = jnp.exp2(s - m_use[:, None])
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    v = v_ref[k_slice, :]
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m_next, l_next

  lo, full_lo, full_hi, hi = mask.kv_block_range(q_start, block_q, block_k)
  carry = (jnp.zeros((block_q, prob.head_dim_padded), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  # Three runs over the live key tiles: partial tiles before, fully visible
  # tiles (no mask arithmetic), partial tiles after.  Tiles outside
  # [lo, hi) are fully masked and never loaded.
  carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True),
                        carry)
  carry = lax.fori_loop(full_lo, full_hi,
                        functools.partial(body, masked=False), carry)
  carry = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True),
                        carry)
  acc, m, l = carry
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  # Natural-log LSE; -inf for rows that see no key.
  lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)


def forward(q, k, v, *, prob: Problem, config: TritonConfig,
            interpret: bool):
  """Padded inputs [B, T, H, Dp] -> (out [B, T, H, Dp], lse [B, H, T])."""
  batch = q.shape[0]
  bq, bk = config.block_q, config.block_k
  dp = prob.head_dim_padded
  group = prob.group
  grid = (prob.q_pad // bq, batch, prob.num_heads)
  kernel = functools.partial(_fwd_kernel, prob=prob, block_q=bq, block_k=bk)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[
          pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, prob.kv_pad, None, dp),
                       lambda i, b, h: (b, 0, h // group, 0)),
          pl.BlockSpec((None, prob.kv_pad, None, dp),
                       lambda i, b, h: (b, 0, h // group, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct(q.shape, q.dtype),
          jax.ShapeDtypeStruct((batch, prob.num_heads, prob.q_pad),
                               jnp.float32),
      ],
      compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                         num_stages=config.num_stages),
      interpret=interpret,
      name="jaxflash_fwd",
  )(q, k, v)
