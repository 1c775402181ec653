"""Tile ranges of MaskSpec against brute force over every (query, key)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_invalid_lengths():
  with pytest.raises(ValueError, match="q_len=0"):
    MaskSpec(0, 4)


def _pairs(spec, bq, bk, q_pad, kv_pad):
  qi = np.arange(q_pad)[:, None]
  kj = np.arange(kv_pad)[None, :]
  return np.asarray(spec.visible(jnp.asarray(qi), jnp.asarray(kj)))


@settings(max_examples=300)
@given(q_len=st.integers(1, 300), kv_len=st.integers(1, 300),
       causal=st.booleans(), bq=st.sampled_from([16, 32, 64]),
       bk=st.sampled_from([16, 32, 64]))
def test_tile_ranges_cover_exactly(q_len, kv_len, causal, bq, bk):
  """Visited tiles hold every visible pair; 'full' tiles hold only visible
  pairs (so skipping their mask is exact)."""
  spec = MaskSpec(q_len, kv_len, causal)
  q_pad, kv_pad = -(-q_len // bq) * bq, -(-kv_len // bk) * bk
  vis = _pairs(spec, bq, bk, q_pad, kv_pad)
  # Forward / dQ view: per query tile, ranges over key tiles.
  for i in range(q_pad // bq):
    lo, flo, fhi, hi = (int(x) for x in spec.kv_block_range(
        jnp.int32(i * bq), bq, bk))
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
        jnp.int32(j * bk), bk, bq))
    assert 0 <= lo <= flo <= fhi <= hi <= q_pad // bq
    cols = vis[:, j * bk:(j + 1) * bk]
    for t in range(q_pad // bq):
      tile = cols[t * bq:(t + 1) * bq]
      if not lo <= t < hi:
        assert not tile.any(), (j, t)
      if flo <= t < fhi:
        assert tile.all(), (j, t)


def test_causal_skips_tiles_above_diagonal():
  """Causal self-attention visits about half the tiles, not all."""
  spec = MaskSpec(1024, 1024, causal=True)
  visited = sum(int(spec.kv_block_range(jnp.int32(i * 64), 64, 64)[3])
                for i in range(16))
  assert visited == sum(range(1, 17))  # 136 of 256 tiles
