"""FlashDecoding's split-K, shared by the paged decode kernels (Dao et al.,
"Flash-Decoding for long-context inference", 2023): each kernel program
attends over one split of a sequence's keys and writes its normalised
partial output and log-sum-exp; :func:`merge` combines the partials
exactly.  The rows of one key/value head's query group are packed into
tiles first (:func:`pack_rows`, FlashInfer's GQA packing: each page is
read once per key/value head) and unpacked after (:func:`unpack_rows`).
"""

from __future__ import annotations

import jax.numpy as jnp


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


def pack_rows(q, kv_heads: int, rows: int):
  """``q [B, T, H, D]`` as ``[B, kv_heads, rows, D]``: key/value head
  ``k``'s ``T x G`` query rows (row ``t * G + g`` is query ``t`` of head
  ``k * G + g``, ``G = H / kv_heads``), zero-padded to ``rows``."""
  B, T, H, D = q.shape
  G = H // kv_heads
  qt = q.reshape(B, T, kv_heads, G, D).transpose(0, 2, 1, 3, 4).reshape(
      B, kv_heads, T * G, D)
  return jnp.pad(qt, ((0, 0), (0, 0), (0, rows - T * G), (0, 0)))


def unpack_rows(out, lse, q_len: int, heads: int):
  """:func:`pack_rows` undone on the merged ``out [B, K, rows, D]`` and
  ``lse [B, K, rows]``: ``(out [B, T, H, D], lse [B, H, T])``."""
  B, K, _, D = out.shape
  G = heads // K
  out = out[:, :, :q_len * G].reshape(B, K, q_len, G, D).transpose(
      0, 2, 1, 3, 4).reshape(B, q_len, heads, D)
  lse = lse[:, :, :q_len * G].reshape(B, K, q_len, G).transpose(0, 1, 3, 2)
  return out, lse.reshape(B, heads, q_len)
