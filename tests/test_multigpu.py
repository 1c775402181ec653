"""Sharding and ring attention on every GPU of one host, compiled kernels.

The 8-CPU-device tests (tests/test_sharding.py, tests/test_ring.py) run
the interpret-mode kernels; these run the default GPU kernels (on Hopper
the Mosaic GPU forward, Triton backward) over all ``jax.devices()``, with
sizes derived from the device count ``n``:

* batch and head sharding (GQA key/value heads split with their groups)
  of ``flash_attention`` under ``jit`` on a 1-D mesh, Auto and Explicit
  axes: forward and gradients equal the single-device result bitwise, and
  the compiled module holds no collective;
* MQA with sharded query heads: dK/dV all-reduced over the head shards;
* ring attention over all devices (zig-zag causal and non-causal, packed
  segments with a padding run, GQA) with the Triton and the Mosaic GPU
  block kernels: the numerics rule against the reference, forward and
  gradients.

Run alone (not under pytest-xdist workers that would share the GPUs):
``python3 -m pytest -m gpu tests/test_multigpu.py``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_mask_features import packed_segments
from test_ring import _global_ring
from test_sharding import COLLECTIVES, _shard

import jaxflash
from jaxflash.masks import MaskArrays

pytestmark = pytest.mark.gpu

# Keywords of every kernel call: none, so the default (compiled GPU)
# kernels run.  (A CPU dry run of this file's logic can set interpret
# kernels here.)
KERNEL_KW: dict = {}
SEQ = 2048  # sharding tests
RING_CHUNK = 512  # ring tests: seq = 2 * n * RING_CHUNK (zig-zag chunks)
HEAD_DIM = 128
AXIS_TYPES = (AxisType.Auto, AxisType.Explicit)

# An HLO instruction (not a name or metadata) of a collective op.
_COLLECTIVE_OP = re.compile(r"(?<![\w%.-])(" + "|".join(COLLECTIVES) +
                            r")(?:-start)?\(")


def _collectives(hlo: str) -> set[str]:
  return set(_COLLECTIVE_OP.findall(hlo))


def _num_devices() -> int:
  n = len(jax.devices())
  if n < 2:
    pytest.skip(f"needs >= 2 devices, {n} present")
  return n


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _assert_bitwise(name, got, want):
  g, w = _bits(got), _bits(want)
  if np.array_equal(g, w):
    return
  diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
  raise AssertionError(
      f"{name}: {int((g != w).sum())} of {g.size} entries differ from the"
      f" single-device result, max |diff| {np.nanmax(diff):.3g}")


def _inputs(n, *, kv_heads, seg):
  """bf16 q, k, v, dout [2n, SEQ, 4n, HEAD_DIM] (k/v ``kv_heads``) and
  packed segment ids with a padded tail (or None)."""
  batch, heads = 2 * n, 4 * n
  kq, kk, kv, kd, ks = jax.random.split(jax.random.key(n), 5)
  shape = (batch, SEQ, heads, HEAD_DIM)
  kv_shape = (batch, SEQ, kv_heads, HEAD_DIM)
  q = jax.random.normal(kq, shape, jnp.bfloat16)
  k = jax.random.normal(kk, kv_shape, jnp.bfloat16)
  v = jax.random.normal(kv, kv_shape, jnp.bfloat16)
  do = jax.random.normal(kd, shape, jnp.bfloat16)
  ids = packed_segments(ks, batch, SEQ, 7, pad_tail=SEQ // 16) if seg else None
  return q, k, v, do, ids


def _fwd_bwd(q, k, v, do, seg, *, causal):
  attend = functools.partial(jaxflash.flash_attention, causal=causal,
                             segment_ids=seg, **KERNEL_KW)
  out, vjp = jax.vjp(attend, q, k, v)
  return (out, *vjp(do))


def _run_sharded(mesh, b, h, kv_h, q, k, v, do, seg, *, causal):
  """(single-device results, sharded results, compiled HLO text)."""
  fn = jax.jit(functools.partial(_fwd_bwd, causal=causal))
  want = fn(q, k, v, do, seg)
  args = _shard(mesh, b, h, q, k, v, do, seg, kv_h=kv_h)
  compiled = fn.lower(*args).compile()
  return want, compiled(*args), compiled.as_text()


# (id, mesh axis name, shards batch, kv heads: "mha" = heads, "gqa" = n,
#  causal, packed segments)
CASES = [
    ("batch-gqa-causal-packed", "data", True, "gqa", True, True),
    ("heads-mha-full", "tensor", False, "mha", False, False),
    ("heads-gqa-causal-packed", "tensor", False, "gqa", True, True),
]


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_batch_and_head_sharding_is_local_and_exact(case, axis_type):
  n = _num_devices()
  _, axis, on_batch, kv_kind, causal, seg = case
  mesh = jax.make_mesh((n,), (axis,), axis_types=(axis_type,))
  b, h = (axis, None) if on_batch else (None, axis)
  kv_heads = 4 * n if kv_kind == "mha" else n
  q, k, v, do, ids = _inputs(n, kv_heads=kv_heads, seg=seg)
  want, got, hlo = _run_sharded(mesh, b, h, "same", q, k, v, do, ids,
                                causal=causal)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    _assert_bitwise(name, g, w)
  assert got[0].sharding.is_equivalent_to(
      NamedSharding(mesh, P(b, None, h, None)), 4)
  assert got[2].sharding.is_equivalent_to(
      NamedSharding(mesh, P(b, None, h, None)), 4)
  assert not _collectives(hlo), sorted(_collectives(hlo))



@pytest.mark.parametrize("deterministic", [True, False],
                         ids=["deterministic", "atomic-dq"])
def test_batch_sharding_at_head_dim_64(deterministic):
  """head_dim 64, where the H200's default backward adds dQ by TMA
  reduce-adds into a run_state buffer: the partitioned backward lowers
  (a `jax.new_ref` there failed), equals the single-device result bitwise
  with ``deterministic=True`` and to float32 summation-order noise
  without."""
  n = _num_devices()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
  q, k, v = numerics.random_inputs(
      jax.random.key(5), batch=2 * n, q_len=SEQ, kv_len=SEQ, heads=8,
      kv_heads=2, head_dim=64, dtype=jnp.bfloat16)[:3]
  do = jax.random.normal(jax.random.key(6), q.shape, jnp.bfloat16)

  def fwd_bwd(q, k, v, do):
    attend = functools.partial(jaxflash.flash_attention, causal=True,
                               deterministic=deterministic, **KERNEL_KW)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(do))

  fn = jax.jit(fwd_bwd)
  want = fn(q, k, v, do)
  got = fn(*_shard(mesh, "data", None, q, k, v, do, None)[:4])
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    if deterministic or name != "dq":
      _assert_bitwise(name, g, w)
    else:
      scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
      assert numerics.max_abs_diff(g, w) <= 2 ** -7 * scale, name

@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
def test_mqa_head_sharding(axis_type):
  """One key/value head, query heads sharded: out and dQ exact; dK/dV
  summed over the head shards by an all-reduce (in bf16, another order
  than the kernel's loop over all heads)."""
  n = _num_devices()
  mesh = jax.make_mesh((n,), ("tensor",), axis_types=(axis_type,))
  q, k, v, do, _ = _inputs(n, kv_heads=1, seg=False)
  want, got, hlo = _run_sharded(mesh, None, "tensor", None, q, k, v, do,
                                None, causal=True)
  _assert_bitwise("out", got[0], want[0])
  _assert_bitwise("dq", got[1], want[1])
  for name, g, w in (("dk", got[2], want[2]), ("dv", got[3], want[3])):
    w32 = np.asarray(w, np.float32)
    tol = n * 2.0 ** -8 * float(np.max(np.abs(w32)))
    np.testing.assert_allclose(np.asarray(g, np.float32), w32, rtol=0,
                               atol=tol, err_msg=name)
  assert _collectives(hlo) == {"all-reduce"}, sorted(_collectives(hlo))


def _skip_unless_served(impl):
  """Skips when ``impl``'s kernels cannot run here (Mosaic needs sm90)."""
  if impl != "mosaic_gpu" or KERNEL_KW.get("interpret"):
    return
  from jaxflash import mosaic_gpu  # noqa: PLC0415
  x = jnp.zeros((1, 128, 1, HEAD_DIM), jnp.bfloat16)
  try:
    mosaic_gpu.check_supported(x, x, x, arrays=MaskArrays(),
                               logits_soft_cap=None, config=None,
                               interpret=False)
  except NotImplementedError as e:
    pytest.skip(str(e))


@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("causal", [True, False],
                         ids=["causal-zigzag", "full"])
def test_ring_over_all_devices(causal, impl):
  n = _num_devices()
  _skip_unless_served(impl)
  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,))
  seq = 2 * n * RING_CHUNK
  args = numerics.random_inputs(jax.random.key(seq + causal), batch=2,
                                q_len=seq, kv_len=seq, heads=8, kv_heads=2,
                                head_dim=HEAD_DIM, dtype=jnp.bfloat16)
  # Packed documents whose boundaries miss the chunk boundaries, a padded
  # tail and a padding run inside a document.
  ids = packed_segments(jax.random.key(1), 2, seq, 2 * n + 1,
                        pad_tail=RING_CHUNK // 3)
  ids = ids.at[:, seq // 3:seq // 3 + 100].set(jaxflash.PAD_SEGMENT_ID)
  attend = _global_ring(mesh, "context", causal=causal, zigzag=True,
                        seg_ids=ids,
                        kernel_kw=dict(KERNEL_KW, implementation=impl))
  got = numerics.outputs_and_grads(attend, *args)
  numerics.check_rule(got, *args, causal=causal, segment_ids=(ids, ids))
  hlo = jax.jit(attend).lower(*args[:3]).compile().as_text()
  assert "collective-permute" in _collectives(hlo)  # K/V travel the ring
