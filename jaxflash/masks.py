"""Attention masks as compact descriptions, and the tile arithmetic on them.

No N x N array is built here (except by :meth:`MaskSpec.dense`, for the
reference).  A mask is the conjunction of

* positional terms, static: ``causal`` and a local window, both relative to
  the *aligned* key position of query ``i``, which is ``i + offset``;
* per-row lengths, dynamic: ``q_valid`` / ``kv_valid`` positions of each
  batch row (right padding);
* segment ids, dynamic: a query attends only keys of its own segment, and a
  negative id (:data:`PAD_SEGMENT_ID`) marks a token that attends nowhere
  and that nothing attends to.

Alignment (bottom-right, as in FlashAttention >= 2.1): ``offset`` defaults
to ``kv_len - q_len``, so the last query lines up with the last key.  With
``q_len=2, kv_len=5`` and ``causal`` (``x`` = visible)::

          keys 0 1 2 3 4
    query 0    x x x x .
    query 1    x x x x x

and with ``q_len=5, kv_len=2`` the first three query rows see nothing::

          keys 0 1
    query 0    . .
    query 1    . .
    query 2    . .
    query 3    x .
    query 4    x x

A local window ``(left, right)`` keeps keys ``j`` with
``i + offset - left <= j <= i + offset + right``.

Rows that see no key produce output 0 and log-sum-exp ``-inf`` (the log of
an empty sum), and zero gradients.

Kernels ask :meth:`MaskSpec.kv_block_range` (forward, dQ: a query tile
streaming key tiles) or :meth:`MaskSpec.q_block_range` (dK/dV: a key tile
streaming query tiles) which partner tiles to visit at all, and which of
those are fully visible (no per-element mask).  With segment ids the
kernels also consult per-tile summaries (:func:`tile_summary`,
:func:`overlap_range`) computed on the device by a few XLA reductions.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

PAD_SEGMENT_ID = -1
"""Segment id of padding tokens: any negative id attends nowhere."""

_BIG = 2**30  # an int32 larger than any sequence position or segment id


class MaskArrays(NamedTuple):
  """The dynamic part of a mask (a pytree of int32 arrays or None).

  ``q_segment_ids [B, T]``, ``kv_segment_ids [B, S]`` (both or neither),
  ``q_seq_lengths [B]``, ``kv_seq_lengths [B]``, and ``dropout_seeds
  [B, 4]``: attention dropout's seed per batch row (:func:`dropout_keep`)
  and the index of the call's first head, first query row and first key
  among the whole attention's (not 0 in a shard of head-sharded or
  context-parallel attention, so each position keeps its own mask).

  Dense terms, as ``jax.nn.dot_product_attention``'s: ``bias [B|1, H|1,
  T|1, S]`` (floating, added to the scaled logits; the one differentiable
  entry) and ``dense_mask [B|1, H|1, T|1, S]`` (bool, False hides the
  key); an axis of size 1 broadcasts.  ``flash_mask [B|1, H|1, n, S]``
  int32: a FlashMask's columns (:func:`jaxflash.flashmask.columns`).
  ``alibi_slopes [B|1, H, 1, 2]`` float32: ALiBi's slope per head in
  ``[..., 0]`` (:func:`alibi_bias`; ``[..., 1]`` unused).

  Not a mask, but a per-head term partitioned the same way:
  ``fp8_scales [1, H, 1, 2]`` float32, FP8 inputs' dequantization per
  query head (``q_scale * k_scale``, ``v_scale``; :mod:`jaxflash.fp8`).
  """

  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  q_seq_lengths: jax.Array | None = None
  kv_seq_lengths: jax.Array | None = None
  dropout_seeds: jax.Array | None = None
  bias: jax.Array | None = None
  dense_mask: jax.Array | None = None
  flash_mask: jax.Array | None = None
  alibi_slopes: jax.Array | None = None
  fp8_scales: jax.Array | None = None

  @property
  def has_dense(self) -> bool:
    return (self.bias is not None or self.dense_mask is not None
            or self.flash_mask is not None or self.alibi_slopes is not None)


def fold_lengths(seg, lengths, batch: int, n: int, start=0) -> jax.Array:
  """Segment ids ``[batch, n]`` int32 of positions ``start .. start + n -
  1`` with the sequence lengths folded in: a position at or past its
  row's length takes :data:`PAD_SEGMENT_ID` (attends nowhere, seen by
  none), as the kernels take lengths.  ``seg`` ``[batch, n]`` or None
  (every position id 0), ``lengths`` ``[batch]`` or None."""
  ids = (jnp.zeros((batch, n), jnp.int32) if seg is None
         else seg.astype(jnp.int32))
  if lengths is None:
    return ids
  pos = start + jnp.arange(n, dtype=jnp.int32)[None, :]
  return jnp.where(pos < lengths.astype(jnp.int32)[:, None], ids,
                   PAD_SEGMENT_ID)


def alibi_bias(slope, q_idx, k_idx, offset: int, shift=None):
  """ALiBi (Press et al., arXiv 2108.12409) as FlashAttention-2 applies
  it: ``-slope * |i + offset - j|`` added to the scaled logits, ``i +
  offset`` the query's aligned key position (the bias is ``slope * (j -
  i')`` on the keys a causal mask keeps).  ``shift`` (float, an integer
  value): added to ``i + offset - j`` at run time (context parallelism's
  block pairs: the pair's global row offset less its key offset)."""
  d = (q_idx + offset - k_idx).astype(jnp.float32)
  return -slope * jnp.abs(d if shift is None else d + shift)


# Attention dropout's keep mask, as FlashAttention-1/2 make it: a pure
# function of (seed, head, row, column), so the backward regenerates it
# and nothing of size N x N is stored.  A counter-based hash (the
# finaliser of MurmurHash3, Appleby, a bijection of uint32): uint32
# multiplies, xors and shifts, the same in XLA and in the kernels.  The
# rows' and the columns' keys are hashed once per row / column (on the
# kernels' row and column vectors); each pair costs one mix of the two
# (the kernels' per-element work, which bounds a call with dropout: two
# mixes per pair ran 2.1-3.1x slower than without dropout on an H100).
# Each row has two 32-bit keys, the second xored into the mixed pair, so
# two (head, row) pairs share a mask only if both keys collide (one key
# collided for 8 of the 2^18 pairs of 32 heads x 8192 rows).
_H1, _H2, _H3, _H4 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F


def _fmix32(x):
  x = x ^ (x >> 16)
  x = x * jnp.uint32(_H2)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(_H3)
  return x ^ (x >> 16)


def _u32(x):
  return lax.bitcast_convert_type(_i32(x), jnp.uint32)


def dropout_head_key(seed, head):
  """The hash of a batch row's int32 ``seed`` and a query ``head`` that
  :func:`dropout_keep` starts every pair of that head from, as int32
  bits (:func:`dropout_keep_from_key` takes it)."""
  key = _fmix32(_u32(seed) ^ _fmix32(_u32(head) * jnp.uint32(_H1)))
  return lax.bitcast_convert_type(key, jnp.int32)


def dropout_keep(seed, head, rows, cols, rate: float):
  """Which probabilities attention dropout keeps: a bool array shaped
  like ``rows + cols`` (broadcast).  ``seed`` the batch row's int32 seed,
  ``head`` the query head (0 for a mask shared by the heads), ``rows`` /
  ``cols`` int32 query and key positions.  A pair is kept with
  probability ``1 - rate`` (to 2^-24): the hash's top 24 bits against
  ``rate * 2^24``."""
  return dropout_keep_from_key(dropout_head_key(seed, head), rows, cols,
                               rate)


def dropout_keep_from_key(head_key, rows, cols, rate: float):
  """:func:`dropout_keep` from the head's :func:`dropout_head_key`."""
  return dropout_keep_from_keys(*dropout_row_keys(head_key, rows),
                                dropout_col_keys(cols), rate)


def dropout_row_keys(head_key, rows):
  """The two uint32 keys of query rows ``rows`` (int32) that
  :func:`dropout_keep_from_keys` combines with each key's: computed once
  per row (the Hopper kernel hashes them on a row vector)."""
  row_key = _fmix32(_u32(head_key) ^ (_u32(rows) * jnp.uint32(_H2)))
  return row_key, _fmix32(row_key ^ (_u32(rows) * jnp.uint32(_H4)))


def dropout_col_keys(cols):
  """The uint32 key of key positions ``cols`` (int32): computed once per
  column (the Hopper kernel hashes them on a column vector)."""
  return _fmix32((_u32(cols) * jnp.uint32(_H3)) ^ jnp.uint32(_H4))


def dropout_keep_from_keys(row_key, row_key2, col_key, rate: float):
  """The keep mask from :func:`dropout_row_keys` and
  :func:`dropout_col_keys` (broadcast against each other): one mix per
  pair."""
  bits = _fmix32(row_key ^ col_key) ^ row_key2
  top = lax.bitcast_convert_type(bits >> 8, jnp.int32)
  return top >= int(round(rate * (1 << 24)))


def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _select(cond, a, b):
  """``where`` on int32 scalars that never folds into a bool->int convert.

  ``jnp.where(c, 1, 0)`` becomes ``c.astype(int32)``, which the Pallas
  Triton lowering of jax 0.11.2 turns into an i1 loop bound; selecting
  between two int32 arrays lowers cleanly.
  """
  cond = jnp.asarray(cond)
  return lax.select(cond, jnp.broadcast_to(_i32(a), cond.shape),
                    jnp.broadcast_to(_i32(b), cond.shape))


def _floordiv(a, b: int):
  """Floor division of a non-negative int32 by a static positive int."""
  return lax.div(_i32(a), _i32(b))


def _cdiv(a, b: int):
  """Ceiling division of a non-negative int32 by a static positive int."""
  return lax.div(_i32(a) + (b - 1), _i32(b))


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of a mask; hashable, so it can be a static argument.

  Attributes:
    q_len: query positions (array length).
    kv_len: key positions (array length).
    causal: keys after the aligned position are masked.
    offset: query ``i`` is aligned with key ``i + offset``; ``None`` means
      bottom-right, ``kv_len - q_len``.
    window_left, window_right: local window around the aligned position
      (``None``: unbounded on that side).
  """

  q_len: int
  kv_len: int
  causal: bool = False
  offset: int | None = None
  window_left: int | None = None
  window_right: int | None = None

  def __post_init__(self):
    if self.q_len < 1 or self.kv_len < 1:
      raise ValueError(
          f"sequence lengths must be >= 1, got q_len={self.q_len},"
          f" kv_len={self.kv_len}")
    for name in ("window_left", "window_right"):
      val = getattr(self, name)
      if val is not None and val < 0:
        raise ValueError(f"{name}={val} must be >= 0")
    if self.offset is None:
      object.__setattr__(self, "offset", self.kv_len - self.q_len)

  @property
  def right(self) -> int | None:
    """Effective right reach: ``causal`` is a right window of 0."""
    if self.causal:
      return 0 if self.window_right is None else min(0, self.window_right)
    return self.window_right

  # -- elementwise ----------------------------------------------------------
  def visible(self, q_idx, k_idx, *, q_valid=None, kv_valid=None,
              q_seg=None, k_seg=None):
    """Boolean visibility for broadcastable index (and segment) arrays.

    ``q_valid``/``kv_valid`` (default: the static lengths) bound the valid
    positions, so kernels can also pad sequences to whole tiles.
    """
    q_valid = self.q_len if q_valid is None else q_valid
    kv_valid = self.kv_len if kv_valid is None else kv_valid
    ok = (q_idx < q_valid) & (k_idx < kv_valid)
    aligned = q_idx + self.offset
    if self.right is not None:
      ok = ok & (k_idx <= aligned + self.right)
    if self.window_left is not None:
      ok = ok & (k_idx >= aligned - self.window_left)
    if q_seg is not None:
      ok = ok & (q_seg == k_seg) & (q_seg >= 0)
    return ok

  def dense(self, *, q_valid=None, kv_valid=None, q_seg=None, k_seg=None):
    """The boolean mask: ``[q_len, kv_len]``, or ``[B, q_len, kv_len]``
    when per-row lengths ``[B]`` or segment ids ``[B, len]`` are given
    (reference and tests only)."""
    q_idx = jnp.arange(self.q_len)[:, None]
    k_idx = jnp.arange(self.kv_len)[None, :]
    if q_valid is not None:
      q_valid = q_valid[:, None, None]
    if kv_valid is not None:
      kv_valid = kv_valid[:, None, None]
    if q_seg is not None:
      q_seg, k_seg = q_seg[:, :, None], k_seg[:, None, :]
    return self.visible(q_idx, k_idx, q_valid=q_valid, kv_valid=kv_valid,
                        q_seg=q_seg, k_seg=k_seg)

  # -- tiles ----------------------------------------------------------------
  def kv_block_range(self, q_start, block_q: int, block_k: int, *,
                     q_valid=None, kv_valid=None):
    """Key tiles for the query tile ``[q_start, q_start + block_q)``.

    Returns int32 ``(lo, full_lo, full_hi, hi)`` with
    ``lo <= full_lo <= full_hi <= hi``: the tile loop visits key tiles
    ``[lo, hi)``; those in ``[full_lo, full_hi)`` are visible to every
    (query, key) pair of the tile and need no per-element mask.  Tiles
    outside ``[lo, hi)`` hold no visible pair and are skipped (for causal:
    above the diagonal; for a window: outside the band).
    """
    q_valid = _i32(self.q_len if q_valid is None else q_valid)
    kv_valid = _i32(self.kv_len if kv_valid is None else kv_valid)
    off, left, right = self.offset, self.window_left, self.right
    first_q = _i32(q_start)
    last_row = first_q + block_q - 1          # last row of the tile
    last_q = jnp.minimum(last_row, q_valid - 1)  # last valid row
    # Live keys: [first_q + off - left, last_q + off + right] ∩ [0, kv_valid)
    key_hi = kv_valid
    if right is not None:
      key_hi = jnp.minimum(key_hi, last_q + off + right + 1)
    hi = _cdiv(jnp.maximum(key_hi, 0), block_k)
    if left is not None:
      lo = _floordiv(jnp.maximum(first_q + off - left, 0), block_k)
    else:
      lo = jnp.zeros_like(hi)
    lo = jnp.minimum(lo, hi)
    hi = _select(last_q < first_q, lo, hi)
    # Fully visible tiles: every row of the tile valid and every key of the
    # tile inside [last_row + off - left, first_q + off + right] and valid.
    full_hi = _floordiv(jnp.maximum(kv_valid, 0), block_k)
    if right is not None:
      full_hi = jnp.minimum(full_hi, _floordiv(
          jnp.maximum(first_q + off + right + 1, 0), block_k))
    if left is not None:
      full_lo = _cdiv(jnp.maximum(last_row + off - left, 0), block_k)
    else:
      full_lo = lo
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    none_full = last_row >= q_valid  # a partly invalid query tile
    full_lo = _select(none_full, hi, full_lo)
    full_hi = _select(none_full, hi, full_hi)
    return lo, full_lo, full_hi, hi

  def q_block_range(self, k_start, block_k: int, block_q: int, *,
                    q_valid=None, kv_valid=None):
    """Query tiles for the key tile ``[k_start, k_start + block_k)``.

    Same contract as :meth:`kv_block_range`, transposed: used by the dK/dV
    backward kernel, which holds a key tile and streams query tiles.
    """
    q_valid = _i32(self.q_len if q_valid is None else q_valid)
    kv_valid = _i32(self.kv_len if kv_valid is None else kv_valid)
    off, left, right = self.offset, self.window_left, self.right
    first_k = _i32(k_start)
    last_col = first_k + block_k - 1
    last_k = jnp.minimum(last_col, kv_valid - 1)
    # Row i sees key j iff j - off - right <= i <= j - off + left.
    row_lo = jnp.zeros_like(first_k)
    if right is not None:
      row_lo = jnp.maximum(row_lo, first_k - off - right)
    row_hi = q_valid  # exclusive
    if left is not None:
      row_hi = jnp.minimum(row_hi, last_k - off + left + 1)
    lo = _floordiv(jnp.minimum(row_lo, q_valid), block_q)
    hi = _cdiv(jnp.maximum(row_hi, 0), block_q)
    lo = jnp.minimum(lo, hi)
    hi = _select(last_k < first_k, lo, hi)
    # Fully visible: rows in [last_col - off - right, first_k - off + left],
    # all rows valid, all keys valid.
    if right is not None:
      full_lo = _cdiv(jnp.maximum(last_col - off - right, 0), block_q)
    else:
      full_lo = lo
    full_hi = _floordiv(jnp.maximum(q_valid, 0), block_q)
    if left is not None:
      full_hi = jnp.minimum(full_hi, _floordiv(
          jnp.maximum(first_k - off + left + 1, 0), block_q))
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    none_full = last_col >= kv_valid
    full_lo = _select(none_full, hi, full_lo)
    full_hi = _select(none_full, hi, full_hi)
    return lo, full_lo, full_hi, hi


# -- segment-id tile summaries (XLA, on the device) ---------------------------
#
# For each tile of a segment-id row: the smallest and largest non-negative
# id (_BIG / -1 when the tile holds only padding), and the tile's single id
# when all its tokens share one non-negative id (-2 otherwise).  Two tiles
# can hold a visible pair only if their [min, max] ranges overlap; a tile
# pair is segment-full when both are uniform with the same id.

SUMMARY_MIN, SUMMARY_MAX, SUMMARY_UNIFORM = 0, 1, 2


def tile_summary(seg_BxL: jax.Array, block: int) -> jax.Array:
  """``[B, 3, L // block]`` int32 summaries of a padded segment-id array."""
  b, length = seg_BxL.shape
  tiles = seg_BxL.reshape(b, length // block, block)
  valid = tiles >= 0
  lo = jnp.min(jnp.where(valid, tiles, _BIG), axis=-1)
  hi = jnp.max(jnp.where(valid, tiles, -1), axis=-1)
  uniform = jnp.where((lo == hi) & jnp.all(valid, axis=-1), lo, -2)
  return jnp.stack([lo, hi, uniform], axis=1).astype(jnp.int32)


def overlap_range(rows: jax.Array, cols: jax.Array) -> jax.Array:
  """``[B, 2, n_rows]``: per row tile, the first and one-past-last column
  tile whose id range overlaps (an empty range ``[0, 0)`` if none).

  Tiles in between may still hold no common id (non-contiguous segments);
  kernels check each visited tile again with the summaries.
  """
  r_lo = rows[:, SUMMARY_MIN, :, None]
  r_hi = rows[:, SUMMARY_MAX, :, None]
  c_lo = cols[:, SUMMARY_MIN, None, :]
  c_hi = cols[:, SUMMARY_MAX, None, :]
  overlap = (c_lo <= r_hi) & (c_hi >= r_lo)  # [B, n_rows, n_cols]
  n = cols.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  first = jnp.min(jnp.where(overlap, idx, n), axis=-1)
  last = jnp.max(jnp.where(overlap, idx, -1), axis=-1)
  any_ = last >= 0
  return jnp.stack([jnp.where(any_, first, 0), jnp.where(any_, last + 1, 0)],
                   axis=1).astype(jnp.int32)


# -- dense-mask tile summaries ---------------------------------------------
#
# A dense boolean mask [b, h, t, s] (t = 1: one row for every query) is
# summarised per (query tile, key tile) once per kernel tiling, so the tile
# loop skips a tile with no visible pair (no loads) and drops the
# per-element mask where every pair is visible (FlashMask's three tile
# classes, arXiv 2410.01359).

DENSE_HIDDEN, DENSE_PARTIAL, DENSE_FULL = 0, 1, 3


def dense_tile_summary(mask_i8: jax.Array, block_q: int, block_k: int, *,
                       transpose: bool = False) -> jax.Array:
  """``[b, h, t // block_q, s // block_k]`` int32 (``t = 1``: one row of
  tiles) of DENSE_HIDDEN / DENSE_PARTIAL / DENSE_FULL for a padded int8
  mask ``[b, h, t, s]``; ``transpose`` swaps the last two axes (key tiles
  first, for the dK/dV kernel)."""
  b, h, t, s = mask_i8.shape
  bq = block_q if t > 1 else 1
  tiles = (mask_i8 != 0).reshape(b, h, t // bq, bq, s // block_k, block_k)
  any_ = jnp.any(tiles, axis=(3, 5))
  all_ = jnp.all(tiles, axis=(3, 5))
  out = jnp.where(all_, DENSE_FULL, jnp.where(any_, DENSE_PARTIAL,
                                              DENSE_HIDDEN)).astype(jnp.int32)
  return jnp.swapaxes(out, 2, 3) if transpose else out


def tiles_overlap(row_summary, col_summary):
  """Traced scalars: can the two tiles hold a common segment id?"""
  return ((col_summary[SUMMARY_MIN] <= row_summary[SUMMARY_MAX])
          & (col_summary[SUMMARY_MAX] >= row_summary[SUMMARY_MIN]))


def tiles_segment_full(row_summary, col_summary):
  """Traced scalars: do all tokens of both tiles share one valid id?"""
  u = row_summary[SUMMARY_UNIFORM]
  return (u >= 0) & (u == col_summary[SUMMARY_UNIFORM])
