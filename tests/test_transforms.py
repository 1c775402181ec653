"""jit, grad, vmap, checkpoint (remat policies by residual name) and pmap."""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import jaxflash

CFG = jaxflash.TritonConfig(block_q=16, block_k=16, block_q_dkv=16,
                            block_k_dkv=16, block_q_dq=16, block_k_dq=16)
attn = functools.partial(jaxflash.flash_attention, causal=True,
                         implementation="triton", interpret=True, config=CFG)


def _qkv(key, lead=(), t=40, s=40, h=4, kh=2, d=32, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (*lead, t, h, d), dtype),
          jax.random.normal(kk, (*lead, s, kh, d), dtype),
          jax.random.normal(kv, (*lead, s, kh, d), dtype))


def _loss(q, k, v):
  return jnp.sum(attn(q, k, v) ** 2)


def test_vmap_matches_loop():
  q, k, v = _qkv(jax.random.key(0), lead=(3, 2))
  got = jax.jit(jax.vmap(attn))(q, k, v)
  one, grad = jax.jit(attn), jax.jit(jax.grad(_loss, (0, 1, 2)))  # (once)
  want = jnp.stack([one(q[i], k[i], v[i]) for i in range(3)])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
  g = jax.jit(jax.vmap(jax.grad(_loss, (0, 1, 2))))(q, k, v)
  for i in range(3):
    gi = grad(q[i], k[i], v[i])
    for a, b in zip(g, gi):
      np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), atol=1e-5)


def _saved(fn, *args) -> str:
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(fn, *args)
  return buf.getvalue()


def test_checkpoint_policies():
  """The forward saves its output and LSE under RESIDUAL_NAMES; a remat
  policy keeps them (no forward recompute) or drops them (recompute);
  gradients agree either way."""
  q, k, v = _qkv(jax.random.key(1), lead=(2,))
  keep = jax.checkpoint(
      _loss, policy=jax.checkpoint_policies.save_only_these_names(
          *jaxflash.RESIDUAL_NAMES))
  drop = jax.checkpoint(_loss,
                        policy=jax.checkpoint_policies.nothing_saveable)
  kept = _saved(keep, q, k, v)
  assert "named 'jaxflash_out'" in kept and "named 'jaxflash_lse'" in kept
  assert "named" not in _saved(drop, q, k, v)
  want = jax.jit(jax.grad(_loss, (0, 1, 2)))(q, k, v)
  for fn in (keep, drop):
    for a, b in zip(jax.jit(jax.grad(fn, (0, 1, 2)))(q, k, v), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pmap_over_cpu_devices():
  n = jax.local_device_count()
  if n < 2:
    pytest.skip("needs several devices (XLA_FLAGS host device count)")
  q, k, v = _qkv(jax.random.key(2), lead=(n, 1), t=24, s=24)
  got = jax.pmap(attn)(q, k, v)
  grads = jax.pmap(jax.grad(_loss, (0, 1, 2)))(q, k, v)
  # Every device's slice, against one batched call on one device.
  want = jax.jit(jax.vmap(attn))(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
  want = jax.jit(jax.vmap(jax.grad(_loss, (0, 1, 2))))(q, k, v)
  for a, b in zip(grads, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_grad_through_lse():
  """d(lse)/d(logits) = softmax probabilities: kernel matches reference."""
  q, k, v = _qkv(jax.random.key(3), lead=(1,), t=33, s=21)

  def f(impl):
    def loss(q, k, v):
      out, lse = jaxflash.flash_attention(
          q, k, v, causal=True, return_lse=True, implementation=impl,
          interpret=True, config=CFG if impl == "triton" else None)
      return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) ** 2)
    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)

  for a, b in zip(f("triton"), f("xla")):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
