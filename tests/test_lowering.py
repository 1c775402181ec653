"""The Triton kernels lower to Triton IR for sm80 and sm90, on any machine.

Interpret mode checks what the kernels compute; it never runs the Triton
lowering, which has its own rules (e.g. dtypes of loop bounds).  This test
lowers forward and backward for CUDA targets without a GPU by giving the
lowering a GPU description (jax's private ``gpu_info`` hook), so a
construct the lowering rejects fails CI rather than the GPU run.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import triton as plt

import jaxflash.triton as triton_backend
from jaxflash.masks import MaskSpec

registration = pytest.importorskip(
    "jax._src.pallas.triton.pallas_call_registration")


@pytest.fixture(params=["A100", "H100"])
def fake_gpu(request, monkeypatch):
  info = plt.get_gpu_info_from_version(getattr(plt.GpuVersion, request.param))
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: info)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [
    # (q_len, kv_len, heads, kv_heads, head_dim, dtype)
    (17, 17, 4, 4, 32, jnp.bfloat16),
    (300, 1000, 8, 2, 96, jnp.float16),
    (1024, 1024, 4, 1, 256, jnp.bfloat16),
    (64, 40, 2, 2, 64, jnp.float32),
])
def test_lowers_to_triton(fake_gpu, shape, causal):
  t, s, h, kh, d, dtype = shape
  q = jax.ShapeDtypeStruct((2, t, h, d), dtype)
  kv = jax.ShapeDtypeStruct((2, s, kh, d), dtype)
  mask = MaskSpec(t, s, causal)

  def loss(q, k, v):
    out, lse = triton_backend.attention(q, k, v, mask=mask,
                                        softmax_scale=0.125)
    return out.astype(jnp.float32).sum() + lse.sum()

  lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("jaxflash_fwd", "jaxflash_bwd_dkv", "jaxflash_bwd_dq"):
    assert name in text
