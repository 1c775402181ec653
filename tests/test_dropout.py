"""Attention dropout: the Triton kernels (interpreter) against the
reference with the same keep mask, forward and gradients; the mask's
statistics and purity; a finite-difference check; the argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from numerics import check_rule, outputs_and_grads, random_inputs

import jaxflash
from jaxflash import masks

CASES = [
    pytest.param(dict(batch=2, q_len=70, kv_len=90, heads=4, kv_heads=2,
                      head_dim=32, dtype=jnp.float32),
                 dict(causal=True), False, id="gqa-causal-per-head"),
    pytest.param(dict(batch=2, q_len=40, kv_len=40, heads=2, kv_heads=2,
                      head_dim=16, dtype=jnp.bfloat16),
                 dict(local_window_size=(9, 3),
                      kv_seq_lengths=jnp.asarray([40, 17])), True,
                 id="bf16-window-lengths-shared", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape,kw,shared", CASES)
def test_kernel_matches_reference_with_the_same_mask(shape, kw, shared):
  """Outputs and gradients of the Triton kernels with dropout keep the
  numerics rule against the reference dropping the same probabilities
  (the keep mask is a function of the key, batch row, head and
  position)."""
  q, k, v, do, dlse = random_inputs(jax.random.key(0), **shape)
  drop = dict(dropout_rate=0.25, dropout_rng=jax.random.key(5),
              dropout_broadcast=shared)
  fn = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, implementation="triton", interpret=True, return_lse=True,
      **kw, **drop)
  got = outputs_and_grads(fn, q, k, v, do, dlse)
  ref = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, implementation="xla", return_lse=True, **kw, **drop)
  want = outputs_and_grads(ref, *(x.astype(jnp.float32) for x in (q, k, v)),
                           do.astype(jnp.float32), dlse)
  tol = 2e-5 if shape["dtype"] == jnp.float32 else 2 ** -6
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
    fin = np.isfinite(w)
    assert np.abs(g[fin] - w[fin]).max() <= tol * max(
        1.0, np.abs(w[fin]).max())
  # Rate 0 is no dropout at all.
  none = dict(drop, dropout_rate=0.0)
  check_rule(outputs_and_grads(
      lambda q, k, v: jaxflash.flash_attention(
          q, k, v, implementation="triton", interpret=True,
          return_lse=True, **kw, **none), q, k, v, do, dlse),
             q, k, v, do, dlse, causal=kw.get("causal", False),
             window=kw.get("local_window_size", (None, None)),
             kv_seq_lengths=kw.get("kv_seq_lengths"))


def test_keep_mask_statistics_and_purity():
  """About 1 - rate of the pairs are kept, independently across seeds and
  heads; the output is unbiased (values of 1 average to 1); one key gives
  one output, another key another; a shared mask is the same for every
  batch row and head."""
  rows = jnp.arange(256)[:, None]
  cols = jnp.arange(256)[None, :]
  a = masks.dropout_keep(jnp.int32(1), 0, rows, cols, 0.3)
  b = masks.dropout_keep(jnp.int32(2), 0, rows, cols, 0.3)
  c = masks.dropout_keep(jnp.int32(1), 1, rows, cols, 0.3)
  assert abs(float(a.mean()) - 0.7) < 0.01
  for other in (b, c):  # independent: agreement 0.7^2 + 0.3^2
    assert abs(float((a == other).mean()) - 0.58) < 0.01
  q = jax.random.normal(jax.random.key(0), (4, 64, 2, 16))
  ones = jnp.ones((4, 64, 2, 16))
  run = lambda key, **kw: jaxflash.flash_attention(
      q, q, ones, dropout_rate=0.3, dropout_rng=key, implementation="xla",
      **kw)
  means = jnp.stack([run(jax.random.key(s)) for s in range(16)]).mean()
  assert abs(float(means) - 1.0) < 0.01
  k0, k1 = jax.random.key(7), jax.random.key(8)
  np.testing.assert_array_equal(run(k0), run(k0))
  assert not np.allclose(run(k0), run(k1))
  # Shared: with equal rows and heads in, equal rows and heads out.
  same = jnp.broadcast_to(q[:1, :, :1], q.shape)
  out = jaxflash.flash_attention(same, same, ones, dropout_rate=0.3,
                                 dropout_rng=k0, dropout_broadcast=True,
                                 implementation="xla")
  np.testing.assert_array_equal(out, jnp.broadcast_to(out[:1, :, :1],
                                                      out.shape))


@pytest.mark.slow
def test_finite_differences_at_a_fixed_key():
  """With the key fixed the dropped attention is a smooth function of q,
  k and v: its gradients pass a finite-difference check."""
  q, k, v, _, _ = random_inputs(jax.random.key(1), batch=1, q_len=8,
                                kv_len=8, heads=2, kv_heads=1, head_dim=8,
                                dtype=jnp.float32)
  with jax.enable_x64():
    q, k, v = (x.astype(jnp.float64) for x in (q, k, v))
    f = lambda q, k, v: jaxflash.flash_attention(
        q, k, v, causal=True, dropout_rate=0.4,
        dropout_rng=jax.random.key(3), implementation="xla")
    check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-6,
                rtol=1e-6)


def test_dropout_errors():
  q = jnp.ones((1, 16, 2, 16), jnp.float32)
  key = jax.random.key(0)
  for rate, match in ((1.0, r"dropout_rate=1.0 must lie in \[0, 1\)"),
                      (-0.1, "must lie in"),
                      ("0.1", "must be a static float")):
    with pytest.raises(ValueError, match=match):
      jaxflash.flash_attention(q, q, q, dropout_rate=rate, dropout_rng=key)
  with pytest.raises(ValueError, match="needs a dropout_rng"):
    jaxflash.flash_attention(q, q, q, dropout_rate=0.1)
  with pytest.raises(ValueError, match="dropout_rng must be a jax.random"):
    jaxflash.flash_attention(q, q, q, dropout_rate=0.1,
                             dropout_rng=jnp.zeros(3))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_dropout(causal):
  """The default dispatch with dropout (on a Hopper GPU its forward
  kernel and the Triton backward) against the reference dropping the same
  probabilities: 2 x 1024 tokens, 8:2 heads, head_dim 128, bf16, outputs
  and gradients."""
  q, k, v, do, dlse = random_inputs(jax.random.key(2), batch=2, q_len=1024,
                                    kv_len=1024, heads=8, kv_heads=2,
                                    head_dim=128, dtype=jnp.bfloat16)
  drop = dict(dropout_rate=0.1, dropout_rng=jax.random.key(9))
  run = lambda impl, *xs: outputs_and_grads(
      lambda q, k, v: jaxflash.flash_attention(
          q, k, v, causal=causal, implementation=impl, return_lse=True,
          **drop), *xs)
  got = run(None, q, k, v, do, dlse)
  want = run("xla", *(x.astype(jnp.float32) for x in (q, k, v)),
             do.astype(jnp.float32), dlse)
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.abs(g - w).max() <= 2 ** -6 * max(1.0, np.abs(w).max())
