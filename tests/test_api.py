"""Input validation and backend dispatch of flash_attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu

import jaxflash
from jaxflash import checks


def _arr(shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


Q = _arr((2, 16, 4, 32))
KV = _arr((2, 16, 2, 32))


@pytest.mark.parametrize("q,k,v,match", [
    (_arr((16, 4, 32)), KV, KV, r"q must have rank 4.*\(16, 4, 32\)"),
    (Q, _arr((2, 16, 2, 32, 1)), KV, r"k must have rank 4"),
    (Q, KV, _arr((2, 16, 64)), r"v must have rank 4"),
    (_arr((3, 16, 4, 32)), KV, KV, r"batch sizes differ: q \(3, 16, 4, 32\)"),
    (Q, _arr((2, 16, 2, 16)), _arr((2, 16, 2, 16)),
     r"head_dim differs: q \(2, 16, 4, 32\), k \(2, 16, 2, 16\)"),
    (Q, KV, _arr((2, 16, 2, 16)), r"head_dim differs"),
    (Q, _arr((2, 16, 3, 32)), _arr((2, 16, 3, 32)),
     r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    (Q, KV, _arr((2, 15, 2, 32)), r"k and v must have the same sequence"),
    (Q.astype(jnp.int32), KV.astype(jnp.int32), KV.astype(jnp.int32),
     r"q must be a floating-point array, got dtype int32"),
    (Q, KV.astype(jnp.bfloat16), KV,
     r"share one dtype.*k: \(2, 16, 2, 32\) bfloat16"),
    (_arr((2, 16, 4, 12)), _arr((2, 16, 2, 12)), _arr((2, 16, 2, 12)),
     r"head_dim=12 must be a multiple of 8 in \[8, 256\]"),
    (_arr((2, 4, 4, 264)), _arr((2, 4, 2, 264)), _arr((2, 4, 2, 264)),
     r"head_dim=264"),
    (_arr((2, 0, 4, 32)), KV, KV, r"q has an empty sequence"),
    (Q, _arr((2, 16, 0, 32)), _arr((2, 16, 0, 32)),
     r"heads must be >= 1: q \(2, 16, 4, 32\), k \(2, 16, 0, 32\)"),
    ([[1.0]], KV, KV, r"q must be an array"),
])
def test_bad_input_raises_value_error(q, k, v, match):
  with pytest.raises(ValueError, match=match):
    jaxflash.flash_attention(q, k, v)


@pytest.mark.parametrize("kwargs,match", [
    (dict(softmax_scale=-1.0), r"softmax_scale=-1.0 must be finite and > 0"),
    (dict(softmax_scale=float("nan")), r"softmax_scale=nan"),
    (dict(softmax_scale="0.1"), r"softmax_scale must be a static Python"),
    (dict(causal=1), r"causal must be a bool, got 1"),
    (dict(implementation="cuda"), r"implementation='cuda' is not one of"),
    (dict(implementation=[]), r"must not be an empty sequence"),
    (dict(config=object()), r"config of type object belongs to no backend"),
    (dict(config=object(), implementation="xla"),
     r"config of type object belongs to no backend"),
    # Finite as a float64 but not in the kernels' float32: inf, or flushed
    # to zero (NaN from 0/0 in the soft cap); too large for a float.
    (dict(softmax_scale=1e39), r"softmax_scale=1e\+39 must lie in float32"),
    (dict(softmax_scale=10**400), r"softmax_scale=1000.* must be finite"),
    (dict(logits_soft_cap=1e-39), r"logits_soft_cap=1e-39 must lie in"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxflash.flash_attention(Q, KV, KV, **kwargs)


def test_traced_softmax_scale_rejected():
  with pytest.raises(ValueError, match="static Python number"):
    jax.jit(lambda s: jaxflash.flash_attention(Q, KV, KV, softmax_scale=s))(
        0.5)


@pytest.mark.parametrize("bad", [
    dict(block_q=48), dict(block_k=8), dict(num_warps=3), dict(num_stages=0),
    dict(block_q_dq=100)])
def test_config_validation(bad):
  (name, val), = bad.items()
  with pytest.raises(ValueError, match=f"{name}={val}"):
    jaxflash.TritonConfig(**bad)


def test_config_is_hashable_and_frozen():
  cfg = jaxflash.TritonConfig(block_q=64)
  assert hash(cfg) == hash(jaxflash.TritonConfig(block_q=64))
  with pytest.raises(AttributeError):
    cfg.block_q = 32


def _uses_kernel(**kwargs) -> bool:
  jaxpr = jax.make_jaxpr(
      lambda q, k, v: jaxflash.flash_attention(q, k, v, **kwargs))(Q, KV, KV)
  return "pallas_call" in str(jaxpr)


@pytest.mark.skipif(has_gpu(), reason="checks CPU dispatch")
def test_cpu_dispatch():
  assert not _uses_kernel()                       # reference on CPU
  assert _uses_kernel(interpret=True)             # kernels when asked
  assert not _uses_kernel(implementation="xla", interpret=True)
  assert _uses_kernel(config=jaxflash.TritonConfig(block_q=16),
                      interpret=True)             # config picks its backend
  with pytest.raises(NotImplementedError,
                     match=r"triton: triton backend needs a CUDA GPU.*"
                     r"interpret=True"):
    jaxflash.flash_attention(Q, KV, KV, implementation="triton")
  # A sequence tries backends in order.
  assert not _uses_kernel(implementation=("triton", "xla"))
  with pytest.raises(NotImplementedError, match="not for backend 'xla'"):
    jaxflash.flash_attention(Q, KV, KV, implementation="xla",
                             config=jaxflash.TritonConfig())


@pytest.mark.gpu
def test_gpu_dispatch_picks_kernel():
  assert _uses_kernel()


def test_submodules_after_plain_import():
  """jaxflash.linen, jaxflash.sharding, ... after ``import jaxflash``
  alone, which does not import Flax."""
  import subprocess
  import sys
  code = ("import sys, jaxflash; assert 'flax' not in sys.modules;"
          " jaxflash.linen.FlashMultiHeadDotProductAttention;"
          " jaxflash.sharding.ring_attention; jaxflash.reference.attention;"
          " assert 'linen' in dir(jaxflash)")
  subprocess.run([sys.executable, "-c", code], check=True)
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    jaxflash.nope  # noqa: B018


def test_float64_not_supported_by_triton():
  jax.config.update("jax_enable_x64", True)
  try:
    q = jnp.ones((1, 8, 2, 16), jnp.float64)
    with pytest.raises(NotImplementedError, match="got float64"):
      jaxflash.flash_attention(q, q, q, implementation="triton",
                               interpret=True)
    out = jaxflash.flash_attention(q, q, q, interpret=True)  # falls to xla
    assert out.dtype == jnp.float64
    # ... which computes in float64, not float32: against float64 NumPy
    # to ~1e-15, where a float32 softmax is ~1e-7 off.
    r = np.random.default_rng(0)
    q, k, v = (r.standard_normal((1, 40, 2, 16)) for _ in range(3))
    out, lse = jaxflash.flash_attention(
        *(jnp.asarray(x) for x in (q, k, v)), causal=True, return_lse=True,
        implementation="xla")
    logits = np.einsum("bthd,bshd->bhts", q, k) / 4.0
    logits = np.where(np.tril(np.ones((40, 40), bool)), logits, -np.inf)
    want_lse = np.log(np.exp(logits).sum(-1))
    want = np.einsum("bhts,bshd->bthd",
                     np.exp(logits - want_lse[..., None]), v)
    assert out.dtype == lse.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-12)
    # int64 ids and lengths past int32 are refused, not wrapped.
    with pytest.raises(ValueError, match="int32, the kernels' id type"):
      jaxflash.flash_attention(
          jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
          segment_ids=jnp.full((1, 40), 2**32 + 1, jnp.int64))
    with pytest.raises(ValueError, match=r"must lie in \[0, 40\].*"
                       r"\[4294967301\]"):
      jaxflash.flash_attention(
          jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
          kv_seq_lengths=jnp.array([2**32 + 5], jnp.int64))
  finally:
    jax.config.update("jax_enable_x64", False)


def test_return_lse_shapes_and_defaults():
  q = jax.random.normal(jax.random.key(0), (2, 9, 4, 32))
  k = jax.random.normal(jax.random.key(1), (2, 5, 2, 32))
  out, lse = jaxflash.flash_attention(q, k, k, return_lse=True,
                                      interpret=True)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (2, 4, 9) and lse.dtype == jnp.float32
  ref = jaxflash.flash_attention(q, k, k, implementation="xla",
                                 softmax_scale=1 / np.sqrt(32))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


SEG = jnp.zeros((2, 16), jnp.int32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(segment_ids=jnp.zeros((2, 15), jnp.int32)),
     r"segment_ids must have shape \(2, 16\), got \(2, 15\)"),
    (dict(segment_ids=jnp.zeros((2, 16), jnp.float32)),
     r"segment_ids must be an integer array, got dtype float32"),
    (dict(segment_ids=(SEG,)), r"got 1 items"),
    (dict(segment_ids=(SEG, jnp.zeros((2, 9), jnp.int32))),
     r"kv_segment_ids must have shape \(2, 16\), got \(2, 9\)"),
    (dict(local_window_size=-1), r"local_window_size=-1: window sizes"),
    (dict(local_window_size=(3, -2)), r"local_window_size=\(3, -2\)"),
    (dict(local_window_size=(1, 2, 3)), r"an int or a pair"),
    (dict(local_window_size=1.5), r"an int or a pair"),
    (dict(q_seq_lengths=jnp.array([3, 17])),
     r"q_seq_lengths must lie in \[0, 16\].*\[3, 17\]"),
    (dict(kv_seq_lengths=jnp.array([-1, 2])), r"kv_seq_lengths must lie"),
    (dict(kv_seq_lengths=jnp.array([1, 2, 3])),
     r"kv_seq_lengths must have shape \(2,\), got \(3,\)"),
    (dict(logits_soft_cap=0.0), r"logits_soft_cap=0.0 must be finite and > 0"),
    (dict(logits_soft_cap=-3), r"logits_soft_cap=-3"),
])
def test_bad_mask_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxflash.flash_attention(Q, KV, KV, **kwargs)


def test_ids_and_lengths_outside_int32_are_refused(monkeypatch):
  """Ids are compared as the kernels' int32: a uint32 id past 2**31 - 1
  would wrap to a negative id (padding), so it is a ValueError; a length
  is checked before the cast (4294967295 is not -1)."""
  with pytest.raises(ValueError, match=r"segment_ids must lie in"
                     r" \[-2147483648, 2147483647\]"):
    jaxflash.flash_attention(Q, KV, KV,
                             segment_ids=jnp.full((2, 16), 2**31, jnp.uint32))
  with pytest.raises(ValueError, match=r"kv_seq_lengths must lie in"
                     r" \[0, 16\].*\[4294967295, 3\]"):
    jaxflash.flash_attention(
        Q, KV, KV, kv_seq_lengths=jnp.array([2**32 - 1, 3], jnp.uint32))
  # Ids whose dtype fits int32 are cast without a look at their values
  # (no read-back to the host on eager calls).
  def no_read_back(*args, **kw):
    raise AssertionError("segment ids were read back to the host")

  monkeypatch.setattr(checks, "_value_range", no_read_back)
  for dtype in (jnp.uint8, jnp.int16, jnp.int32):
    out = jaxflash.flash_attention(Q, KV, KV, implementation="xla",
                                   segment_ids=SEG.astype(dtype))
    assert out.shape == Q.shape


def test_concrete_lengths_closed_over_under_jit():
  """A concrete length array closed over by a jitted function is checked
  at trace time (not staged into the trace, where it cannot be read)."""
  ql = jnp.array([16, 5])
  f = jax.jit(lambda q: jaxflash.flash_attention(
      q, KV, KV, q_seq_lengths=ql, implementation="xla"))
  assert f(Q).shape == Q.shape
  bad = jnp.array([16, 50])
  with pytest.raises(ValueError, match=r"q_seq_lengths must lie in"):
    jax.jit(lambda q: jaxflash.flash_attention(
        q, KV, KV, q_seq_lengths=bad, implementation="xla"))(Q)


_BIG = 2**31 - 1


@pytest.mark.parametrize("backend,causal,window,same", [
    pytest.param(backend, causal, window, same,
                 id=f"{backend}-{'causal' if causal else 'full'}-{i}",
                 # The Triton kernels (each window another kernel) in two
                 # cases every commit: both sides huge, and one side
                 # past the keys beside a bounded one.
                 marks=[] if backend == "xla" or (causal, i) in {
                     (False, 0), (True, 3)} else [pytest.mark.slow])
    for backend in ("xla", "triton") for causal in (False, True)
    for i, (window, same) in enumerate((
        (_BIG, 45), ((_BIG, 0), (45, 0)), ((0, _BIG), (0, 45)),
        ((5, 50), (5, 45)), (10**12, 45)))])
def test_windows_past_both_ends_are_unbounded(backend, causal, window, same):
  """A window side of T + S or more (up to int32's limit, where position
  arithmetic would wrap) reaches every key: the same as a side of 45,
  which already covers every key of these 20 queries and 30 keys
  (aligned bottom-right: at most 29 keys back and 19 ahead) and keeps
  the window's code path."""
  kw = dict(implementation=backend, interpret=backend == "triton")
  q = jax.random.normal(jax.random.key(0), (1, 20, 2, 16))
  k = jax.random.normal(jax.random.key(1), (1, 30, 2, 16))
  got, want = (jaxflash.flash_attention(q, k, k, causal=causal,
                                        local_window_size=w, **kw)
               for w in (window, same))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_empty_batch(backend):
  """batch 0: empty outputs and gradients, as jax.nn gives."""
  kw = dict(implementation=backend, interpret=backend == "triton")
  q, k = jnp.ones((0, 16, 4, 32)), jnp.ones((0, 16, 2, 32))
  out, lse = jaxflash.flash_attention(q, k, k, return_lse=True, **kw)
  assert out.shape == q.shape and lse.shape == (0, 4, 16)
  grads = jax.grad(lambda q, k: jaxflash.flash_attention(q, k, k, **kw).sum(),
                   (0, 1))(q, k)
  assert grads[0].shape == q.shape and grads[1].shape == k.shape


def test_one_segment_array_needs_self_attention():
  with pytest.raises(ValueError, match="q_len == kv_len, got 16 and 8"):
    jaxflash.flash_attention(Q, KV[:, :8], KV[:, :8], segment_ids=SEG)


def test_numpy_inputs_take_jax_dtypes():
  """NumPy float64 arrays are float32 to JAX without jax_enable_x64 (as
  every jnp function takes them), so the kernels serve them instead of
  refusing float64 (and implementation=None falling back to "xla")."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((1, 24, 2, 16)) for _ in range(3))
  got = jaxflash.flash_attention(q, k, v, causal=True,
                                 implementation="triton", interpret=True)
  want = jaxflash.flash_attention(*(jnp.asarray(x, jnp.float32)
                                    for x in (q, k, v)), causal=True,
                                  implementation="xla")
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5,
                             rtol=2e-5)
