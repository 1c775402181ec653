"""FlashMask (jaxflash/flashmask.py): ``dense`` against a direct numpy
construction, each pattern against its definition written as loops, the
tile classification against brute force over every (row, column), and
the validation errors."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxflash import flashmask
from jaxflash.flashmask import (
    TILE_HIDDEN,
    TILE_PARTIAL,
    TILE_VISIBLE,
    FlashMask,
    tile_class,
)


def _np(x):
  return None if x is None else np.asarray(x)


def _dense_loops(m: FlashMask, q_len: int) -> np.ndarray:
  """Visibility straight from the definition, one (row, column) at a time:
  hidden iff ``lt_start <= i < lt_end`` or ``ut_start <= i < ut_end``
  (``is_causal``: the upper range ``[0, j)``)."""
  if m.is_causal:
    j = np.arange(np.asarray(m.lt_start).shape[-1], dtype=np.int32)
    m = dataclasses.replace(m, is_causal=False, ut_start=0 * j[None, None],
                            ut_end=j[None, None])
  fields = [_np(getattr(m, f)) for f in ("lt_start", "lt_end", "ut_start",
                                         "ut_end")]
  shapes = [f.shape for f in fields if f is not None]
  b = max(s[0] for s in shapes)
  h = max(s[1] for s in shapes)
  kv_len = shapes[0][2]
  at = lambda f, bi, hi, j: f[min(bi, f.shape[0] - 1), min(hi, f.shape[1] - 1),
                              j]
  out = np.ones((b, h, q_len, kv_len), bool)
  for bi, hi, i, j in itertools.product(range(b), range(h), range(q_len),
                                        range(kv_len)):
    lts, lte, uts, ute = fields
    lo = at(lts, bi, hi, j)
    end = q_len if lte is None else at(lte, bi, hi, j)
    if lo <= i < end:
      out[bi, hi, i, j] = False
    if uts is not None and at(uts, bi, hi, j) <= i < at(ute, bi, hi, j):
      out[bi, hi, i, j] = False
  return out


def _random_mask(rng, b, h, q_len, kv_len, *, lt_end=True, ut=True,
                 fixed_shapes=False):
  """Ranges with ends in [-2, q_len + 2], empty and reversed ones too;
  each field ``[b|1, h|1, kv_len]``, at random or (``fixed_shapes``, fewer
  compilations) lt_start full, lt_end per head, the upper range per row."""
  def field(k):
    if fixed_shapes:
      shape = [(b, h), (1, h), (b, 1), (b, 1)][k] + (kv_len,)
    else:
      shape = (rng.choice([1, b]), rng.choice([1, h]), kv_len)
    return rng.integers(-2, q_len + 3, size=shape).astype(np.int32)
  return FlashMask(field(0), field(1) if lt_end else None,
                   field(2) if ut else None, field(3) if ut else None)


def _picture(rows):
  return np.array([[c == "x" for c in r.split()] for r in rows])


# -- dense --------------------------------------------------------------------

@pytest.mark.parametrize("lt_end,ut", [(True, True), (False, True),
                                       (True, False), (False, False)])
def test_dense_matches_loops(lt_end, ut):
  rng = np.random.default_rng(0)
  for b, h, q_len, kv_len in [(2, 3, 5, 7), (1, 2, 9, 4), (2, 1, 1, 6)]:
    for _ in range(3):
      m = _random_mask(rng, b, h, q_len, kv_len, lt_end=lt_end, ut=ut)
      got = np.asarray(m.dense(q_len))
      want = _dense_loops(m, q_len)
      np.testing.assert_array_equal(
          np.broadcast_to(got, want.shape), want)
      assert got.dtype == bool and got.ndim == 4


# -- the patterns: docstring pictures, then the definitions as loops ----------

def test_docstring_pictures():
  """The pictures in jaxflash/flashmask.py, and their field values."""
  cases = [
      (FlashMask.causal(4, 4), ["x . . .", "x x . .", "x x x .", "x x x x"],
       [4, 4, 4, 4]),
      (FlashMask.causal_document(np.array([[0, 0, 0, 1, 1, 2]])),
       ["x . . . . .", "x x . . . .", "x x x . . .", ". . . x . .",
        ". . . x x .", ". . . . . x"], [3, 3, 3, 5, 5, 6]),
      (FlashMask.document(np.array([[0, 0, 0, 1, 1, 2]])),
       ["x x x . . .", "x x x . . .", "x x x . . .", ". . . x x .",
        ". . . x x .", ". . . . . x"], [3, 3, 3, 5, 5, 6]),
      (FlashMask.prefix_lm(np.array([3]), 5),
       ["x x x . .", "x x x . .", "x x x . .", "x x x x .", "x x x x x"],
       [5, 5, 5, 5, 5]),
      (FlashMask.sliding_window(6, 3),
       ["x . . . . .", "x x . . . .", "x x x . . .", ". x x x . .",
        ". . x x x .", ". . . x x x"], [3, 4, 5, 6, 6, 6]),
      (FlashMask.shared_question(np.array([[0, 0, 1, 1, 2, 2]])),
       ["x . . . . .", "x x . . . .", "x x x . . .", "x x x x . .",
        "x x . . x .", "x x . . x x"], [6, 6, 4, 4, 6, 6]),
      (FlashMask.global_and_window(6, 1, 2),
       ["x . . . . .", "x x . . . .", "x x x . . .", "x . x x . .",
        "x . . x x .", "x . . . x x"], [6, 3, 4, 5, 6, 6]),
  ]
  for m, rows, lt_start in cases:
    seq = len(rows)
    np.testing.assert_array_equal(np.asarray(m.dense(seq))[0, 0],
                                  _picture(rows))
    np.testing.assert_array_equal(np.asarray(m.lt_start)[0, 0], lt_start)
    assert m.lt_end is None
    # The causal patterns are FlashMask's causal form, the others carry
    # their upper range.
    assert m.is_causal == (m.ut_start is None)
    assert np.asarray(m.explicit().ut_start).dtype == np.int32


def _check_pattern(m: FlashMask, q_len: int, want: np.ndarray):
  """``want`` ``[B, q_len, kv_len]``; ``m`` must also survive ``check``."""
  b, _, kv_len = want.shape
  m = m.check(b, 4, q_len, kv_len)
  got = np.asarray(m.dense(q_len))
  np.testing.assert_array_equal(np.broadcast_to(got[:, 0], want.shape), want)
  np.testing.assert_array_equal(np.broadcast_to(_dense_loops(m, q_len)[:, 0],
                                                want.shape), want)


@pytest.mark.parametrize("q_len,kv_len", [(13, 16), (16, 13), (13, 13), (1, 5)])
def test_causal(q_len, kv_len):
  want = np.array([[[j <= i for j in range(kv_len)] for i in range(q_len)]])
  _check_pattern(FlashMask.causal(q_len, kv_len), q_len, want)


def _runs(ids):
  """Index of each token's maximal run of equal ids."""
  out, run = [], 0
  for k, x in enumerate(ids):
    if k and x != ids[k - 1]:
      run += 1
    out.append(run)
  return out


SEGMENT_IDS = np.array([
    [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 0, 0, 7, 7, -1],  # 7 recurs: a new doc
], np.int32)


@pytest.mark.parametrize("seq", [13, 16])
@pytest.mark.parametrize("causal", [True, False],
                         ids=["causal_document", "document"])
def test_documents(seq, causal):
  ids = SEGMENT_IDS[:, :seq]
  make = FlashMask.causal_document if causal else FlashMask.document
  want = np.zeros((2, seq, seq), bool)
  for b in range(2):
    doc = _runs(list(ids[b]))
    for i, j in itertools.product(range(seq), range(seq)):
      want[b, i, j] = (j <= i or not causal) and doc[i] == doc[j]
  _check_pattern(make(ids), seq, want)
  jitted = jax.jit(make)(jnp.asarray(ids))
  np.testing.assert_array_equal(np.asarray(jitted.dense(seq))[:, 0], want)


@pytest.mark.parametrize("seq,prefix", [(13, [0, 5]), (16, [16, 3]),
                                        (13, [1, 13])])
def test_prefix_lm(seq, prefix):
  want = np.zeros((2, seq, seq), bool)
  for b, i, j in itertools.product(range(2), range(seq), range(seq)):
    want[b, i, j] = j < prefix[b] or j <= i
  prefix = np.array(prefix, np.int32)
  _check_pattern(FlashMask.prefix_lm(prefix, seq), seq, want)
  jitted = jax.jit(FlashMask.prefix_lm, static_argnums=1)(prefix, seq)
  np.testing.assert_array_equal(np.asarray(jitted.dense(seq))[:, 0], want)


@pytest.mark.parametrize("seq,window", [(13, 1), (16, 4), (13, 13), (16, 40)])
def test_sliding_window(seq, window):
  want = np.array([[[i - window < j <= i for j in range(seq)]
                    for i in range(seq)]])
  _check_pattern(FlashMask.sliding_window(seq, window), seq, want)


ANSWER_IDS = np.array([
    # question of 3, answers of 4, 2, 4 tokens, then 3 padding tokens
    [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, -1, -1, -1],
    # two packed groups: (q 2, answers 3, 2) then (q 3, answers 2, 3, 1)
    [0, 0, 1, 1, 1, 2, 2, 0, 0, 0, 5, 5, 6, 6, 6, 5],
], np.int32)


@pytest.mark.parametrize("seq", [13, 16])
def test_shared_question(seq):
  ids = ANSWER_IDS[:, :seq]
  want = np.zeros((2, seq, seq), bool)
  for b in range(2):
    row = list(ids[b])
    run = _runs(row)
    group, g = [], 0
    for k, x in enumerate(row):
      if k and x == 0 and row[k - 1] != 0:
        g += 1
      group.append(g)
    for i, j in itertools.product(range(seq), range(seq)):
      # Causal, same group, and the key is the question or i's own answer.
      want[b, i, j] = (j <= i and group[i] == group[j]
                       and (row[j] == 0 or run[i] == run[j]))
  _check_pattern(FlashMask.shared_question(ids), seq, want)
  jitted = jax.jit(FlashMask.shared_question)(jnp.asarray(ids))
  np.testing.assert_array_equal(np.asarray(jitted.dense(seq))[:, 0], want)


@pytest.mark.parametrize("seq,num_global,window",
                         [(13, 2, 3), (16, 0, 4), (16, 16, 1), (13, 4, 20)])
def test_global_and_window(seq, num_global, window):
  want = np.array([[[j <= i and (j < num_global or i - j < window)
                     for j in range(seq)] for i in range(seq)]])
  _check_pattern(FlashMask.global_and_window(seq, num_global, window), seq,
                 want)


# -- tiles --------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _dense_and_classes(m: FlashMask, q_len: int, block_q: int, block_k: int):
  """``m.dense(q_len)`` and tile_class for every (query tile, key tile),
  ``[n_q, B|1, H|1, n_k]``; one jit, as eager ops would compile one by
  one for every new shape."""
  n_q = -(-q_len // block_q)
  lo = jnp.arange(n_q, dtype=jnp.int32) * block_q
  hi = jnp.minimum(lo + block_q, q_len)
  cls = tile_class(m.tile_bounds(block_k), lo[:, None, None, None],
                   hi[:, None, None, None])
  return m.dense(q_len), cls


def _classify_all(m: FlashMask, q_len: int, block_q: int, block_k: int):
  return np.asarray(_dense_and_classes(m, q_len, block_q, block_k)[1])


def _assert_sound(m: FlashMask, q_len: int, block_q: int, block_k: int):
  """No HIDDEN tile holds a visible pair; no VISIBLE tile holds a hidden
  pair (padding columns count as hidden).  Returns the classes."""
  kv_len = m.lt_start.shape[-1]
  dense, cls = map(np.asarray, _dense_and_classes(m, q_len, block_q, block_k))
  n_q, _, _, n_k = cls.shape
  pad = np.zeros(dense.shape[:3] + (n_k * block_k - kv_len,), bool)
  dense = np.concatenate([dense, pad], axis=-1)
  b, h = np.broadcast_shapes(dense.shape[:2], cls.shape[1:3])
  dense = np.broadcast_to(dense, (b, h) + dense.shape[2:])
  cls = np.broadcast_to(cls, (n_q, b, h, n_k))
  for r, t in itertools.product(range(n_q), range(n_k)):
    tile = dense[:, :, r * block_q:(r + 1) * block_q,
                 t * block_k:(t + 1) * block_k]
    c = cls[r, :, :, t]
    any_visible = tile.any(axis=(-1, -2))
    all_visible = tile.all(axis=(-1, -2))
    assert not (any_visible & (c == TILE_HIDDEN)).any(), (r, t)
    assert not (~all_visible & (c == TILE_VISIBLE)).any(), (r, t)
  assert set(np.unique(cls)) <= {TILE_HIDDEN, TILE_PARTIAL, TILE_VISIBLE}
  return cls


def test_tile_class_sound_random():
  """Random ranges (empty, reversed, past the ends, broadcast axes) at a
  few shapes and tile sizes; the classes are also not all PARTIAL."""
  rng = np.random.default_rng(1)
  seen = set()
  for q_len, kv_len, block_q, block_k in [(13, 16, 4, 3), (16, 13, 5, 4),
                                          (7, 9, 1, 2)]:
    for case in range(30):
      m = _random_mask(rng, 2, 3, q_len, kv_len, lt_end=case % 2 == 0,
                       ut=case % 3 != 0, fixed_shapes=True)
      seen |= set(np.unique(_assert_sound(m, q_len, block_q, block_k)))
  assert seen == {TILE_HIDDEN, TILE_PARTIAL, TILE_VISIBLE}


def test_tile_class_sound_patterns():
  """The patterns, whose ranges are structured (chained, clipped,
  empty), at tile sizes that do and do not divide the lengths."""
  masks = [
      (FlashMask.causal(13, 16), 13),
      (FlashMask.causal(16, 13), 16),
      (FlashMask.causal_document(SEGMENT_IDS), 16),
      (FlashMask.document(SEGMENT_IDS), 16),
      (FlashMask.prefix_lm(np.array([5, 16], np.int32), 16), 16),
      (FlashMask.sliding_window(16, 3), 16),
      (FlashMask.shared_question(ANSWER_IDS), 16),
      (FlashMask.global_and_window(13, 2, 3), 13),
  ]
  for (m, q_len), (block_q, block_k) in itertools.product(
      masks, [(4, 4), (5, 3), (1, 2)]):
    _assert_sound(m, q_len, block_q, block_k)


@pytest.mark.parametrize("held_q", [True, False])
def test_tile_ranges_against_brute_force(held_q):
  """``tile_ranges``' live range spans exactly the tiles with a visible
  element, every tile in its run is visible throughout (the kernels
  drop the element mask there), and its gap is the longest run of hidden
  tiles inside the live range, for patterns whose runs are cut by
  partial tiles on both sides; both kernel orientations (held query
  tiles streaming key tiles, and the reverse)."""
  q_len = kv_len = 16
  masks = [FlashMask.causal_document(SEGMENT_IDS),
           FlashMask.document(SEGMENT_IDS),
           FlashMask.prefix_lm(np.array([5, 16], np.int32), 16),
           FlashMask.shared_question(ANSWER_IDS),
           FlashMask.global_and_window(16, 2, 3)]
  runs_seen = gaps_seen = 0
  for m, (held, streamed) in itertools.product(masks, [(4, 4), (8, 4),
                                                       (4, 8)]):
    dense = np.broadcast_to(_dense_loops(m, q_len), (2, 1, q_len, kv_len))
    cols = flashmask.columns(m)
    ranges = np.asarray(flashmask.tile_ranges(cols, q_len, held, streamed,
                                              held_q=held_q))
    live, full, gap = ranges[:, :, :2], ranges[:, :, 2:4], ranges[:, :, 4:]
    n_held = (q_len if held_q else kv_len) // held
    n_streamed = (kv_len if held_q else q_len) // streamed
    for b, i in itertools.product(range(2), range(n_held)):
      bb = min(b, live.shape[0] - 1)
      tiles = []
      for t in range(n_streamed):
        rows = (slice(i * held, (i + 1) * held) if held_q
                else slice(t * streamed, (t + 1) * streamed))
        cols_ = (slice(t * streamed, (t + 1) * streamed) if held_q
                 else slice(i * held, (i + 1) * held))
        tiles.append(dense[b, 0, rows, cols_])
      any_ = [t.any() for t in tiles]
      lo, hi = live[bb, 0, :, i]
      want = [t for t in range(n_streamed) if any_[t]]
      assert (lo, hi) == ((want[0], want[-1] + 1) if want else (0, 0))
      f_lo, f_hi = full[bb, 0, :, i]
      for t in range(f_lo, min(f_hi, n_streamed)):
        assert tiles[t].all(), (m, held, streamed, i, t)
      if f_lo < f_hi:
        runs_seen += 1
        assert f_lo == min(t for t in range(n_streamed) if tiles[t].all())
      g_lo, g_hi = gap[bb, 0, :, i]
      hidden_runs = [(a, c) for a in range(lo, hi) for c in range(a + 1, hi)
                     if not any(any_[a:c]) and any_[a - 1] and any_[c]]
      longest = max((c - a for a, c in hidden_runs), default=0)
      assert g_hi - g_lo == longest, (m, held, streamed, i)
      if longest:
        gaps_seen += 1
        assert (g_lo, g_hi) in hidden_runs
      else:
        assert g_lo == g_hi == hi
  # (A key tile of these patterns sees one run of query tiles.)
  assert runs_seen and (gaps_seen or not held_q)


@pytest.mark.parametrize("left,right", [(3, 0), (2, 5), (None, 4),
                                        (6, None)])
def test_window_columns_match_the_window(left, right):
  """The ring's window as FlashMask columns hides what MaskSpec's window
  hides (query i at key i)."""
  from jaxflash.masks import MaskSpec
  seq = 13
  cols = np.asarray(flashmask.full_columns(
      flashmask.window_columns(seq, left, right)))
  i = np.arange(seq)[:, None]
  lts, lte, uts, ute = (cols[0, 0, r][None, :] for r in range(4))
  visible = ~(((lts <= i) & (i < lte)) | ((uts <= i) & (i < ute)))
  want = MaskSpec(seq, seq, False, 0, left, right).dense()
  np.testing.assert_array_equal(visible, np.asarray(want))


@pytest.mark.parametrize("fields", [(0,), (0, 1), (0, 2, 3), (0, 1, 2, 3)])
def test_columns_keep_the_fields_a_mask_has(fields):
  """columns() keeps the given fields only (the kernels then read and
  compare only those), full_columns() restores the absent ones, and the
  padded columns hide every row, for each combination of fields."""
  rng = np.random.default_rng(len(fields))
  q_len, kv_len, kv_pad = 9, 11, 16
  values = [rng.integers(-2, q_len + 2, (2, 1, kv_len)).astype(np.int32)
            for _ in range(4)]
  m = FlashMask(*(values[f] if f in fields else None for f in range(4)))
  cols = flashmask.columns(m)
  assert cols.shape == (2, 1, len(fields), kv_len)
  assert flashmask.present(cols) == fields
  full = np.asarray(flashmask.full_columns(cols))
  absent = {1: flashmask.BIG, 2: 0, 3: 0}
  for f in range(4):
    want = values[f] if f in fields else np.full_like(values[0], absent[f])
    np.testing.assert_array_equal(full[:, :, f], want)
  padded = flashmask.pad_columns(cols, kv_pad)
  assert flashmask.present(padded) == fields
  visible = np.asarray(flashmask.visible_from_columns(padded, q_len))
  np.testing.assert_array_equal(visible[..., :kv_len],
                                _dense_loops(m, q_len)[:, :1])
  assert not visible[..., kv_len:].any()


def test_tile_class_exact_on_causal():
  """Where the extremes decide exactly: causal with square tiles is
  HIDDEN above the diagonal, VISIBLE below, PARTIAL on it."""
  cls = _classify_all(FlashMask.causal(16, 16), 16, 4, 4)[:, 0, 0, :]
  r, t = np.indices(cls.shape)
  want = np.where(t > r, TILE_HIDDEN,
                  np.where(t < r, TILE_VISIBLE, TILE_PARTIAL))
  np.testing.assert_array_equal(cls, want)
  # Documents aligned to the tiles: other documents' tiles are skipped.
  ids = np.repeat(np.arange(4, dtype=np.int32), 4)[None]
  cls = _classify_all(FlashMask.causal_document(ids), 16, 4, 4)[:, 0, 0, :]
  np.testing.assert_array_equal(
      cls, np.where(t == r, TILE_PARTIAL, TILE_HIDDEN))


def test_tile_class_chained_ranges():
  """A column hidden everywhere through two touching ranges (upper
  ``[0, 5)``, lower ``[5, 16)``, or the other way round) is HIDDEN, which
  neither range proves alone."""
  z = np.zeros((1, 1, 4), np.int32)
  up_then_low = FlashMask(z + 5, z + 16, z, z + 5)
  low_then_up = FlashMask(z, z + 5, z + 5, z + 16)
  for m in (up_then_low, low_then_up):
    assert (_assert_sound(m, 16, 8, 4) == TILE_HIDDEN).all()
    # A gap between the ranges (row 5 visible) must not be hidden.
    gap = FlashMask(m.lt_start + (m.lt_start > 0), m.lt_end,
                    m.ut_start + (m.ut_start > 0), m.ut_end)
    cls = _assert_sound(gap, 16, 8, 4)
    assert (cls[0] == TILE_PARTIAL).all()


def test_tile_bounds_padding_and_defaults():
  m = FlashMask.causal(8, 6)
  bounds = m.tile_bounds(4)
  assert all(x.shape == (1, 1, 2) for x in bounds)
  big = flashmask.BIG
  np.testing.assert_array_equal(bounds.lt_start_min[0, 0], [8, 0])
  np.testing.assert_array_equal(bounds.lt_end_min[0, 0], [big, big])
  np.testing.assert_array_equal(bounds.ut_end_max[0, 0], [3, big])
  np.testing.assert_array_equal(bounds.ut_end_min[0, 0], [0, 4])
  # No upper range: the empty [0, 0) on real columns.
  b = FlashMask(np.full((2, 1, 5), 3, np.int32)).tile_bounds(5)
  assert b.ut_start_max.shape == (1, 1, 1) and int(b.ut_end_max[0, 0, 0]) == 0
  assert int(tile_class(b, 0, 3)[1, 0, 0]) == TILE_VISIBLE
  assert int(tile_class(b, 3, 8)[0, 0, 0]) == TILE_HIDDEN


def test_tile_class_traces():
  """tile_class on traced bounds and rows (the kernels call it so)."""
  m = FlashMask.sliding_window(16, 4)
  f = jax.jit(lambda m, lo: tile_class(m.tile_bounds(4), lo, lo + 4))
  np.testing.assert_array_equal(
      np.asarray(f(m, jnp.int32(8)))[0, 0],
      [TILE_HIDDEN, TILE_PARTIAL, TILE_PARTIAL, TILE_HIDDEN])


# -- pytree and check ---------------------------------------------------------

def test_pytree():
  m = FlashMask.causal_document(SEGMENT_IDS)
  leaves, treedef = jax.tree.flatten(m)
  assert len(leaves) == 1  # lt_end and the upper range None: no leaves
  back = jax.tree.unflatten(treedef, leaves)
  assert back.lt_end is None and back.is_causal is True  # static
  assert jax.tree.structure(FlashMask(m.lt_start)) != treedef
  # Rebuilt without validation: a tree_map may put anything in the leaves.
  jax.tree.map(lambda x: None, m)
  out = jax.jit(lambda m: m.dense(16))(m)
  np.testing.assert_array_equal(out, m.dense(16))
  per_row = jax.vmap(lambda m: m.dense(16))(
      jax.tree.map(lambda x: x[:, None], m))
  np.testing.assert_array_equal(per_row[:, 0], m.dense(16))


def test_check_normalizes():
  m = FlashMask(np.zeros((1, 3, 5), np.int64), None,
                [[[0] * 5]] * 2, np.ones((2, 1, 5), np.int16))
  out = m.check(2, 3, 7, 5)
  assert out.lt_end is None
  for x in (out.lt_start, out.ut_start, out.ut_end):
    assert x.dtype == jnp.int32
  assert out.ut_start.shape == (2, 1, 5)
  # Shapes only: a traced mask checks under jit.
  jax.jit(lambda m: m.check(2, 3, 7, 5).dense(7))(m.check(2, 3, 7, 5))


@pytest.mark.parametrize("make,match", [
    (lambda: FlashMask(np.zeros((2, 5), np.int32)),
     r"FlashMask.lt_start must be \[batch\|1, heads\|1, kv_len\] \(rank 3\),"
     r" got shape \(2, 5\)"),
    (lambda: FlashMask(np.zeros((1, 1, 5), np.int32),
                       np.zeros((1, 1, 5), np.float32)),
     r"FlashMask.lt_end must have an integer dtype, got float32"),
    (lambda: FlashMask(np.zeros((1, 1, 5), bool)),
     r"FlashMask.lt_start must have an integer dtype, got bool"),
    (lambda: FlashMask(np.zeros((3, 1, 5), np.int32)),
     r"FlashMask.lt_start batch axis 3 must be 1 or batch=2"),
    (lambda: FlashMask(np.zeros((1, 1, 5), np.int32),
                       ut_start=np.zeros((1, 2, 5), np.int32),
                       ut_end=np.zeros((1, 1, 5), np.int32)),
     r"FlashMask.ut_start heads axis 2 must be 1 or heads=4"),
    (lambda: FlashMask(np.zeros((1, 1, 6), np.int32)),
     r"FlashMask.lt_start last axis 6 must equal kv_len=5"),
])
def test_check_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make().check(2, 4, 7, 5)


def test_construction_errors():
  z = np.zeros((1, 1, 5), np.int32)
  with pytest.raises(ValueError, match=r"ut_start and ut_end come together"
                     r".*ut_start is None=False, ut_end is None=True"):
    FlashMask(z, ut_start=z)
  with pytest.raises(ValueError, match=r"ut_start is None=True"):
    FlashMask(z, ut_end=z)
  with pytest.raises(ValueError, match=r"lt_start is required"):
    FlashMask(None)
  with pytest.raises(ValueError, match=r"q_len=0 must be >= 1"):
    FlashMask(z).check(1, 1, 0, 5)
  with pytest.raises(ValueError, match=r"window=0 must be >= 1"):
    FlashMask.sliding_window(8, 0)
  with pytest.raises(ValueError, match=r"num_global=-1 must be >= 0"):
    FlashMask.global_and_window(8, -1, 2)
  with pytest.raises(ValueError, match=r"segment_ids must be \[batch, seq\],"
                     r" got shape \(8,\)"):
    FlashMask.causal_document(np.zeros(8, np.int32))
  with pytest.raises(ValueError, match=r"answer_ids must be integers"):
    FlashMask.shared_question(np.zeros((1, 8), np.float32))
  with pytest.raises(ValueError, match=r"prefix_lengths must be integers"):
    FlashMask.prefix_lm(np.array([1.5]), 8)
  with pytest.raises(ValueError, match=r"block_k=0 must be >= 1"):
    FlashMask(z).tile_bounds(0)


def test_split_causal_and_explicit():
  """is_causal: as the call's causal mask where that is aligned top-left
  (the lower range alone, its one field), else as the upper range [0, j);
  both are the same mask as the flag."""
  seq = 16
  m = FlashMask.causal_document(SEGMENT_IDS)
  lower, causal = m.split_causal(True)
  assert causal is True and not lower.is_causal and lower.ut_start is None
  assert flashmask.present(flashmask.columns(lower)) == (0,)
  tril = np.tril(np.ones((seq, seq), bool))
  np.testing.assert_array_equal(np.asarray(lower.dense(seq)) & tril,
                                np.asarray(m.dense(seq)))
  explicit, causal = m.split_causal(False)
  assert causal is False and not explicit.is_causal
  np.testing.assert_array_equal(explicit.dense(seq), m.dense(seq))
  np.testing.assert_array_equal(
      np.asarray(flashmask.visible_from_columns(flashmask.columns(m), seq)),
      np.asarray(m.dense(seq)))
  # Without the flag there is nothing to split.
  plain = FlashMask.document(SEGMENT_IDS)
  assert plain.split_causal(True) == (plain, False)
  assert plain.explicit() is plain
  # check keeps the flag.
  assert m.check(2, 4, seq, seq).is_causal


def test_is_causal_errors():
  z = np.zeros((1, 1, 5), np.int32)
  with pytest.raises(ValueError, match=r"is_causal=True takes no upper range"):
    FlashMask(z, ut_start=z, ut_end=z, is_causal=True)
  with pytest.raises(ValueError, match=r"is_causal must be a Python bool,"
                     r" got 1"):
    FlashMask(z, is_causal=1)


@settings(max_examples=100, deadline=None)
@given(flags=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1,
                      max_size=24))
def test_tile_runs_against_brute_force(flags):
  """``tile_runs`` on any per-tile flags (``full`` implies ``live``): the
  live range, the first full run, and the gap, the longest (first of the
  longest) run of hidden tiles between two live ones, ``[end, end)``
  where there is none."""
  live = np.array([lv or fu for lv, fu in flags])
  full = np.array([fu for _, fu in flags])
  got = np.asarray(flashmask.tile_runs(jnp.asarray(live), jnp.asarray(full)))
  n = len(flags)
  idx = np.flatnonzero(live)
  lo, hi = (idx[0], idx[-1] + 1) if idx.size else (0, 0)
  run = next((i for i in range(n) if full[i]), n)
  run_end = next((i for i in range(run, n) if not full[i]), n)
  gaps = [(a, c) for a in range(lo + 1, hi) for c in range(a + 1, hi)
          if not live[a:c].any() and live[a - 1] and live[c]]
  gap = max(gaps, key=lambda g: (g[1] - g[0], -g[0]), default=(hi, hi))
  assert got.tolist() == [lo, hi, run, run_end, *gap]
