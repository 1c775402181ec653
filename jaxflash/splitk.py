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
from jax import lax


def check_counts(config, optional=(), required=()) -> None:
  """ValueError unless each of a launch config's fields ``optional`` is
  None or a positive int and each of ``required`` a positive int."""
  for name in (*optional, *required):
    val = getattr(config, name)
    if val is None and name in optional:
      continue
    if not isinstance(val, int) or val < 1:
      none = "None or " if name in optional else ""
      raise ValueError(f"{name}={val!r} must be {none}a positive integer")


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


def split_pages(*, length, start, first_row, rows: int, q_len: int,
                group: int, page: int, per_step: int, split, splits,
                causal: bool, window_left: int | None,
                window_right: int | None):
  """Inside a kernel: split ``split`` of ``splits``' pages ``[lo, hi)``
  of a row tile, and ``end``, the keys' end that some row may see.

  The tile holds packed rows ``first_row .. first_row + rows - 1``
  (:func:`pack_rows`: row ``r`` is query ``r // group`` at position
  ``start + r // group``; rows past ``q_len x group`` are padding) of a
  sequence of ``length`` keys.  The keys some row may see, ``[first,
  end)``, are bounded by the causal mask or the window; the splits share
  their pages evenly in whole loop steps of ``per_step`` pages, planned
  from the sequence's own length, so one compiled call serves any mix of
  lengths with every split busy.  Returns ``(lo, hi, end)``."""
  last = start + jnp.minimum(q_len - 1, lax.div(first_row + rows - 1,
                                                jnp.int32(group)))
  head = start + lax.div(first_row, jnp.int32(group))
  end = length
  if causal:
    end = jnp.minimum(end, last + 1)
  elif window_right is not None:
    end = jnp.minimum(end, last + window_right + 1)
  first = (jnp.int32(0) if window_left is None
           else jnp.maximum(head - window_left, 0))
  first_page = lax.div(first, page)
  end_page = lax.div(end + page - 1, page)
  per = lax.div(jnp.maximum(end_page - first_page, 0) + splits - 1, splits)
  per = lax.div(per + per_step - 1, per_step) * per_step
  lo = first_page + split * per
  return lo, jnp.minimum(lo + per, end_page), end


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
