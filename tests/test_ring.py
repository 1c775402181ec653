"""Ring attention (context parallelism) on CPU devices, interpret kernels."""

import functools
import importlib
import json
import pathlib

import jax
import jax.extend as jex
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxflash
from jaxflash import sharding

TILES = jaxflash.TritonConfig(block_q=16, block_k=16, block_q_dkv=16,
                              block_k_dkv=16, block_q_dq=16, block_k_dq=16)


def _global_ring(mesh, axis, *, causal, zigzag, seg_ids, batch_axis=None,
                 kernel_kw=None, check_vma=False, segments=True):
  """``attend(q, k, v) -> (out, lse)`` over whole sequences, by ring
  attention on ``mesh``: tokens in zig-zag order, sequence split over
  ``axis``.  ``kernel_kw``: implementation/config/interpret of the ring's
  kernels (default: Triton in interpret mode, small tiles)."""
  n = mesh.shape[axis]
  if kernel_kw is None:
    kernel_kw = dict(config=TILES, interpret=True)
  seq = seg_ids.shape[1]
  order = sharding.zigzag_indices(seq, n) if (zigzag and causal) else (
      np.arange(seq))
  inv = np.argsort(order)
  spec = P(batch_axis, axis)

  def local(q, k, v, ids):
    return sharding.ring_attention(
        q, k, v, axis_name=axis, causal=causal, zigzag=zigzag,
        segment_ids=ids if segments else None, return_lse=True,
        **kernel_kw)

  ring = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4,
                       out_specs=(spec, P(batch_axis, None, axis)),
                       check_vma=check_vma)

  def attend(q, k, v):
    out, lse = ring(q[:, order], k[:, order], v[:, order],
                    seg_ids[:, order])
    return out[:, inv], lse[:, :, inv]
  return attend


@pytest.mark.parametrize("causal,batch_axis", [
    pytest.param(False, None, id="full", marks=pytest.mark.slow),
    pytest.param(True, None, id="causal", marks=pytest.mark.slow),
    pytest.param(True, "data", id="causal-batch-on-data",
                 marks=pytest.mark.slow)])
def test_ring_under_check_vma(causal, batch_axis):
  """shard_map's default check_vma=True: the ring's zeros (skipped pairs,
  initial accumulators) are typed as varying over the blocks' axes (the
  ring's, and "data" where batch is split over it too), and the results
  equal the unchecked ones bitwise.  The case is one the Pallas
  interpreter of jax 0.11.2 itself runs under check_vma (no segment ids,
  no GQA, one tile per block): with tiles of 16 or segment ids its own
  loops fail their vma check, asking for check_vma=False."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  mesh = jax.make_mesh((2, 2), ("data", "context"),
                       axis_types=(AxisType.Auto,) * 2)
  seq = 64
  args = numerics.random_inputs(jax.random.key(7), batch=2, q_len=seq,
                                kv_len=seq, heads=2, kv_heads=2, head_dim=16,
                                dtype=jnp.float32)
  ids = jnp.zeros((2, seq), jnp.int32)
  ring = functools.partial(_global_ring, mesh, "context", causal=causal,
                           zigzag=True, seg_ids=ids, segments=False,
                           batch_axis=batch_axis,
                           kernel_kw=dict(interpret=True))
  want = numerics.outputs_and_grads(ring(check_vma=False), *args)
  got = numerics.outputs_and_grads(ring(check_vma=True), *args)
  for name, g, w in zip(numerics.NAMES, got, want):
    np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("mesh_shape,causal,zigzag", [
    pytest.param((4,), False, False, id="4-full", marks=pytest.mark.slow),
    pytest.param((4,), True, False, id="4-causal-contiguous"),
    pytest.param((8,), True, True, id="8-causal-zigzag",
                 marks=pytest.mark.slow),
    # (Zig-zag blocks per commit: test_context's FlashMask ring.)
    pytest.param((2, 4), True, True, id="2x4-data-context-zigzag",
                 marks=pytest.mark.slow),
])
def test_ring_matches_reference(mesh_shape, causal, zigzag):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  names = ("context",) if len(mesh_shape) == 1 else ("data", "context")
  mesh = jax.make_mesh(mesh_shape, names,
                       axis_types=(AxisType.Auto,) * len(mesh_shape))
  seq = 128
  args = numerics.random_inputs(jax.random.key(len(mesh_shape) + causal),
                                batch=2, q_len=seq, kv_len=seq, heads=4,
                                kv_heads=2, head_dim=32, dtype=jnp.float32)
  # Packed documents, one padding run: segments travel with their blocks.
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), seq // 4)[None]
  ids = jnp.repeat(ids, 2, 0).at[:, 50:60].set(jaxflash.PAD_SEGMENT_ID)
  attend = _global_ring(mesh, "context", causal=causal, zigzag=zigzag,
                        seg_ids=ids,
                        batch_axis="data" if len(mesh_shape) == 2 else None)
  got = numerics.outputs_and_grads(attend, *args)
  numerics.check_rule(got, *args, causal=causal, segment_ids=(ids, ids))
  hlo = jax.jit(attend).lower(*args[:3]).compile().as_text()
  assert "collective-permute" in hlo  # K/V blocks travel the ring


def test_zigzag_indices():
  order = sharding.zigzag_indices(8, 2)
  np.testing.assert_array_equal(order, [0, 1, 6, 7, 2, 3, 4, 5])
  with pytest.raises(ValueError, match="multiple of 2 \\* 3"):
    sharding.zigzag_indices(10, 3)


def test_ring_argument_errors():
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  mesh = jax.make_mesh((2,), ("context",), axis_types=(AxisType.Auto,))
  q = jnp.ones((1, 32, 2, 16))
  call = lambda x=q, **kw: jax.shard_map(
      functools.partial(sharding.ring_attention, axis_name="context", **kw),
      mesh=mesh, in_specs=(P(None, "context"),) * 3,
      out_specs=P(None, "context"), check_vma=False)(x, x, x)
  with pytest.raises(ValueError, match="implementation='xla'"):
    call(implementation="xla")
  with pytest.raises(ValueError, match="bwd_atomic_dq=True"):
    call(config=jaxflash.MosaicConfig(bwd_atomic_dq=True),
         deterministic=True)
  with pytest.raises(ValueError, match="deterministic must be a bool"):
    call(deterministic="yes", interpret=True)
  # jax 0.11.2's Mosaic GPU interpreter fails inside a multi-device
  # shard_map: a clear refusal instead of its internal assertion.
  with pytest.raises(NotImplementedError, match="bfloat16 and float16"):
    call(implementation="mosaic_gpu", interpret=True)
  with pytest.raises(NotImplementedError, match="over 2 devices"):
    call(q.astype(jnp.bfloat16), implementation="mosaic_gpu",
         interpret=True)
  if jax.default_backend() == "cpu":
    # The backend's own refusal, as flash_attention gives it.
    with pytest.raises(NotImplementedError,
                       match="triton backend needs a CUDA GPU"):
      call()
  # flash_attention's input checks, on each device's blocks.
  with pytest.raises(ValueError, match="softmax_scale=-1.0 must be finite"):
    call(softmax_scale=-1.0, interpret=True)
  with pytest.raises(ValueError, match="causal must be a bool"):
    call(causal="yes", interpret=True)
  with pytest.raises(ValueError, match=r"head_dim=12 must be a multiple"):
    call(jnp.ones((1, 32, 2, 12)), interpret=True)
  seg = jnp.zeros((1, 32), jnp.float32)
  with pytest.raises(ValueError, match="segment_ids must be an integer"):
    jax.shard_map(
        lambda x, s: sharding.ring_attention(
            x, x, x, axis_name="context", segment_ids=s, interpret=True),
        mesh=mesh, in_specs=(P(None, "context"), P(None, "context")),
        out_specs=P(None, "context"), check_vma=False)(q, seg)


@pytest.mark.slow  # (the tool per commit: its --proxy test)
def test_ring_bench_smoke(tmp_path, monkeypatch):
  """tools/ring_bench.py --smoke on the CPU devices: well-formed records."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  bench = importlib.import_module("ring_bench")
  assert bench.main(["--smoke", "--causal", "on", "--out", str(tmp_path),
                     "--name", "smoke"]) == 0
  data = json.loads((tmp_path / "smoke.json").read_text())
  n = jax.device_count()
  assert data["meta"]["device_count"] == n
  assert "NOT a performance figure" in data["meta"]["note"]
  rows = data["results"]
  assert [(r["seq"], r["mode"], r["causal"]) for r in rows] == [
      (256, "fwd", True), (256, "fwd_bwd", True)]
  for r in rows:
    assert r["error"] is None, r["error"]
    assert r["ms_1"] > 0 and r["ms_n"] > 0
    assert r["speedup"] == pytest.approx(r["ms_1"] / r["ms_n"])
    assert r["efficiency"] == pytest.approx(r["speedup"] / n)
    assert r["devices"] == n
  assert 0 <= rows[0]["max_abs_diff"] < 2 ** -4  # bf16 outputs, |out| < 4


def _ppermutes(jaxpr) -> int:
  """ppermute operands a jaxpr executes: loop bodies times their trip
  counts (fori_loop with static bounds is a scan), the costlier branch of
  a cond, nested jaxprs once."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "ppermute":
      total += len(eqn.invars)
      continue
    inner = [_ppermutes(getattr(p, "jaxpr", p))
             for p in eqn.params.values()
             if isinstance(p, (jex.core.Jaxpr, jex.core.ClosedJaxpr))]
    branches = [_ppermutes(b.jaxpr) for b in eqn.params.get("branches", ())]
    if name == "scan":
      total += eqn.params["length"] * sum(inner)
    elif name == "while":
      raise AssertionError("a ring loop without a static trip count")
    else:
      total += sum(inner) + max(branches, default=0)
  return total


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ring_sends_each_block_n_minus_1_times(n):
  """The forward passes K and V on n - 1 times (none after the last
  step), the backward K, V and the dK/dV accumulators n - 1 times each
  (the owner adds its own share when they come home)."""
  from jaxflash import _context
  from jaxflash.masks import MaskArrays
  mesh = jax.make_mesh((n,), ("ctx",), devices=jax.devices()[:n],
                       axis_types=(AxisType.Auto,))

  def local_forward(p, q, k, v, arrays):
    del p, arrays
    s = jnp.einsum("bthd,bshd->bhts", q, k)
    return jnp.einsum("bhts,bshd->bthd", s, v), s.sum(-1)

  def local_backward(p, q, k, v, arrays, out, lse, dout, dlse):
    del p, arrays, out, lse, dout, dlse
    return q, k, v

  ring = _context.Ring("ctx", n, True, True, lambda spec: None, (),
                       local_forward, local_backward)
  x = jnp.ones((1, 4 * n, 1, 8))
  spec = P(None, "ctx")
  trace = lambda f, k: jax.make_jaxpr(jax.shard_map(
      f, mesh=mesh, in_specs=(spec,) * k, out_specs=spec,
      check_vma=False))(*(x,) * k).jaxpr
  fwd = trace(lambda q, k, v: _context.ring_forward(
      ring, q, k, v, MaskArrays())[0], 3)
  bwd = trace(lambda q, k, v, o, do: _context.ring_backward(
      ring, q, k, v, MaskArrays(), o, q[..., 0].swapaxes(1, 2), do,
      q[..., 0].swapaxes(1, 2))[1], 5)
  assert _ppermutes(fwd) == 2 * (n - 1)
  assert _ppermutes(bwd) == 4 * (n - 1)
