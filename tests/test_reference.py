"""The reference against an independent float64 NumPy softmax, and its
mask against pictures drawn by hand."""

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest

from jaxflash import reference


def _numpy_attention(q, k, v, causal, scale, allowed=None):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  k = np.repeat(k, H // K, axis=2)
  v = np.repeat(v, H // K, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) * scale
  if causal:
    below = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
    s = np.where(below, s, -np.inf)
  if allowed is not None:
    s = np.where(allowed, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    lse = np.where(l > 0, np.log(l) + m, -np.inf)[..., 0]
  out = np.einsum("bhts,bshd->bthd", p / np.where(l > 0, l, 1), v)
  return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,s,h,kh", [(7, 7, 4, 4), (5, 9, 4, 2), (9, 4, 3, 1)])
def test_matches_numpy(t, s, h, kh, causal):
  kq, kk, kv = jax.random.split(jax.random.key(t * 100 + s), 3)
  q = jax.random.normal(kq, (2, t, h, 16))
  k = jax.random.normal(kk, (2, s, kh, 16))
  v = jax.random.normal(kv, (2, s, kh, 16))
  out, lse = numerics.reference_attention(q, k, v, causal=causal,
                                         softmax_scale=0.3)
  want_out, want_lse = _numpy_attention(q, k, v, causal, 0.3)
  np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-6, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-6, rtol=1e-5)


def test_empty_rows_are_zero_not_nan():
  """q_len > kv_len with causal: the first rows see no key."""
  q = jax.random.normal(jax.random.key(0), (1, 6, 2, 8))
  k = jax.random.normal(jax.random.key(1), (1, 2, 2, 8))

  def f(q, k, v):
    out, lse = reference.attention(q, k, v, causal=True)
    return out, lse

  (out, lse), vjp = jax.vjp(f, q, k, k)
  grads = vjp((jnp.ones_like(out), jnp.ones_like(lse)))
  assert np.all(np.asarray(out)[:, :4] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[:, :, :4]))
  assert np.all(np.asarray(grads[0])[:, :4] == 0)
  for x in (out, *grads):
    assert not np.isnan(np.asarray(x)).any()


def _picture(rows):
  return np.array([[c == "x" for c in r.split()] for r in rows])


@pytest.mark.parametrize("t,s,kw,rows", [
    # Bottom-right alignment: query i stands at key i + (s - t).
    (2, 5, dict(causal=True), ["x x x x .",
                               "x x x x x"]),
    (5, 2, dict(causal=True), [". .", ". .", ". .", "x .", "x x"]),
    # A window (left 1, right 0) at q_len < kv_len: query 0 stands at key
    # 3, query 1 at key 4.
    (2, 5, dict(window=(1, 0)), [". . x x .",
                                 ". . . x x"]),
    # ... and at q_len > kv_len: queries 0..2 stand before key 0.
    (5, 2, dict(window=(1, 1)), [". .", ". .", "x .", "x x", "x x"]),
    # A window right of the aligned key only, with causal: the diagonal.
    (3, 3, dict(window=(0, 2), causal=True), ["x . .", ". x .", ". . x"]),
    # An explicit offset (top-left alignment) with a window.
    (3, 5, dict(offset=0, window=(1, 1)), ["x x . . .",
                                           "x x x . .",
                                           ". x x x ."]),
    # A negative offset: query 0 stands before key 0, query 1 at key 0.
    (2, 3, dict(offset=-1, causal=True), [". . .", "x . ."]),
])
def test_mask_pictures(t, s, kw, rows):
  want = _picture(rows)
  np.testing.assert_array_equal(np.asarray(reference.mask(t, s, **kw)), want)
  np.testing.assert_array_equal(reference.mask(t, s, xp=np, **kw), want)


def test_mask_segments_and_lengths():
  """Segment ids (a negative id is padding: it sees nothing, nothing sees
  it) and per-row lengths, drawn by hand for one row."""
  q_ids = np.array([[0, 0, 1, -1]], np.int32)
  kv_ids = np.array([[0, 1, 1, -1, 0]], np.int32)
  got = reference.mask(4, 5, segment_ids=(q_ids, kv_ids), xp=np)
  np.testing.assert_array_equal(got[0], _picture(["x . . . x",
                                                  "x . . . x",
                                                  ". x x . .",
                                                  ". . . . ."]))
  got = reference.mask(3, 4, q_seq_lengths=np.array([2]),
                       kv_seq_lengths=np.array([3]), xp=np)
  np.testing.assert_array_equal(got[0], _picture(["x x x .",
                                                  "x x x .",
                                                  ". . . ."]))
  # Padding ids with equal values still see nothing.
  pad = np.full((1, 3), -2, np.int32)
  assert not reference.mask(3, 3, segment_ids=(pad, pad), xp=np).any()
  with pytest.raises(ValueError, match="window left=-1"):
    reference.mask(3, 3, window=(-1, 0))


@pytest.mark.parametrize("t,s,window,causal", [
    (6, 11, (2, 1), False), (11, 6, (0, 3), True), (8, 8, (None, 0), False)])
def test_window_attention_matches_numpy(t, s, window, causal):
  """Windowed attention at q_len != kv_len against NumPy with the mask
  written out by loops over the definition."""
  kq, kk, kv = jax.random.split(jax.random.key(t * 100 + s), 3)
  q = jax.random.normal(kq, (1, t, 2, 8))
  k = jax.random.normal(kk, (1, s, 1, 8))
  v = jax.random.normal(kv, (1, s, 1, 8))
  allowed = np.zeros((t, s), bool)
  for i in range(t):
    at = i + s - t  # the key position query i stands at
    for j in range(s):
      allowed[i, j] = ((window[0] is None or j >= at - window[0])
                       and (window[1] is None or j <= at + window[1])
                       and (not causal or j <= at))
  out, lse = numerics.reference_attention(q, k, v, window=window,
                                         causal=causal, softmax_scale=0.5)
  want_out, want_lse = _numpy_attention(q, k, v, False, 0.5, allowed)
  np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-6, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-6, rtol=1e-5)
