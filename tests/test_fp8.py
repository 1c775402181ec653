"""FP8 attention (jaxflash.fp8): quantization, the Hadamard rotation, the
Triton FP8 forward in the interpreter against the dequantized reference,
accuracy bounds against float64, and the argument checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflash
from jaxflash import reference

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _normal(seed, shape, outliers=False):
  """Standard normal entries; with ``outliers``, 0.1% of them of magnitude
  10-100 (FlashAttention-3's accuracy setting, section 4.3)."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k1, shape, jnp.float32)
  if outliers:
    big = jax.random.uniform(k3, shape, minval=10.0, maxval=100.0)
    x = jnp.where(jax.random.bernoulli(k2, 0.001, shape),
                  jnp.sign(x) * big, x)
  return x


def _qkv(seed, *, batch=2, q_len=100, kv_len=130, heads=4, kv_heads=2,
         head_dim=64, outliers=False):
  return (_normal(seed, (batch, q_len, heads, head_dim), outliers),
          _normal(seed + 1, (batch, kv_len, kv_heads, head_dim), outliers),
          _normal(seed + 2, (batch, kv_len, kv_heads, head_dim), outliers))


def _quantized(q, k, v, axis=2, kv_dtype=E4M3):
  (qf, qs), (kf, ks), (vf, vs) = (
      jaxflash.quantize_fp8(q, axis=axis),
      jaxflash.quantize_fp8(k, axis=axis, dtype=kv_dtype),
      jaxflash.quantize_fp8(v, axis=axis, dtype=kv_dtype))
  return (qf, kf, vf), dict(q_scale=qs, k_scale=ks, v_scale=vs)


def _rmse(a, b):
  a, b = (np.asarray(x, np.float64) for x in (a, b))
  return float(np.sqrt(np.mean((a - b) ** 2)))


def test_quantize_fp8():
  x = _normal(0, (2, 8, 3, 16)) * jnp.asarray([1.0, 10.0, 0.0])[:, None]
  xf, s = jaxflash.quantize_fp8(x, axis=2)
  assert xf.dtype == E4M3 and s.shape == (3,) and s.dtype == jnp.float32
  assert float(s[2]) == 1.0  # an all-zero head
  back = xf.astype(jnp.float32) * s[None, None, :, None]
  # e4m3 keeps 3 mantissa bits: relative error at most 2^-4.
  np.testing.assert_allclose(back, x, rtol=2 ** -4, atol=1e-6)
  amax = jnp.max(jnp.abs(xf.astype(jnp.float32)), axis=(0, 1, 3))
  assert float(amax[0]) == float(amax[1]) == 448.0  # e4m3's largest
  xt, st = jaxflash.quantize_fp8(x, dtype=E5M2)
  assert xt.dtype == E5M2 and st.shape == ()
  with pytest.raises(ValueError, match="dtype=bfloat16"):
    jaxflash.quantize_fp8(x, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="axis=4"):
    jaxflash.quantize_fp8(x, axis=4)


@pytest.mark.parametrize("head_dim", [
    64, pytest.param(80, marks=pytest.mark.slow)])
def test_hadamard_rotate_keeps_logits(head_dim):
  q, k, _ = _qkv(3, head_dim=head_dim, kv_heads=4)
  qr, kr = jaxflash.hadamard_rotate(q, k, key=jax.random.key(5))
  logits = jnp.einsum("bthd,bshd->bhts", q, k)
  np.testing.assert_allclose(jnp.einsum("bthd,bshd->bhts", qr, kr), logits,
                             rtol=1e-4, atol=1e-3)
  # An outlier feature is spread over its block (16 features at 80, the
  # whole head at 64).
  spike = jnp.zeros((1, 1, 1, head_dim)).at[..., 3].set(100.0)
  rot, _ = jaxflash.hadamard_rotate(spike, spike)
  block = head_dim & -head_dim
  assert float(jnp.max(jnp.abs(rot))) == pytest.approx(100 / block ** 0.5,
                                                       rel=1e-5)


FP8_CASES = [
    pytest.param(dict(causal=True), {}, id="causal-gqa-perhead"),
    pytest.param(dict(local_window_size=(30, 10), logits_soft_cap=20.0,
                      kv_seq_lengths=jnp.asarray([130, 77])),
                 dict(axis=None), id="window-cap-lengths-per-tensor",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kw,quant", FP8_CASES)
def test_fp8_kernel_matches_dequantized_reference(kw, quant):
  """The Triton FP8 forward (interpreter) against exact attention of the
  dequantized inputs ("xla"): they differ only by the kernel's rounding of
  P to FP8, a few percent of an output's size at most."""
  (qf, kf, vf), scales = _quantized(*_qkv(1), **quant)
  run = lambda impl: jaxflash.flash_attention(
      qf, kf, vf, implementation=impl, interpret=True, return_lse=True,
      **scales, **kw)
  (out, lse), (ref, ref_lse) = run("triton"), run("xla")
  assert out.dtype == ref.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  fin = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin],
                             atol=1e-4)
  _check_against_dequantized(out, ref)


def test_fp8_accuracy_against_float64():
  """Output RMSE against float64 attention of the unquantized inputs
  (standard normal, and with 0.1% outliers of magnitude 10-100), per-head
  scales: FP8 stays within these bounds (measured 0.0052 and 0.159 at this
  shape), and the Hadamard rotation does not worsen it.  (It does not
  improve it either: FP8 is a floating-point format, so an outlier
  product's relative rounding error is the same whether it sits in one
  feature or is spread over the block.)"""
  got = {}
  for outliers in (False, True):
    q, k, v = _qkv(7, q_len=256, kv_len=256, heads=2, kv_heads=2,
                   head_dim=128, outliers=outliers)
    with jax.enable_x64():
      want = reference.attention(*(x.astype(jnp.float64)
                                   for x in (q, k, v)))[0]
    for rotate in (False, True):
      qq, kk = jaxflash.hadamard_rotate(q, k) if rotate else (q, k)
      (qf, kf, vf), scales = _quantized(qq, kk, v)
      out = jaxflash.flash_attention(qf, kf, vf, implementation="triton",
                                     interpret=True, out_dtype=jnp.float32,
                                     **scales)
      got[outliers, rotate] = _rmse(out, want)
  assert got[False, False] <= 0.008 and got[True, False] <= 0.2, got
  for outliers in (False, True):
    assert got[outliers, True] <= 1.05 * got[outliers, False], got


def test_fp8_forward_only_and_errors():
  (qf, kf, vf), scales = _quantized(*_qkv(2, q_len=16, kv_len=16))
  f = lambda qs: jaxflash.flash_attention(
      qf, kf, vf, implementation="xla", **{**scales, "q_scale": qs}).astype(
          jnp.float32).sum()
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(f)(scales["q_scale"])
  with pytest.raises(ValueError, match=r"k_scale must be a scalar or have"
                     r" shape \(2,\)"):
    jaxflash.flash_attention(qf, kf, vf, q_scale=scales["q_scale"],
                             k_scale=jnp.ones((4,)))
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    jaxflash.flash_attention(kf.astype(E5M2), kf, vf)
  with pytest.raises(ValueError, match="q_scale, out_dtype apply to FP8"):
    q = jnp.ones((1, 16, 4, 64), jnp.bfloat16)
    jaxflash.flash_attention(q, q, q, q_scale=1.0, out_dtype=jnp.float32)
  with pytest.raises(ValueError, match="out_dtype=int8"):
    jaxflash.flash_attention(qf, kf, vf, out_dtype=jnp.int8)
  # e5m2 keys and values: the XLA path (the Triton kernel refuses them).
  (qf, kf5, vf5), sc5 = _quantized(*_qkv(2, q_len=16, kv_len=16),
                                   kv_dtype=E5M2)
  with pytest.raises(NotImplementedError, match="float8_e5m2"):
    jaxflash.flash_attention(qf, kf5, vf5, implementation="triton",
                             interpret=True, **sc5)
  out = jaxflash.flash_attention(qf, kf5, vf5, interpret=True, **sc5)
  want = jaxflash.flash_attention(qf, kf5, vf5, implementation="xla", **sc5)
  np.testing.assert_array_equal(out, want)
  with pytest.raises(NotImplementedError, match="mosaic_gpu"):
    jaxflash.flash_attention(qf, kf, vf, implementation="mosaic_gpu")
  # A sequence is tried in order: the Hopper kernels decline, XLA serves.
  np.testing.assert_array_equal(
      jaxflash.flash_attention(qf, kf, vf, implementation=("mosaic_gpu",
                                                           "xla"), **scales),
      jaxflash.flash_attention(qf, kf, vf, implementation="xla", **scales))
  with pytest.raises(NotImplementedError, match="kv_len from 32"):
    jaxflash.flash_attention(qf, kf, vf, implementation="triton",
                             interpret=True, **scales)
  with pytest.raises(NotImplementedError, match="dense bias"):
    jaxflash.dot_product_attention(qf, kf, vf, bias=jnp.zeros((1, 1, 16, 16)),
                                   implementation="xla")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["Auto", "Explicit"])
def test_fp8_partitions_under_jit(axis_type):
  """FP8 inputs sharded by batch and heads under ``jit``: each device runs
  the kernel on its shard with its heads' scales (no collective), the
  result the unsharded call's; a sharded sequence axis is refused by
  name."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets 8 CPU devices)")
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(axis_type,) * 2)
  (qf, kf, vf), scales = _quantized(*_qkv(4, batch=4, q_len=64, kv_len=64,
                                         heads=4, kv_heads=2))
  run = jax.jit(lambda q, k, v, scales: jaxflash.flash_attention(
      q, k, v, causal=True, implementation="triton", interpret=True,
      **scales))
  want = run(qf, kf, vf, scales)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  spec = P("data", None, "model", None)
  args = (put(qf, spec), put(kf, spec), put(vf, spec), scales)
  got = run(*args)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want, np.float32))
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
  hlo = run.lower(*args).compile().as_text()
  for collective in ("all-gather", "all-reduce", "all-to-all",
                     "collective-permute"):
    assert collective not in hlo, collective
  seq = P(None, "data", None, None)
  with pytest.raises(Exception, match="not FP8 inputs"):  # (Auto: wrapped)
    run(put(qf, seq), put(kf, seq), put(vf, seq), scales)


def test_fp8_under_vmap():
  """A vmap over FP8 calls that share their scales: each slice's result is
  its own call's; scales mapped with the slices are refused by name."""
  (qf, kf, vf), scales = _quantized(*_qkv(6, batch=2, q_len=40, kv_len=40))
  attend = lambda q, k, v, scales: jaxflash.flash_attention(
      q, k, v, causal=True, implementation="triton", interpret=True,
      **scales)
  stack = lambda x: jnp.stack([x, x[::-1]])
  got = jax.vmap(attend, in_axes=(0, 0, 0, None))(
      stack(qf), stack(kf), stack(vf), scales)
  for i in range(2):
    want = attend(*(stack(x)[i] for x in (qf, kf, vf)), scales)
    np.testing.assert_array_equal(np.asarray(got[i], np.float32),
                                  np.asarray(want, np.float32))
  with pytest.raises(NotImplementedError, match="differ between batch rows"):
    jax.vmap(attend)(stack(qf), stack(kf), stack(vf),
                     jax.tree.map(stack, scales))


def _check_against_dequantized(out, ref):
  err = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))
  assert err.max() <= 0.05 * np.abs(np.asarray(ref, np.float32)).max()
  assert _rmse(out, ref) <= 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["mosaic_gpu", "mosaic_gpu-p_in_smem",
                                  "triton"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_fp8_forward(impl, causal):
  """The compiled FP8 forwards (the Hopper kernel with P a register
  operand, its tuned default, or staged in shared memory; the Triton
  kernel) against the dequantized reference: 2 x 2048 tokens, 16:4
  heads, head_dim 128."""
  (qf, kf, vf), scales = _quantized(*_qkv(11, q_len=2048, kv_len=2048,
                                         heads=16, kv_heads=4,
                                         head_dim=128))
  config = None
  if impl == "mosaic_gpu-p_in_smem":
    from jaxflash import mosaic_gpu
    impl, config = "mosaic_gpu", dataclasses.replace(
        mosaic_gpu.default_config(jax.devices()[0].device_kind, 128,
                                  causal=causal, kv_len=2048),
        p_in_smem=True)
  run = lambda impl, config=None: jax.jit(
      lambda q, k, v: jaxflash.flash_attention(
          q, k, v, causal=causal, implementation=impl, config=config,
          **scales))(qf, kf, vf)
  _check_against_dequantized(run(impl, config), run("xla"))


@pytest.mark.gpu
def test_gpu_fp8_dispatch_takes_the_hopper_kernel():
  """On a Hopper GPU the default dispatch runs FP8 calls on the Hopper
  kernel (a Mosaic GPU custom call, no Triton one)."""
  (qf, kf, vf), scales = _quantized(*_qkv(12, q_len=256, kv_len=256))
  text = jax.jit(lambda q, k, v: jaxflash.flash_attention(
      q, k, v, causal=True, **scales)).lower(qf, kf, vf).as_text()
  assert "mosaic_gpu" in text and "triton" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,kv_dtype,kw", [
    (64, E4M3, dict(segment_ids=True, kv_seq_lengths=(1000, 613))),
    (256, E5M2, dict(local_window_size=(300, 0), logits_soft_cap=30.0)),
    (96, E4M3, dict(causal=True)),
], ids=["d64-segments-lengths", "d256-e5m2-window-cap", "d96-causal"])
def test_gpu_fp8_hopper_forms(head_dim, kv_dtype, kw):
  """The Hopper FP8 forward's other forms on the GPU: segment ids and
  lengths, e5m2 keys and values with a window and the soft cap, the
  head_dim 96 (padded to 96: an 8-bit wgmma's K step is 32)."""
  (qf, kf, vf), scales = _quantized(
      *_qkv(13, q_len=1000, kv_len=1000, heads=8, kv_heads=2,
            head_dim=head_dim), kv_dtype=kv_dtype)
  kw = dict(kw)
  if kw.pop("segment_ids", False):
    ids = jnp.broadcast_to(jnp.arange(1000) // 300, (2, 1000))
    kw["segment_ids"] = ids
  if "kv_seq_lengths" in kw:
    kw["kv_seq_lengths"] = jnp.asarray(kw["kv_seq_lengths"])
  run = lambda impl: jax.jit(lambda q, k, v: jaxflash.flash_attention(
      q, k, v, implementation=impl, **scales, **kw))(qf, kf, vf)
  _check_against_dequantized(run("mosaic_gpu"), run("xla"))
