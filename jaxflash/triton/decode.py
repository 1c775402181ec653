"""Decode and chunked prefill over a paged KV cache, in Pallas (Triton).

FlashDecoding's split-K (Dao et al., "Flash-Decoding for long-context
inference", 2023): program ``(b, kh, s)`` runs the online softmax of
FlashAttention (arXiv 2205.14135, Algorithm 1) over split ``s`` of
sequence ``b``'s pages, for every query row of key/value head ``kh``'s
group at once (FlashInfer's GQA packing: the ``q_len x group`` rows form
one tile, so each page is read once per key/value head), and writes its
normalised partial output and log-sum-exp.  The partials are merged
exactly through their log-sum-exps (:func:`merge`).  Pages are read
through the page table (vLLM's PagedAttention, arXiv 2309.06180): page
``page_indices[b, p]`` holds keys ``p * P .. (p + 1) * P - 1``; entries
past a sequence's length are never read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxflash._util import LOG2E, out_struct
from jaxflash.triton.common import LN2, dot, head_dim_padded


@dataclasses.dataclass(frozen=True)
class PagedConfig:
  """Launch of the paged decode kernel; frozen (a static argument).

  Attributes:
    splits: programs per (sequence, key/value head) along the pages
      (FlashDecoding's split-K); None: :func:`decode_splits`.
    num_warps, num_stages: Triton's launch parameters.
  """

  splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.splits is not None and (not isinstance(self.splits, int)
                                    or self.splits < 1):
      raise ValueError(f"splits={self.splits!r} must be None or a positive"
                       " integer")
    for name in ("num_warps", "num_stages"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < 1:
        raise ValueError(f"{name}={val!r} must be a positive integer")


# decode_splits: programs for at least this many waves of the SMs.
SPLIT_WAVES = 2


def decode_splits(batch: int, kv_heads: int, pages_per_sequence: int,
                  sm_count: int) -> int:
  """Splits of each sequence's pages: enough that ``batch x kv_heads x
  splits`` programs fill :data:`SPLIT_WAVES` waves of ``sm_count`` SMs,
  at most one per page (batch 1 with a long cache splits widely; a large
  batch runs one program per sequence and head, with no merge to pay)."""
  want = -(-SPLIT_WAVES * sm_count // (batch * kv_heads))
  return max(1, min(pages_per_sequence, want))


def check_supported(q, k_pages, config: PagedConfig | None) -> None:
  """NotImplementedError where this kernel cannot serve the call."""
  del config
  page, d = k_pages.shape[1], k_pages.shape[3]
  if page < 16 or page & (page - 1):
    raise NotImplementedError(
        f"the Triton paged kernel takes page sizes that are powers of two"
        f" from 16 (Triton's block shapes), got page_size={page}")
  if d != head_dim_padded(d):
    raise NotImplementedError(
        f"the Triton paged kernel takes head_dims that are powers of two"
        f" from 16 (padding the cache would copy it), got head_dim={d}")
  if q.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
    raise NotImplementedError(f"dtype {q.dtype} is not served")


def _kernel(q_ref, k_ref, v_ref, idx_ref, len_ref, o_ref, lse_ref, *,
            q_len: int, group: int, page: int, pages_per_split: int,
            scale: float, soft_cap: float | None, window_left: int | None):
  split = pl.program_id(2)
  length = len_ref[0]
  rows = q_ref.shape[0]
  # Query row r is (t, g) = divmod(r, group), at position length - q_len + t.
  pos = length - q_len + lax.div(jnp.arange(rows, dtype=jnp.int32),
                                 jnp.int32(group))
  lo = split * pages_per_split
  hi = jnp.minimum(lo + pages_per_split, lax.div(length + page - 1, page))
  if window_left is not None:  # pages wholly before every row's window
    lo = jnp.maximum(lo, lax.div(jnp.maximum(
        length - q_len - window_left, 0), page))
  q = q_ref[...]

  def body(p, carry):
    acc, m_prev, l_prev = carry
    slot = idx_ref[p]
    k = k_ref[slot]  # [page, dp]
    s = dot(q, k, trans_b=True) * scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    s = s * LOG2E
    key = p * page + jnp.arange(page, dtype=jnp.int32)
    keep = (key[None, :] < length) & (key[None, :] <= pos[:, None])
    if window_left is not None:
      keep = keep & (key[None, :] >= pos[:, None] - window_left)
    s = jnp.where(keep, s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # Rows with nothing seen yet keep a finite reference, so exp2 gives 0
    # rather than exp2(-inf - -inf) = NaN.
    m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_use)
    prob = jnp.exp2(s - m_use[:, None])
    v = v_ref[slot]
    acc = acc * alpha[:, None] + dot(prob.astype(v.dtype), v)
    return acc, m_next, l_prev * alpha + jnp.sum(prob, axis=1)

  carry = (jnp.zeros(o_ref.shape, jnp.float32),
           jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  acc, m, l = lax.fori_loop(lo, jnp.maximum(lo, hi), body, carry)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = acc / l_safe[:, None]
  lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)


def merge(out_parts, lse_parts):
  """The exact merge of split-K partials: ``out = sum_s exp(lse_s - lse)
  out_s`` with ``lse = logsumexp_s lse_s`` (each ``out_s`` normalised by
  its own sum).  Splits that saw no key (``lse_s = -inf``) weigh 0; a row
  no split saw gets 0 and ``-inf``.  ``out_parts [..., S, R, D]``,
  ``lse_parts [..., S, R]`` float32."""
  top = jnp.max(lse_parts, axis=-2, keepdims=True)
  top = jnp.where(top == -jnp.inf, 0.0, top)
  w = jnp.exp(lse_parts - top)
  total = jnp.sum(w, axis=-2)
  lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0))
                  + top[..., 0, :], -jnp.inf)
  out = jnp.einsum("...sr,...srd->...rd", w, out_parts) / jnp.where(
      total > 0, total, 1.0)[..., None]
  return out, lse


def paged_forward(q, k_pages, v_pages, page_indices, kv_lengths, *,
                  softmax_scale: float, logits_soft_cap: float | None,
                  window_left: int | None, config: PagedConfig | None,
                  interpret: bool, sm_count: int = 132):
  """``(out [B, T, H, D], lse [B, H, T] float32)`` of queries ``q [B, T,
  H, D]`` over the paged cache (see :mod:`jaxflash.reference`'s
  ``paged_attention`` for the semantics)."""
  config = config or PagedConfig()
  B, T, H, D = q.shape
  _, page, K, _ = k_pages.shape
  M = page_indices.shape[1]
  G = H // K
  rows = max(16, 1 << (T * G - 1).bit_length())
  splits = config.splits or decode_splits(B, K, M, sm_count)
  splits = min(splits, M)
  per_split = -(-M // splits)
  # The q_len x group rows of each key/value head as one tile (row t * G
  # + g), padded to a power of two (Triton's block shapes).
  qt = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(
      B, K, T * G, D)
  qt = jnp.pad(qt, ((0, 0), (0, 0), (0, rows - T * G), (0, 0)))
  idx = page_indices.astype(jnp.int32)
  lengths = kv_lengths.astype(jnp.int32).reshape(B, 1)
  kernel = functools.partial(
      _kernel, q_len=T, group=G, page=page, pages_per_split=per_split,
      scale=float(softmax_scale), soft_cap=logits_soft_cap,
      window_left=window_left)
  out_parts, lse_parts = pl.pallas_call(
      kernel,
      grid=(B, K, splits),
      in_specs=[
          pl.BlockSpec((None, None, rows, D), lambda b, h, s: (b, h, 0, 0)),
          pl.BlockSpec((k_pages.shape[0], page, None, D),
                       lambda b, h, s: (0, 0, h, 0)),
          pl.BlockSpec((v_pages.shape[0], page, None, D),
                       lambda b, h, s: (0, 0, h, 0)),
          pl.BlockSpec((None, M), lambda b, h, s: (b, 0)),
          pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, rows, D),
                       lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows),
                       lambda b, h, s: (b, h, s, 0)),
      ],
      out_shape=[
          out_struct((B, K, splits, rows, D), jnp.float32, q, k_pages),
          out_struct((B, K, splits, rows), jnp.float32, q, k_pages),
      ],
      compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                         num_stages=config.num_stages),
      interpret=interpret,
      name="jaxflash_paged_decode",
  )(qt, k_pages, v_pages, idx, lengths)
  out, lse = merge(out_parts, lse_parts)  # [B, K, rows, D], [B, K, rows]
  out = out[:, :, :T * G].reshape(B, K, T, G, D).transpose(
      0, 2, 1, 3, 4).reshape(B, T, H, D)
  lse = lse[:, :, :T * G].reshape(B, K, T, G).transpose(0, 1, 3, 2)
  return out.astype(q.dtype), lse.reshape(B, H, T)

