"""MaskSpec's visibility against the reference's own mask, and its tile
ranges against brute force over every (query, key)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxflash import masks, reference
from jaxflash.masks import MaskSpec


def test_causal_alignment_pictures():
  """The pictures in jaxflash/masks.py and docs/numerics.md."""
  np.testing.assert_array_equal(
      np.asarray(MaskSpec(2, 5, causal=True).dense()),
      [[1, 1, 1, 1, 0],
       [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(
      np.asarray(MaskSpec(5, 2, causal=True).dense()),
      [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])
  np.testing.assert_array_equal(
      np.asarray(MaskSpec(3, 3, causal=True).dense()), np.tril(np.ones((3, 3))))
  assert np.asarray(MaskSpec(3, 4).dense()).all()


@st.composite
def mask_cases(draw, max_len=48):
  """A mask of every kind: causal or not, offsets (default bottom-right,
  or given), windows (incl. empty and one-sided) at q_len != kv_len,
  segment ids with negative (padding) ids, sequence lengths."""
  t, s = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
  batch = 2
  side = st.one_of(st.none(), st.integers(0, max_len + 8))
  kw = dict(causal=draw(st.booleans()), window=(draw(side), draw(side)),
            offset=draw(st.one_of(st.none(), st.integers(-max_len, max_len))))
  if draw(st.booleans()):
    ids = st.integers(-2, 2)
    kw["segment_ids"] = tuple(
        np.array(draw(st.lists(ids, min_size=batch * n, max_size=batch * n)),
                 np.int32).reshape(batch, n) for n in (t, s))
  for name, n in (("q_seq_lengths", t), ("kv_seq_lengths", s)):
    if draw(st.booleans()):
      kw[name] = np.array(draw(st.lists(st.integers(0, n), min_size=batch,
                                        max_size=batch)), np.int32)
  return t, s, kw


def _spec_and_arrays(t, s, kw):
  spec = MaskSpec(t, s, kw["causal"], kw["offset"], *kw["window"])
  seg = kw.get("segment_ids") or (None, None)
  return spec, dict(q_valid=kw.get("q_seq_lengths"),
                    kv_valid=kw.get("kv_seq_lengths"), q_seg=seg[0],
                    k_seg=seg[1])


@settings(max_examples=400)
@given(case=mask_cases(), pad=st.integers(0, 20))
def test_visible_matches_reference_mask(case, pad):
  """masks.visible, the kernels' elementwise mask, as the kernels call it
  (indices of whole tiles, past the arrays' ends; per-row lengths and
  segment ids broadcast from a batch axis), against the reference's own
  mask, written independently from the definitions
  (jaxflash.reference.mask).  Inside the arrays they agree; past their
  ends nothing is visible.  NumPy on both sides: nothing to compile, so
  many cases."""
  t, s, kw = case
  spec, arrays = _spec_and_arrays(t, s, kw)
  q_idx = np.arange(t + pad)[None, :, None]
  k_idx = np.arange(s + pad)[None, None, :]
  vis_kw = {n: None if arrays[n] is None else arrays[n][:, None, None]
            for n in ("q_valid", "kv_valid")}
  if arrays["q_seg"] is not None:
    # Positions past the ends carry id 0, a valid id: the index bounds
    # must hide them, not the ids.
    q_seg = np.pad(arrays["q_seg"], ((0, 0), (0, pad)))
    k_seg = np.pad(arrays["k_seg"], ((0, 0), (0, pad)))
    vis_kw.update(q_seg=q_seg[:, :, None], k_seg=k_seg[:, None, :])
  got = np.broadcast_to(spec.visible(q_idx, k_idx, **vis_kw),
                        (2, t + pad, s + pad))
  want = np.broadcast_to(reference.mask(t, s, xp=np, **kw), (2, t, s))
  np.testing.assert_array_equal(got[:, :t, :s], want)
  assert not got[:, t:].any() and not got[:, :, s:].any()


@settings(max_examples=30)
@given(case=mask_cases(), shape=st.sampled_from([(1, 7), (9, 5), (6, 13),
                                                 (16, 16)]))
def test_dense_matches_reference_mask(case, shape):
  """MaskSpec.dense (jax arrays) equals the reference's mask as the
  reference builds it (jax arrays too).  A few shapes, so that eager jax
  compiles each operation once."""
  (_, _, kw), (t, s) = case, shape
  kw = dict(kw)
  for name, n in (("q_seq_lengths", t), ("kv_seq_lengths", s)):
    if name in kw:
      kw[name] = np.minimum(kw[name], n)
  if "segment_ids" in kw:
    kw["segment_ids"] = tuple(np.resize(ids, (2, n)) for ids, n in
                              zip(kw["segment_ids"], (t, s)))
  spec, arrays = _spec_and_arrays(t, s, kw)
  got = np.asarray(spec.dense(**arrays))
  want = np.asarray(reference.mask(t, s, **kw))
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_invalid_lengths():
  with pytest.raises(ValueError, match="q_len=0"):
    MaskSpec(0, 4)


# The brute-force checks below draw an eighth of their examples per commit
# and all of them in the slow tier (make test-all).
TIERS = [50, pytest.param(400, marks=pytest.mark.slow)]


@pytest.mark.parametrize("examples", TIERS)
def test_tile_ranges_cover_exactly(examples):
  """Visited tiles hold every visible pair; 'full' tiles hold only visible
  pairs (so skipping their mask is exact).  Brute force over all pairs."""
  settings(max_examples=examples)(given(
      q_len=st.integers(1, 200), kv_len=st.integers(1, 200),
      causal=st.booleans(),
      left=st.one_of(st.none(), st.integers(0, 80)),
      right=st.one_of(st.none(), st.integers(0, 80)),
      offset=st.one_of(st.none(), st.integers(-100, 100)),
      q_valid=st.one_of(st.none(), st.integers(0, 200)),
      kv_valid=st.one_of(st.none(), st.integers(0, 200)),
      bq=st.sampled_from([16, 32, 64]),
      bk=st.sampled_from([16, 32, 64]))(_tile_ranges_cover_exactly))()


def _tile_ranges_cover_exactly(q_len, kv_len, causal, left, right, offset,
                               q_valid, kv_valid, bq, bk):
  spec = MaskSpec(q_len, kv_len, causal, offset, left, right)
  valid = {}
  if q_valid is not None:
    valid["q_valid"] = jnp.int32(min(q_valid, q_len))
  if kv_valid is not None:
    valid["kv_valid"] = jnp.int32(min(kv_valid, kv_len))
  q_pad, kv_pad = -(-q_len // bq) * bq, -(-kv_len // bk) * bk
  vis = np.asarray(spec.visible(jnp.arange(q_pad)[:, None],
                                jnp.arange(kv_pad)[None, :], **valid))
  # Forward / dQ view: per query tile, ranges over key tiles.
  for i in range(q_pad // bq):
    lo, flo, fhi, hi = (int(x) for x in spec.kv_block_range(
        jnp.int32(i * bq), bq, bk, **valid))
    assert 0 <= lo <= flo <= fhi <= hi <= kv_pad // bk
    rows = vis[i * bq:(i + 1) * bq]
    for t in range(kv_pad // bk):
      tile = rows[:, t * bk:(t + 1) * bk]
      if not lo <= t < hi:
        assert not tile.any(), (i, t)
      if flo <= t < fhi:
        assert tile.all(), (i, t)
  # dK/dV view: per key tile, ranges over query tiles.
  for j in range(kv_pad // bk):
    lo, flo, fhi, hi = (int(x) for x in spec.q_block_range(
        jnp.int32(j * bk), bk, bq, **valid))
    assert 0 <= lo <= flo <= fhi <= hi <= q_pad // bq
    cols = vis[:, j * bk:(j + 1) * bk]
    for t in range(q_pad // bq):
      tile = cols[t * bq:(t + 1) * bq]
      if not lo <= t < hi:
        assert not tile.any(), (j, t)
      if flo <= t < fhi:
        assert tile.all(), (j, t)


@pytest.mark.parametrize("examples", [
    50, pytest.param(200, marks=pytest.mark.slow)])
def test_segment_summaries(examples):
  """overlap_range / tiles_overlap / tiles_segment_full against brute force
  on random (also non-contiguous, padded) segment ids."""
  settings(max_examples=examples)(given(
      data=st.data(), block=st.sampled_from([4, 8]),
      n_rows=st.integers(1, 6),
      n_cols=st.integers(1, 6))(_segment_summaries))()


def _segment_summaries(data, block, n_rows, n_cols):
  ids = st.integers(-1, 3)
  rows = np.array(data.draw(st.lists(ids, min_size=n_rows * block,
                                     max_size=n_rows * block)))[None]
  cols = np.array(data.draw(st.lists(ids, min_size=n_cols * block,
                                     max_size=n_cols * block)))[None]
  rs = masks.tile_summary(jnp.asarray(rows), block)
  cs = masks.tile_summary(jnp.asarray(cols), block)
  rng = np.asarray(masks.overlap_range(rs, cs))[0]
  for i in range(n_rows):
    r = rows[0, i * block:(i + 1) * block]
    live = []
    for t in range(n_cols):
      c = cols[0, t * block:(t + 1) * block]
      pair = (r[:, None] == c[None, :]) & (r[:, None] >= 0)
      overlap = bool(masks.tiles_overlap(rs[0, :, i], cs[0, :, t]))
      full = bool(masks.tiles_segment_full(rs[0, :, i], cs[0, :, t]))
      assert overlap or not pair.any()      # never skip a visible pair
      assert full == bool(pair.all())       # full exactly when all visible
      if pair.any():
        live.append(t)
    if live:
      assert rng[0, i] <= min(live) and max(live) < rng[1, i]


def test_causal_skips_tiles_above_diagonal():
  """Causal self-attention visits about half the tiles, not all."""
  spec = MaskSpec(1024, 1024, causal=True)
  visited = sum(int(spec.kv_block_range(jnp.int32(i * 64), 64, 64)[3])
                for i in range(16))
  assert visited == sum(range(1, 17))  # 136 of 256 tiles
