"""The reference against an independent float64 NumPy softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import reference


def _numpy_attention(q, k, v, causal, scale):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  k = np.repeat(k, H // K, axis=2)
  v = np.repeat(v, H // K, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) * scale
  if causal:
    allowed = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
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
  out, lse = reference.attention(q, k, v, causal=causal, softmax_scale=0.3)
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
