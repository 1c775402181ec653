"""FlashMask: a column-wise sparse description of an attention mask.

The mask representation of FlashMask (Wang et al., "FlashMask: Efficient
and Rich Mask Extension of FlashAttention", arXiv 2410.01359): instead of
an N x N array, each key column ``j`` carries at most two half-open ranges
of query rows from which it is HIDDEN,

* the lower range ``[lt_start[j], lt_end[j])`` (below the diagonal in the
  usual causal picture; ``lt_end=None`` means ``q_len``, to the end), and
* the upper range ``[ut_start[j], ut_end[j])`` (above it; both ``None``:
  no upper range).

Query row ``i`` sees key ``j`` iff ``i`` lies in neither range.  Each field
is an int32 array ``[batch|1, heads|1, kv_len]`` (a size-1 axis is shared
by every batch row / head), so the description costs O(N) memory and the
kernels read it in O(N) per (batch, head).

Rows are query positions ``0 .. q_len-1`` counted from the top-left, as in
``jax.nn.dot_product_attention``; note that :class:`jaxflash.masks.MaskSpec`
aligns ``causal`` bottom-right instead, which is the same only when
``q_len == kv_len``.  As in the paper, a causal mask is the lower range
with a flag, ``is_causal=True``: column ``j`` is then also hidden from
rows ``[0, j)`` (the causal triangle, top-left), which the kernels apply
as their own causal mask, from the row and column indices, where the
call's causal alignment agrees (``q_len == kv_len``, or
``dot_product_attention``'s top-left ``is_causal``), and as that upper
range otherwise (:meth:`FlashMask.explicit`).  The pattern constructors
return this form where the mask is causal.  A kernel ANDs a FlashMask
with its other terms (causal, window, segment ids, sequence lengths): a
pair is visible only when every term says so.

Values are not checked (they may be traced): a range with ``start >=
end`` is empty, and rows outside ``[0, q_len)`` do not exist, so any int32
is meaningful.  Picture (``x`` = visible), causal documents of lengths 3,
2, 1 (:meth:`FlashMask.causal_document`)::

          keys 0 1 2 3 4 5
    query 0    x . . . . .
    query 1    x x . . . .
    query 2    x x x . . .
    query 3    . . . x . .
    query 4    . . . x x .
    query 5    . . . . . x
    lt_start = 3 3 3 5 5 6     lt_end = None (6)     is_causal = True

Kernels skip tiles with the per-key-tile extremes of :meth:`FlashMask.
tile_bounds` and the rule of :func:`tile_class` (hidden / partial /
visible), the block skipping of FlashMask's forward and backward.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BIG = 2**30  # an int32 past any row: lt_end of padding and of "to the end"

TILE_HIDDEN = 0
""":func:`tile_class`: no pair of the tile is visible (skip the tile)."""
TILE_PARTIAL = 1
""":func:`tile_class`: some pairs may be hidden (mask per element)."""
TILE_VISIBLE = 2
""":func:`tile_class`: every pair of the tile is visible (no mask)."""

_FIELDS = ("lt_start", "lt_end", "ut_start", "ut_end")


def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _check_static_int(name: str, value, lowest: int):
  """ValueError for a Python int below ``lowest``; traced values pass."""
  if isinstance(value, (int, np.integer)) and value < lowest:
    raise ValueError(f"{name}={value} must be >= {lowest}")


def _next_true(flags_BxS: jax.Array) -> jax.Array:
  """``[B, S]`` int32: for each position ``j`` the first ``k > j`` with
  ``flags[:, k]``, or ``S`` when there is none (a reverse cumulative
  minimum, so it works on traced flags)."""
  b, s = flags_BxS.shape
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  at = jnp.where(flags_BxS, pos, jnp.int32(s))
  after = jnp.concatenate([at[:, 1:], jnp.full((b, 1), s, jnp.int32)], axis=1)
  return lax.cummin(after, axis=1, reverse=True)


def _run_end(ids_BxS: jax.Array) -> jax.Array:
  """``[B, S]``: one past the last position of ``j``'s run, a maximal run
  of equal ids (a document when documents are packed contiguously)."""
  ids = _i32(ids_BxS)
  starts = jnp.concatenate(
      [jnp.zeros_like(ids[:, :1], dtype=bool), ids[:, 1:] != ids[:, :-1]],
      axis=1)
  return _next_true(starts)


def _ids_2d(name: str, ids) -> jax.Array:
  ids = jnp.asarray(ids)
  if ids.ndim != 2:
    raise ValueError(f"{name} must be [batch, seq], got shape {ids.shape}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be integers, got dtype {ids.dtype}")
  return _i32(ids)


class TileBounds(NamedTuple):
  """Per key tile, the extremes of each field over the tile's columns:
  int32 ``[B|1, H|1, n_tiles]`` each (see :meth:`FlashMask.tile_bounds`)."""

  lt_start_min: jax.Array
  lt_start_max: jax.Array
  lt_end_min: jax.Array
  lt_end_max: jax.Array
  ut_start_min: jax.Array
  ut_start_max: jax.Array
  ut_end_min: jax.Array
  ut_end_max: jax.Array


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class FlashMask:
  """Column-wise hidden row ranges; see the module docstring.

  A pytree whose leaves are the (non-None) arrays, so it passes through
  ``jit``, ``vmap`` and ``shard_map`` like any array argument.  ``eq=False``:
  arrays have no truth value, so identity is the only equality.

  Attributes:
    lt_start: int ``[B|1, H|1, kv_len]``: first hidden row of the lower
      range of each key column.
    lt_end: one past its last hidden row; ``None`` means ``q_len``.
    ut_start, ut_end: the upper range, likewise; both ``None`` for none.
    is_causal: a static bool: column ``j`` is also hidden from rows
      ``[0, j)`` (causal, top-left; FlashMask's causal mode).  It takes
      no upper range; a call applies it as its own causal mask where
      its causal alignment agrees (:meth:`split_causal`), else as that
      upper range.  Static: a ``vmap`` ``in_axes`` prefix for such a mask
      is ``FlashMask(0, is_causal=True)``.
  """

  lt_start: jax.Array
  lt_end: jax.Array | None = None
  ut_start: jax.Array | None = None
  ut_end: jax.Array | None = None
  is_causal: bool = False

  def __post_init__(self):
    if self.lt_start is None:
      raise ValueError("lt_start is required (lt_start=None)")
    if (self.ut_start is None) != (self.ut_end is None):
      raise ValueError(
          "ut_start and ut_end come together (both or neither), got"
          f" ut_start is None={self.ut_start is None},"
          f" ut_end is None={self.ut_end is None}")
    if not isinstance(self.is_causal, (bool, np.bool_)):
      raise ValueError(f"is_causal must be a Python bool, got"
                       f" {self.is_causal!r}")
    if self.is_causal and self.ut_start is not None:
      raise ValueError(
          "is_causal=True takes no upper range (its upper range is the"
          " causal triangle [0, j)); give ut_start/ut_end or is_causal")

  # -- pytree: rebuilt without __post_init__, so transformations may put
  # -- any placeholder (object(), None from a tree_map) in the leaves;
  # -- is_causal is static (aux data).
  def tree_flatten(self):
    return tuple(getattr(self, f) for f in _FIELDS), bool(self.is_causal)

  @classmethod
  def tree_unflatten(cls, aux, children):
    obj = object.__new__(cls)
    for name, value in zip(_FIELDS, children, strict=True):
      object.__setattr__(obj, name, value)
    object.__setattr__(obj, "is_causal", aux)
    return obj

  def explicit(self) -> FlashMask:
    """The same mask without ``is_causal``: its causal triangle as the
    upper range ``[0, j)`` (the form every call can read, whatever its
    own causal alignment)."""
    if not self.is_causal:
      return self
    j = jnp.arange(np.shape(self.lt_start)[-1], dtype=jnp.int32)
    j = j[None, None, :]
    return FlashMask(self.lt_start, self.lt_end, jnp.zeros_like(j), j)

  def split_causal(self, top_left: bool) -> tuple[FlashMask, bool]:
    """``(mask, causal)`` for a call whose causal mask would be aligned
    top-left (``top_left``): ``is_causal`` becomes the call's causal mask
    (``(mask without it, True)``), which the kernels compute from the
    indices and tile by tile; otherwise :meth:`explicit` and False."""
    if not self.is_causal:
      return self, False
    if top_left:
      return FlashMask(self.lt_start, self.lt_end), True
    return self.explicit(), False

  # -- validation -----------------------------------------------------------
  def check(self, batch: int, heads: int, q_len: int,
            kv_len: int) -> FlashMask:
    """Validate the shapes against an attention call; return the mask with
    int32 arrays (``None`` fields stay ``None``).

    Each field must be ``[b, h, kv_len]`` with ``b`` in ``{1, batch}``,
    ``h`` in ``{1, heads}`` (query heads) and an integer dtype; otherwise
    ValueError naming the field.  Values are not checked (they may be
    traced).
    """
    for name, val in (("batch", batch), ("heads", heads), ("q_len", q_len),
                      ("kv_len", kv_len)):
      if val < 1:
        raise ValueError(f"{name}={val} must be >= 1")
    out = {}
    for name in _FIELDS:
      x = getattr(self, name)
      if x is None:
        out[name] = None
        continue
      if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
      if x.ndim != 3:
        raise ValueError(
            f"FlashMask.{name} must be [batch|1, heads|1, kv_len] (rank 3),"
            f" got shape {tuple(x.shape)}")
      if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            f"FlashMask.{name} must have an integer dtype, got {x.dtype}")
      b, h, s = x.shape
      if b not in (1, batch):
        raise ValueError(
            f"FlashMask.{name} batch axis {b} must be 1 or {batch=}"
            f" (shape {tuple(x.shape)})")
      if h not in (1, heads):
        raise ValueError(
            f"FlashMask.{name} heads axis {h} must be 1 or {heads=}"
            f" (shape {tuple(x.shape)})")
      if s != kv_len:
        raise ValueError(
            f"FlashMask.{name} last axis {s} must equal {kv_len=}"
            f" (shape {tuple(x.shape)})")
      out[name] = _i32(x)
    return FlashMask(**out, is_causal=self.is_causal)

  # -- elementwise ----------------------------------------------------------
  def dense(self, q_len: int) -> jax.Array:
    """Bool ``[B|1, H|1, q_len, kv_len]``, True where VISIBLE (reference
    and tests only: this is the N x N array the description avoids)."""
    if self.is_causal:
      return self.explicit().dense(q_len)
    rows = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    col = lambda x: _i32(x)[..., None, :]
    lt_end = q_len if self.lt_end is None else col(self.lt_end)
    hidden = (col(self.lt_start) <= rows) & (rows < lt_end)
    if self.ut_start is not None:
      hidden = hidden | ((col(self.ut_start) <= rows)
                         & (rows < col(self.ut_end)))
    return ~hidden

  # -- tiles ----------------------------------------------------------------
  def tile_bounds(self, block_k: int) -> TileBounds:
    """Per key tile of ``block_k`` columns, the min and max of each field
    over the tile's columns (:class:`TileBounds`, ``[B|1, H|1,
    cdiv(kv_len, block_k)]`` each), the eight vectors FlashMask keeps.

    ``kv_len`` is padded to whole tiles with columns hidden from every
    row, through both ranges (``lt = ut = [0, BIG)``), so padding never
    makes a tile look visible nor spoils a "fully hidden" proof.  An
    absent ``lt_end`` becomes BIG (no row reaches it: same as ``q_len``);
    an absent upper range becomes the empty ``[0, 0)``.
    """
    if block_k < 1:
      raise ValueError(f"{block_k=} must be >= 1")
    if self.is_causal:
      return self.explicit().tile_bounds(block_k)
    kv_len = self.lt_start.shape[-1]
    pad = -kv_len % block_k
    n_tiles = (kv_len + pad) // block_k

    def tiles(x, fill, pad_value):
      x = jnp.full((1, 1, kv_len), fill, jnp.int32) if x is None else _i32(x)
      x = jnp.pad(x, ((0, 0), (0, 0), (0, pad)), constant_values=pad_value)
      x = x.reshape(*x.shape[:2], n_tiles, block_k)
      return x.min(axis=-1), x.max(axis=-1)

    lt_start = tiles(self.lt_start, 0, 0)
    lt_end = tiles(self.lt_end, BIG, BIG)
    ut_start = tiles(self.ut_start, 0, 0)
    ut_end = tiles(self.ut_end, 0, BIG)
    return TileBounds(*lt_start, *lt_end, *ut_start, *ut_end)

  # -- the patterns ---------------------------------------------------------
  @classmethod
  def causal(cls, q_len: int, kv_len: int) -> FlashMask:
    """Causal, top-left: row ``i`` sees keys ``j <= i``.  Column ``j`` is
    hidden from rows ``[0, j)`` (``is_causal``); the lower range is
    empty (``lt_start = q_len``).  ``[1, 1, kv_len]``::

              keys 0 1 2 3
        query 0    x . . .
        query 1    x x . .
        query 2    x x x .
        query 3    x x x x
        lt_start = 4 4 4 4     is_causal = True
    """
    _check_static_int("q_len", q_len, 1)
    _check_static_int("kv_len", kv_len, 1)
    return cls(lt_start=jnp.full((1, 1, kv_len), q_len, jnp.int32),
               is_causal=True)

  @classmethod
  def causal_document(cls, segment_ids) -> FlashMask:
    """Causal attention within each document of a packed row.

    ``segment_ids`` int ``[batch, seq]``; a document is a maximal run of
    equal ids (documents packed contiguously; two adjacent documents need
    different ids, and an id that recurs later starts a new document).
    Column ``j`` is hidden from rows ``[0, j)`` (``is_causal``) and from
    rows ``[doc_end(j), seq)`` (later documents).  ``[batch, 1, seq]``;
    ids ``0 0 0 1 1 2``::

              keys 0 1 2 3 4 5
        query 0    x . . . . .
        query 1    x x . . . .
        query 2    x x x . . .
        query 3    . . . x . .
        query 4    . . . x x .
        query 5    . . . . . x
        lt_start = 3 3 3 5 5 6     lt_end = None (6)     is_causal = True

    Padding is better left to ``kv_seq_lengths``: a run of padding ids is
    just one more document here.
    """
    ids = _ids_2d("segment_ids", segment_ids)
    return cls(lt_start=_run_end(ids)[:, None, :], is_causal=True)

  @classmethod
  def document(cls, segment_ids) -> FlashMask:
    """Bidirectional attention within each document of a packed row (the
    block-diagonal, "blockwise" mask of FlashMask).  ``segment_ids`` as
    for :meth:`causal_document`.  Column ``j`` is hidden from rows
    ``[0, doc_start(j))`` and ``[doc_end(j), seq)``.  ``[batch, 1, seq]``;
    ids ``0 0 0 1 1 2``::

              keys 0 1 2 3 4 5
        query 0    x x x . . .
        query 1    x x x . . .
        query 2    x x x . . .
        query 3    . . . x x .
        query 4    . . . x x .
        query 5    . . . . . x
        lt_start = 3 3 3 5 5 6     lt_end = None (6)
        ut_end   = 0 0 0 3 3 5     ut_start = 0
    """
    ids = _ids_2d("segment_ids", segment_ids)
    b, s = ids.shape
    j = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    first = jnp.concatenate([jnp.ones_like(ids[:, :1], bool),
                             ids[:, 1:] != ids[:, :-1]], axis=1)
    start = lax.cummax(jnp.where(first, j, 0), axis=1)
    return cls(lt_start=_run_end(ids)[:, None, :],
               ut_start=jnp.zeros((b, 1, s), jnp.int32),
               ut_end=start[:, None, :])

  @classmethod
  def prefix_lm(cls, prefix_lengths, seq: int) -> FlashMask:
    """Prefix LM: bidirectional over the first ``prefix_lengths[b]``
    tokens, causal after.  Row ``i`` sees key ``j`` iff ``j < prefix`` or
    ``j <= i``: a prefix column has no hidden row (``ut_end = 0``), a later
    column is hidden from rows ``[0, j)``; no lower range (``lt_start =
    seq``).  ``prefix_lengths`` int ``[batch]``; ``[batch, 1, seq]``;
    prefix 3 of 5::

              keys 0 1 2 3 4
        query 0    x x x . .
        query 1    x x x . .
        query 2    x x x . .
        query 3    x x x x .
        query 4    x x x x x
        ut_end   = 0 0 0 3 4     ut_start = 0, lt_start = 5
    """
    _check_static_int("seq", seq, 1)
    prefix = jnp.asarray(prefix_lengths)
    if prefix.ndim != 1:
      raise ValueError(
          f"prefix_lengths must be [batch], got shape {prefix.shape}")
    if not jnp.issubdtype(prefix.dtype, jnp.integer):
      raise ValueError(
          f"prefix_lengths must be integers, got dtype {prefix.dtype}")
    b = prefix.shape[0]
    j = jnp.arange(seq, dtype=jnp.int32)[None, None, :]
    ut_end = jnp.where(j < _i32(prefix)[:, None, None], 0, j)
    return cls(lt_start=jnp.full((b, 1, seq), seq, jnp.int32),
               ut_start=jnp.zeros((b, 1, seq), jnp.int32),
               ut_end=ut_end.astype(jnp.int32))

  @classmethod
  def sliding_window(cls, seq: int, window: int) -> FlashMask:
    """Causal sliding window: row ``i`` sees keys ``i-window+1 .. i``.
    Column ``j`` is hidden from rows ``[0, j)`` (``is_causal``) and
    ``[j + window, seq)`` (``lt_start`` clipped to ``seq``).  ``[1, 1,
    seq]``; ``window=3``::

              keys 0 1 2 3 4 5
        query 0    x . . . . .
        query 1    x x . . . .
        query 2    x x x . . .
        query 3    . x x x . .
        query 4    . . x x x .
        query 5    . . . x x x
        lt_start = 3 4 5 6 6 6     lt_end = None (6)     is_causal = True
    """
    _check_static_int("seq", seq, 1)
    _check_static_int("window", window, 1)
    j = jnp.arange(seq, dtype=jnp.int32)[None, None, :]
    return cls(lt_start=jnp.minimum(j + _i32(window), seq), is_causal=True)

  @classmethod
  def shared_question(cls, answer_ids) -> FlashMask:
    """The shared-question mask of FlashMask: a question followed by
    several answers; each answer attends causally to the question and to
    itself, never to another answer (one forward pass scores all answers
    to one prompt, as in reward-model or DPO training).

    ``answer_ids`` int ``[batch, seq]``: ``0`` marks question tokens, any
    other id an answer; an answer is a maximal run of one id, so adjacent
    answers need different ids.  Several (question, answers) groups may
    be packed in a row: each run of 0s after an answer starts a new group,
    which sees nothing of the earlier ones.  Column ``j`` is hidden from
    rows ``[0, j)`` (``is_causal``) and from rows ``[lt_start, seq)`` with
    ``lt_start`` the start of the next group for a question token, the end
    of its own answer for an answer token.  ``[batch, 1, seq]``; ids
    ``0 0 1 1 2 2``::

              keys 0 1 2 3 4 5
        query 0    x . . . . .
        query 1    x x . . . .
        query 2    x x x . . .
        query 3    x x x x . .
        query 4    x x . . x .
        query 5    x x . . x x
        lt_start = 6 6 4 4 6 6     lt_end = None (6)     is_causal = True
    """
    ids = _ids_2d("answer_ids", answer_ids)
    question = ids == 0
    # A group starts where a question run follows an answer token.
    group_start = jnp.concatenate(
        [jnp.zeros_like(question[:, :1]), question[:, 1:] & ~question[:, :-1]],
        axis=1)
    lt_start = jnp.where(question, _next_true(group_start), _run_end(ids))
    return cls(lt_start=lt_start[:, None, :], is_causal=True)

  @classmethod
  def global_and_window(cls, seq: int, num_global: int,
                        window: int) -> FlashMask:
    """Causal sliding window of width ``window`` plus ``num_global``
    leading global tokens, which every later row sees (causal, so the
    global rows themselves see only earlier global tokens, that is all
    their keys).  Column ``j`` is hidden from rows ``[0, j)``
    (``is_causal``), and, unless global, from rows ``[j + window,
    seq)``.  ``[1, 1, seq]``; ``num_global=1, window=2``::

              keys 0 1 2 3 4 5
        query 0    x . . . . .
        query 1    x x . . . .
        query 2    x x x . . .
        query 3    x . x x . .
        query 4    x . . x x .
        query 5    x . . . x x
        lt_start = 6 3 4 5 6 6     lt_end = None (6)     is_causal = True
    """
    _check_static_int("seq", seq, 1)
    _check_static_int("num_global", num_global, 0)
    _check_static_int("window", window, 1)
    j = jnp.arange(seq, dtype=jnp.int32)[None, None, :]
    lt_start = jnp.where(j < _i32(num_global), seq,
                         jnp.minimum(j + _i32(window), seq))
    return cls(lt_start=lt_start.astype(jnp.int32), is_causal=True)


def _select(cond, a, b):
  """Int32 ``where`` as a select of two int32 arrays of one shape: a
  ``where`` between constants folds into a bool-to-int convert, which
  lowers badly in Pallas Triton (see jaxflash.masks)."""
  return lax.select(cond, jnp.broadcast_to(_i32(a), cond.shape),
                    jnp.broadcast_to(_i32(b), cond.shape))


def tile_class(bounds: TileBounds, row_lo, row_hi) -> jax.Array:
  """Classify key tiles for the query rows ``[row_lo, row_hi)``.

  Returns int32 :data:`TILE_HIDDEN`, :data:`TILE_PARTIAL` or
  :data:`TILE_VISIBLE`, broadcast over ``bounds`` (``[B|1, H|1,
  n_tiles]``, or scalars of one tile) and ``row_lo`` / ``row_hi`` (scalars
  or arrays, e.g. one query tile per entry for the dK/dV loop); rows
  must be non-empty (``row_lo < row_hi``).

  A column's hidden rows are the union of ``[lt_start, lt_end)`` and
  ``[ut_start, ut_end)``.  Only the tile's extremes are known, so both
  answers are sufficient conditions, and anything unproven is PARTIAL
  (per-element masking is always correct):

  * HIDDEN when for every column the union covers ``[row_lo, row_hi)``,
    proved by one of: the lower range alone covers it (``lt_start_max <=
    row_lo`` and ``lt_end_min >= row_hi``); the upper range alone does;
    or the two ranges chain without a gap, upper then lower
    (``ut_start_max <= row_lo``, ``lt_start_max <= ut_end_min``,
    ``lt_end_min >= row_hi``), or lower then upper.
  * VISIBLE when for every column neither range meets ``[row_lo,
    row_hi)``: ``[s, e)`` misses it iff ``max(s, row_lo) >= min(e,
    row_hi)``, and ``max(s_min, row_lo) >= min(e_max, row_hi)`` implies
    that for every column of the tile (empty ranges included).

  FlashMask's block skipping (arXiv 2410.01359) uses the same eight
  extremes for the same two decisions.
  """
  b = bounds
  row_lo, row_hi = _i32(row_lo), _i32(row_hi)

  def covers(s_max, e_min):
    return (s_max <= row_lo) & (e_min >= row_hi)

  hidden = (covers(b.lt_start_max, b.lt_end_min)
            | covers(b.ut_start_max, b.ut_end_min)
            | (covers(b.ut_start_max, b.lt_end_min)
               & (b.lt_start_max <= b.ut_end_min))
            | (covers(b.lt_start_max, b.ut_end_min)
               & (b.ut_start_max <= b.lt_end_min)))

  def misses(s_min, e_max):
    return jnp.maximum(s_min, row_lo) >= jnp.minimum(e_max, row_hi)

  visible = (misses(b.lt_start_min, b.lt_end_max)
             & misses(b.ut_start_min, b.ut_end_max))
  shape = jnp.broadcast_shapes(hidden.shape, visible.shape)
  hidden = jnp.broadcast_to(hidden, shape)
  visible = jnp.broadcast_to(visible, shape)
  return _select(hidden, TILE_HIDDEN,
                 _select(visible, TILE_VISIBLE, TILE_PARTIAL))


# -- the kernels' form ---------------------------------------------------------

# The kernels' form keeps the fields a mask has, in _FIELDS' order: their
# number says which (lt_start always; lt_end where given; the upper range
# where given), so the kernels know statically what to read and compare:
# the lower range alone (FlashMask's causal documents beside causal=True)
# costs one load and one compare per partial tile instead of four.
_ROWS = {1: (0,), 2: (0, 1), 3: (0, 2, 3), 4: (0, 1, 2, 3)}
# An absent field's value (lt_end: past every row; the upper range:
# empty), and a padded key column's (hidden from every row).
_ABSENT = (0, BIG, 0, 0)
_PADDED = (0, BIG, 0, BIG)


def columns(mask: FlashMask) -> jax.Array:
  """The fields the mask has, stacked as the kernels read them: int32
  ``[B|1, H|1, n, kv_len]``, rows ``lt_start[, lt_end][, ut_start,
  ut_end]`` (:func:`present`; :func:`full_columns` gives all four).
  ``mask`` checked (:meth:`FlashMask.check`); its ``is_causal`` as the
  upper range (:meth:`FlashMask.explicit`)."""
  mask = mask.explicit()
  fields = [x for x in (mask.lt_start, mask.lt_end, mask.ut_start,
                        mask.ut_end) if x is not None]
  shape = jnp.broadcast_shapes(*(x.shape for x in fields))
  return jnp.stack([jnp.broadcast_to(_i32(x), shape) for x in fields],
                   axis=2)


def present(cols: jax.Array) -> tuple[int, ...]:
  """Which fields (indices into ``lt_start, lt_end, ut_start, ut_end``)
  the rows of :func:`columns`' output hold."""
  return _ROWS[cols.shape[-2]]


def full_columns(cols: jax.Array) -> jax.Array:
  """:func:`columns`' output with all four rows, an absent ``lt_end`` as
  BIG (past every row) and an absent upper range as the empty ``[0,
  0)``."""
  have = present(cols)
  if len(have) == 4:
    return cols
  # (Built from scalars: an array constant cannot be closed over under
  # custom_partitioning.)
  row = lambda f: (cols[:, :, have.index(f)] if f in have else
                   jnp.full((*cols.shape[:2], cols.shape[-1]), _ABSENT[f],
                            jnp.int32))
  return jnp.stack([row(f) for f in range(4)], axis=2)


def window_columns(seq: int, left: int | None,
                   right: int | None) -> jax.Array:
  """:func:`columns` of a local window over ``seq`` positions (query ``i``
  at key ``i``): key ``j`` hidden from the rows past ``j + left`` and
  those before ``j - right`` (a side None: unbounded).  ``[1, 1, n,
  seq]``: how context parallelism's ring carries a window, whose offset
  between two blocks is known only at run time."""
  j = jnp.arange(seq, dtype=jnp.int32)[None, None, :]
  lt_start = jnp.full_like(j, BIG) if left is None else j + _i32(left) + 1
  if right is None:
    return lt_start[:, :, None]
  ut_end = jnp.maximum(j - _i32(right), 0)
  return jnp.stack([lt_start, jnp.zeros_like(j), ut_end], axis=2)


def column_tile_classes(cols: jax.Array, q_pad: int, block_q: int,
                        block_k: int) -> jax.Array:
  """:func:`tile_class` of every (query tile, key tile) pair of the
  tiling ``(block_q, block_k)``: int32 ``[B|1, H|1, q_pad / block_q,
  n_k]`` from :func:`columns`' output padded to whole key tiles."""
  cols = full_columns(cols)
  n_k = cols.shape[-1] // block_k
  tiles = cols.reshape(*cols.shape[:3], n_k, block_k)
  lo, hi = tiles.min(-1)[:, :, :, None, :], tiles.max(-1)[:, :, :, None, :]
  bounds = TileBounds(lo[:, :, 0], hi[:, :, 0], lo[:, :, 1], hi[:, :, 1],
                      lo[:, :, 2], hi[:, :, 2], lo[:, :, 3], hi[:, :, 3])
  rows = jnp.arange(0, q_pad, block_q, dtype=jnp.int32)[:, None]
  return tile_class(bounds, rows, rows + block_q)


def tile_runs(live: jax.Array, full: jax.Array) -> jax.Array:
  """From per-tile flags ``[..., n]`` (``live``: some element visible;
  ``full``: every element visible) int32 ``[..., 6]``: ``(first, end)``
  of the live tiles (``[0, 0)`` where none is), ``(first, end)`` of the
  first run of full tiles (empty where none is; FlashMask's unmasked
  blocks, arXiv 2410.01359 §4.2), and ``(first, end)`` of the longest run
  of hidden tiles between two live ones (``[end, end)`` where there is
  none: a shared question's other answers, the tiles between a global
  prefix and a window).  A kernel visits the first range less the gap and
  skips the element mask on the second."""
  n = live.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  first = jnp.min(jnp.where(live, idx, n), axis=-1)
  last = jnp.max(jnp.where(live, idx + 1, 0), axis=-1)
  run = jnp.min(jnp.where(full, idx, n), axis=-1)
  run_end = jnp.min(jnp.where(~full & (idx >= run[..., None]), idx, n),
                    axis=-1)
  # A gap starts at a hidden tile after a live one and ends at the next
  # live tile (there is one: the gap lies before `last`).
  next_live = lax.cummin(jnp.where(live, idx, n), axis=live.ndim - 1,
                         reverse=True)
  after_live = jnp.concatenate(
      [jnp.zeros_like(live[..., :1]), live[..., :-1]], axis=-1)
  starts = ~live & after_live & (idx < last[..., None])
  length = jnp.where(starts, next_live - idx, 0)
  gap_lo = jnp.argmax(length, axis=-1).astype(jnp.int32)
  gap_len = jnp.max(length, axis=-1)
  gap_lo = jnp.where(gap_len > 0, gap_lo, last)
  return jnp.stack([jnp.minimum(first, last), last, run, run_end, gap_lo,
                    gap_lo + gap_len], axis=-1)


def tile_ranges(cols: jax.Array, q_pad: int, held: int, streamed: int, *,
                held_q: bool) -> jax.Array:
  """Per held tile, the streamed tiles a kernel visits and those it runs
  without the element mask: int32 ``[B|1, H|1, 6, n_held]``, rows ``(first,
  end)`` of the tiles that are not hidden (``[0, 0)`` when all are),
  ``(first, end)`` of the first run of tiles visible throughout (empty
  where none is; FlashMask's unmasked blocks, arXiv 2410.01359 §4.2) and
  ``(first, end)`` of the longest hidden run inside the first range
  (:func:`tile_runs`).
  ``held_q``: query tiles of ``held`` rows stream key tiles of
  ``streamed`` keys (forward, dQ); else key tiles of ``held`` keys stream
  query tiles of ``streamed`` rows (dK/dV).  ``cols``: :func:`columns`'
  output padded to whole key tiles."""
  if held_q:
    cls = column_tile_classes(cols, q_pad, held, streamed)
  else:
    cls = jnp.swapaxes(column_tile_classes(cols, q_pad, streamed, held),
                       2, 3)
  return jnp.moveaxis(
      tile_runs(cls != TILE_HIDDEN, cls == TILE_VISIBLE), -1, 2)


def pad_columns(cols: jax.Array, kv_pad: int) -> jax.Array:
  """:func:`columns`' output padded to ``kv_pad`` keys with columns hidden
  from every row (the ranges it has ``[0, BIG)``: ``lt_start`` 0 hides a
  column to the end where there is no ``lt_end``)."""
  n = kv_pad - cols.shape[-1]
  # (Built from scalars: an array constant cannot be closed over under
  # custom_partitioning.)
  fill = [jnp.full((*cols.shape[:2], 1, n), _PADDED[f], jnp.int32)
          for f in present(cols)]
  return jnp.concatenate([cols, jnp.concatenate(fill, axis=2)], axis=3)


def visible_from_columns(cols: jax.Array, q_len: int) -> jax.Array:
  """Bool ``[B|1, H|1, q_len, kv_len]`` of :func:`columns`' output, True
  where visible (the reference's dense form)."""
  cols = full_columns(cols)
  rows = jnp.arange(q_len, dtype=jnp.int32)[:, None]
  c = lambda r: cols[:, :, r, None, :]
  hidden = (((c(0) <= rows) & (rows < c(1)))
            | ((c(2) <= rows) & (rows < c(3))))
  return ~hidden
