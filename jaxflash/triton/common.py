"""Helpers shared by the Triton forward and backward kernels."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash.masks import MaskSpec

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Problem:
  """Static description of one attention call, after padding.

  ``mask`` speaks of the unpadded lengths; ``q_pad``/``kv_pad`` are the
  padded sequence lengths and ``head_dim_padded`` the padded head dim
  (a power of two >= 16, as ``tl.dot`` needs).
  """

  mask: MaskSpec
  softmax_scale: float
  num_heads: int
  num_kv_heads: int
  q_pad: int
  kv_pad: int
  head_dim_padded: int
  logits_soft_cap: float | None = None
  has_segments: bool = False
  has_lengths: bool = False

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads


def dot(a, b, *, trans_b: bool = False, trans_a: bool = False):
  """2-D matmul accumulating in float32.

  float32 operands use IEEE precision (Triton's default would be TF32,
  which loses ~10 mantissa bits and breaks float32 numerics); 16-bit
  operands run on the tensor cores with a float32 accumulator.
  """
  contract_a = 0 if trans_a else 1
  contract_b = 1 if trans_b else 0
  precision = (lax.Precision.HIGHEST if a.dtype == jnp.float32
               else lax.Precision.DEFAULT)
  return lax.dot_general(
      a, b, (((contract_a,), (contract_b,)), ((), ())),
      precision=precision, preferred_element_type=jnp.float32)


def logits(q, k, prob: Problem):
  """Scaled (and soft-capped) logits of one tile, in base 2, float32.

  Returns ``(s2, tanh)``: ``s2 = log2(e) * cap * tanh(q.k * scale / cap)``
  (or without the cap), so that ``exp(logit) = exp2(s2)``; ``tanh`` is kept
  for the backward pass (d cap*tanh(x/cap) / dx = 1 - tanh^2), else None.
  """
  s = dot(q, k, trans_b=True) * prob.softmax_scale
  th = None
  if prob.logits_soft_cap is not None:
    th = jnp.tanh(s * (1.0 / prob.logits_soft_cap))
    s = th * prob.logits_soft_cap
  return s * LOG2E, th


def softmax_delta(out, dout, dlse):
  """``delta_i = sum_d dO_id O_id - dlse_i`` per query row, float32,
  ``[B, H, T]`` from ``[B, T, H, D]`` operands (``dlse`` ``[B, H, T]``).

  A product summed over ``d`` in float32, then the small ``[B, T, H]``
  result transposed: one fused XLA pass, shared by both backends' backward.
  (The einsum ``"bthd,bthd->bht"`` it replaces is a ``dot_general`` with
  reordered batch dimensions; on the H200 XLA ran it as the same fused
  reduction, bitwise equal and as fast, 0.04 ms at 16k tokens x width 2048,
  docs/benchmarks/h200-2026-12-02-softmax-overlap.md.)  ``d lse_i / d s_ij
  = P_ij``, so the LSE cotangent enters the gradient through ``delta``.
  """
  prod = out.astype(jnp.float32) * dout.astype(jnp.float32)
  return (jnp.sum(prod, axis=-1).transpose(0, 2, 1)
          - dlse.astype(jnp.float32))


def out_struct(shape, dtype, *like) -> jax.ShapeDtypeStruct:
  """A kernel output type that varies over the manual mesh axes of the
  arrays it is computed from (needed inside ``shard_map`` with
  ``check_vma=True``)."""
  mats = [jax.typeof(x).manual_axis_type for x in like]
  varying = frozenset().union(*(m.varying for m in mats))
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=mats[0].update(varying=varying))


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  """Zero-pads ``axis`` of ``x`` up to ``size`` (no copy when equal)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def head_dim_padded(head_dim: int) -> int:
  return max(16, 1 << (head_dim - 1).bit_length())
