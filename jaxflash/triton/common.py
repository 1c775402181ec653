"""Helpers shared by the Triton forward and backward kernels."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from jaxflash._util import LOG2E
from jaxflash.masks import MaskSpec

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
  # Dense bias / boolean mask (jax.nn's): which of their (batch, heads,
  # query) axes are full (False: size 1, broadcast), or None when absent.
  bias_axes: tuple[bool, bool, bool] | None = None
  mask_axes: tuple[bool, bool, bool] | None = None
  # FlashMask columns: which of their (batch, heads) axes are full.
  flash_axes: tuple[bool, bool] | None = None
  # ALiBi slopes: whether they vary over the batch rows, or None.
  alibi_batch: bool | None = None

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


def logits(q, k, prob: Problem, dequant=None):
  """Scaled (and soft-capped) logits of one tile, in base 2, float32.

  Returns ``(s2, tanh)``: ``s2 = log2(e) * cap * tanh(q.k * scale / cap)``
  (or without the cap), so that ``exp(logit) = exp2(s2)``; ``tanh`` is kept
  for the backward pass (d cap*tanh(x/cap) / dx = 1 - tanh^2), else None.
  ``dequant``: FP8 operands' scale ``q_scale * k_scale`` (a traced
  scalar), applied with the softmax scale before the cap.
  """
  scale = prob.softmax_scale
  if dequant is not None:
    scale = scale * dequant
  s = dot(q, k, trans_b=True) * scale
  th = None
  if prob.logits_soft_cap is not None:
    th = jnp.tanh(s * (1.0 / prob.logits_soft_cap))
    s = th * prob.logits_soft_cap
  return s * LOG2E, th


def head_dim_padded(head_dim: int) -> int:
  return max(16, 1 << (head_dim - 1).bit_length())
