"""Partitioning of the attention op on 8 CPU devices (interpret kernels).

Batch and head sharding run the kernels per shard: results equal the
unsharded ones bitwise, and the compiled module holds no collective.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflash
from jaxflash import sharding

TILES = jaxflash.TritonConfig(block_q=16, block_k=16, block_q_dkv=16,
                              block_k_dkv=16, block_q_dq=16, block_k_dq=16)

MESHES = {
    "8": ((8,), ("data",)),
    "2x4": ((2, 4), ("data", "tensor")),
    "2x2x2": ((2, 2, 2), ("data", "fsdp", "tensor")),
}
# How q is sharded on each mesh: (batch axes, head axes)
LAYOUTS = {
    "8": [(("data",), None), (None, ("data",))],
    "2x4": [(("data",), ("tensor",)), (("data", "tensor"), None)],
    "2x2x2": [(("data", "fsdp"), ("tensor",)), (("data",), ("fsdp", "tensor"))],
}
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
               "reduce-scatter")
CASES = [(m, i, t) for m in MESHES for i in range(len(LAYOUTS[m]))
         for t in (AxisType.Auto, AxisType.Explicit)]
# Every commit: each layout once, Auto and Explicit axes alternating (both
# on each mesh); the other axis type of each layout is `slow`.
EVERY_COMMIT = {("8", 0, AxisType.Auto), ("8", 1, AxisType.Explicit),
                ("2x4", 0, AxisType.Explicit), ("2x4", 1, AxisType.Auto),
                ("2x2x2", 0, AxisType.Auto), ("2x2x2", 1, AxisType.Explicit)}


def _need_devices():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets 8 CPU devices)")


def _inputs(kv_heads=8, seg=True):
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (8, 40, 8, 16))
  k = jax.random.normal(kk, (8, 40, kv_heads, 16))
  v = jax.random.normal(kv, (8, 40, kv_heads, 16))
  do = jax.random.normal(kd, q.shape)
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 10)[None].repeat(8, 0)
  return q, k, v, do, (ids if seg else None)


def _fwd_bwd(q, k, v, do, seg):
  attend = functools.partial(jaxflash.flash_attention, causal=True,
                             segment_ids=seg, implementation="triton",
                             interpret=True, config=TILES)
  out, vjp = jax.vjp(attend, q, k, v)
  return (out, *vjp(do))


def _shard(mesh, b, h, q, k, v, do, seg, kv_h="same"):
  kv_h = h if kv_h == "same" else kv_h
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  qs = P(b, None, h, None)
  return (put(q, qs), put(k, P(b, None, kv_h, None)),
          put(v, P(b, None, kv_h, None)), put(do, qs),
          None if seg is None else put(seg, P(b, None)))


@pytest.mark.parametrize("mesh_name,layout,axis_type", [
    pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2].name}",
                 marks=[] if c in EVERY_COMMIT else [pytest.mark.slow])
    for c in CASES])
def test_batch_and_head_sharding_is_local_and_exact(mesh_name, layout,
                                                    axis_type):
  _need_devices()
  shape, names = MESHES[mesh_name]
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
  b, h = LAYOUTS[mesh_name][layout]
  q, k, v, do, seg = _inputs()
  want = jax.jit(_fwd_bwd)(q, k, v, do, seg)
  args = _shard(mesh, b, h, q, k, v, do, seg)
  fn = jax.jit(_fwd_bwd)
  got = fn(*args)
  for a, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
  assert got[0].sharding.is_equivalent_to(
      NamedSharding(mesh, P(b, None, h, None)), 4)
  hlo = fn.lower(*args).compile().as_text()
  for collective in COLLECTIVES:
    assert collective not in hlo, collective


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["Auto", "Explicit"])
def test_mask_arrays_and_kv_follow_q(axis_type):
  """Only q's layout decides: replicated k/v, host segment ids and
  lengths are resharded to follow it (on Explicit meshes too, where the
  op runs under shard_map, which takes only matching types)."""
  _need_devices()
  mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(axis_type,) * 2)
  q, k, v, do, seg = _inputs()
  lengths = np.array([40, 31, 7, 0, 40, 22, 13, 39], np.int32)

  def run(q, k, v, do):
    attend = functools.partial(
        jaxflash.flash_attention, causal=True, segment_ids=np.asarray(seg),
        kv_seq_lengths=lengths, implementation="triton", interpret=True,
        config=TILES)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(do))

  want = jax.jit(run)(q, k, v, do)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  qs = P("data", None, "tensor", None)
  got = jax.jit(run)(put(q, qs), put(k, P()), put(v, P()), put(do, qs))
  for a, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


def test_gqa_and_mqa_head_sharding():
  _need_devices()
  mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(AxisType.Auto,) * 2)
  for kv_heads, kv_h in ((4, "tensor"), (1, None)):
    q, k, v, do, seg = _inputs(kv_heads=kv_heads, seg=False)
    want = jax.jit(_fwd_bwd)(q, k, v, do, None)
    args = _shard(mesh, "data", "tensor", q, k, v, do, None, kv_h=kv_h)
    fn = jax.jit(_fwd_bwd)
    for i, (a, w) in enumerate(zip(fn(*args), want)):
      if kv_heads == 1 and i >= 2:
        # dK/dV of MQA: a psum over head shards, so another summation
        # order than the kernel's loop over the whole group.
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5,
                                   atol=1e-5)
      else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    hlo = fn.lower(*args).compile().as_text()
    assert "all-gather" not in hlo
    # MQA: the backward sums dK/dV over the head shards, nothing else.
    assert ("all-reduce" in hlo) == (kv_heads == 1)


@pytest.mark.parametrize("spec,match", [
    (P(None, None, None, "data"), r"head_dim axis is sharded over mesh axis"),
])
def test_unservable_sharding_names_the_axis(spec, match):
  _need_devices()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  q, k, v, do, _ = _inputs(seg=False)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  with pytest.raises(Exception, match=match):
    jax.jit(_fwd_bwd)(put(q), put(k), put(v), put(do), None)


def test_heads_not_divisible():
  _need_devices()
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  q = jnp.ones((2, 16, 4, 16))
  qs = jax.device_put(jnp.ones((2, 16, 8, 16)),
                      NamedSharding(mesh, P(None, None, "tensor")))
  with pytest.raises(Exception, match=r"kv_heads=4 is not divisible by"
                     r" mesh axis \('tensor',\) of size 8"):
    jax.jit(_fwd_bwd)(qs, q, q, qs, None)


def test_inside_shard_map_and_logical_rules():
  _need_devices()
  mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(AxisType.Explicit,) * 2)
  assert sharding.logical_spec(sharding.Q_AXES, mesh=mesh) == P(
      "data", None, "tensor", None)
  q, k, v, do, seg = _inputs(kv_heads=4, seg=False)
  q, k, v = sharding.shard_qkv(mesh, q, k, v)
  qspec = sharding.logical_spec(sharding.Q_AXES, mesh=mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(qspec,) * 3,
                     out_specs=qspec)
  def local(q, k, v):
    return jaxflash.flash_attention(q, k, v, causal=True,
                                    implementation="triton", interpret=True,
                                    config=TILES)

  want = jaxflash.flash_attention(*(np.asarray(x) for x in (q, k, v)),
                                  causal=True, implementation="triton",
                                  interpret=True, config=TILES)
  np.testing.assert_array_equal(np.asarray(local(q, k, v)), np.asarray(want))


@pytest.mark.parametrize("rules", [
    sharding.DEFAULT_RULES,
    (("batch", "data"), ("heads", "tensor"), ("batch", "fsdp")),
    (("heads", "data"), ("batch", "data")),
    (("batch", "data"), ("heads", "data"), ("heads", "tensor")),
    (("length", None), ("length", "context"), ("kv_heads", "fsdp"),
     ("heads", "tensor")),
], ids=["default", "duplicate-batch", "rule-order", "fallback", "none-first"])
def test_logical_spec_follows_flax(rules):
  """The rules mean what Flax's logical_to_mesh_axes makes of them (rule
  order decides, a taken mesh axis defers to the name's next rule), so
  that jaxflash.linen's parameters and these specs agree."""
  import flax.linen as nn  # noqa: PLC0415
  for axes in (sharding.Q_AXES, sharding.KV_AXES):
    want = P(*(None if a is None else a
               for a in nn.logical_to_mesh_axes(axes, rules)))
    assert sharding.logical_spec(axes, rules) == want, axes


def test_shard_qkv_mqa_and_indivisible():
  """One key/value head stays whole (replicated over the head axes); a
  GQA count the head axes do not divide is a ValueError naming it."""
  _need_devices()
  mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(AxisType.Auto,) * 2)
  q = jnp.ones((4, 32, 8, 16))
  _, k, v = sharding.shard_qkv(mesh, q, jnp.ones((4, 32, 1, 16)),
                               jnp.ones((4, 32, 1, 16)))
  assert k.sharding.spec == v.sharding.spec == P("data", None, None, None)
  with pytest.raises(ValueError, match=r"k's kv_heads dimension \(2\) is"
                     r" not divisible by mesh axis \('tensor',\) of size 4"):
    sharding.shard_qkv(mesh, q, jnp.ones((4, 32, 2, 16)),
                       jnp.ones((4, 32, 2, 16)))


@pytest.mark.parametrize("axis_type", [
    AxisType.Auto, pytest.param(AxisType.Explicit, marks=pytest.mark.slow)],
    ids=["Auto", "Explicit"])
def test_dropout_sharded_matches_single_device(axis_type):
  """Attention dropout with batch and heads sharded keeps every (row,
  head) mask of the one-device call: each shard hashes its global head
  index."""
  _need_devices()
  mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(axis_type,) * 2)
  q, k, v, do, _ = _inputs(kv_heads=4, seg=False)
  key = jax.random.key(11)

  def run(q, k, v, do):
    attend = functools.partial(
        jaxflash.flash_attention, causal=True, dropout_rate=0.3,
        dropout_rng=key, implementation="triton", interpret=True,
        config=TILES)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(do))

  want = jax.jit(run)(q, k, v, do)
  args = _shard(mesh, "data", "tensor", q, k, v, do, None)[:4]
  got = jax.jit(run)(*args)
  for a, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
