"""Input validation and backend dispatch of flash_attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu

import jaxflash


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


def test_float64_not_supported_by_triton():
  jax.config.update("jax_enable_x64", True)
  try:
    q = jnp.ones((1, 8, 2, 16), jnp.float64)
    with pytest.raises(NotImplementedError, match="got float64"):
      jaxflash.flash_attention(q, q, q, implementation="triton",
                               interpret=True)
    out = jaxflash.flash_attention(q, q, q, interpret=True)  # falls to xla
    assert out.dtype == jnp.float64
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


def test_one_segment_array_needs_self_attention():
  with pytest.raises(ValueError, match="q_len == kv_len, got 16 and 8"):
    jaxflash.flash_attention(Q, KV[:, :8], KV[:, :8], segment_ids=SEG)
