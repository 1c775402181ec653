"""The Triton kernels lower to Triton IR for sm80 and sm90, on any machine.

Interpret mode checks what the kernels compute; it never runs the Triton
lowering, which has its own rules (e.g. dtypes of loop bounds).  This test
lowers forward and backward for CUDA targets without a GPU by giving the
lowering a GPU description (jax's private ``gpu_info`` hook), so a
construct the lowering rejects fails CI rather than the GPU run.
"""

import functools
import importlib.resources
import itertools
import re

import jax
import jax.numpy as jnp
import pytest
from _pytest.mark import ParameterSet
from jax.experimental.pallas import triton as plt

from jaxflash import backends
from jaxflash.masks import MaskArrays, MaskSpec
from jaxflash.mosaic_gpu.config import kernel_head_dim, needed_smem_bytes

# The kernel backends' ops without the dispatch's device check: a CPU host
# lowers them for CUDA here.
mosaic_attention = functools.partial(backends.attention, "mosaic_gpu")
triton_attention = functools.partial(backends.attention, "triton")

registration = pytest.importorskip(
    "jax._src.pallas.triton.pallas_call_registration")


@pytest.fixture(params=["A100", "H100"])
def fake_gpu(request, monkeypatch):
  info = plt.get_gpu_info_from_version(getattr(plt.GpuVersion, request.param))
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: info)


FEATURES = {
    "plain": {},
    "window": dict(window=(40, 8)),
    "segments+lengths": dict(segments=True, lengths=True),
    "softcap+window+segments": dict(soft_cap=20.0, window=(64, 0),
                                    segments=True),
}


TRITON_SHAPES = [
    # (q_len, kv_len, heads, kv_heads, head_dim, dtype)
    (17, 17, 4, 4, 32, jnp.bfloat16),
    (300, 1000, 8, 2, 96, jnp.float16),
    (1024, 1024, 4, 1, 256, jnp.bfloat16),
    (64, 40, 2, 2, 64, jnp.float32),
]


def _triton_cases():
  """Every (shape, causal, features); every commit lowers each feature set
  at two shapes (causal on one, off on the other) and each shape with two
  feature sets, on both GPUs; the rest is `slow`."""
  for i, shape in enumerate(TRITON_SHAPES):
    for causal in (False, True):
      for j, features in enumerate(FEATURES):
        every_commit = (i + 2 * causal - j) % 4 == 0
        yield pytest.param(
            shape, causal, features,
            id=f"shape{i}-{'causal' if causal else 'full'}-{features}",
            marks=[] if every_commit else [pytest.mark.slow])


@pytest.mark.parametrize("shape,causal,features", list(_triton_cases()))
def test_lowers_to_triton(fake_gpu, shape, causal, features):
  t, s, h, kh, d, dtype = shape
  f = FEATURES[features]
  q = jax.ShapeDtypeStruct((2, t, h, d), dtype)
  kv = jax.ShapeDtypeStruct((2, s, kh, d), dtype)
  mask = MaskSpec(t, s, causal, None, *f.get("window", (None, None)))
  seg_q = jax.ShapeDtypeStruct((2, t), jnp.int32)
  seg_kv = jax.ShapeDtypeStruct((2, s), jnp.int32)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)

  def loss(q, k, v, seg_q, seg_kv, lens):
    arrays = MaskArrays(
        seg_q if f.get("segments") else None,
        seg_kv if f.get("segments") else None,
        lens if f.get("lengths") else None, None)
    out, lse = triton_attention(
        q, k, v, mask=mask, arrays=arrays, softmax_scale=0.125,
        logits_soft_cap=f.get("soft_cap"))
    return out.astype(jnp.float32).sum() + jnp.where(
        jnp.isfinite(lse), lse, 0).sum()

  lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(
      q, kv, kv, seg_q, seg_kv, lens).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("jaxflash_fwd", "jaxflash_bwd_dkv", "jaxflash_bwd_dq"):
    assert name in text


def _with_segments(cfgs, ids, every_commit):
  """``(cfg, segments)`` parameters: every config without segment ids,
  and with them.  Configs outside ``every_commit`` (the tuned defaults'
  options) carry the ``experimental`` marker, and their segment forms
  the ``slow`` marker (``make test-all``), since segment ids change the
  same mask code in every config."""
  for cfg, name in zip(cfgs, ids, strict=True):
    marks = [] if name in every_commit else [pytest.mark.experimental]
    yield pytest.param(cfg, False, id=name, marks=marks)
    yield pytest.param(cfg, True, id=f"{name}-segments",
                       marks=marks + [pytest.mark.slow] * bool(marks))


def _experimental_beyond_d128(marks, shape, **_):
  """An experimental option lowers at head_dim 128 every commit (the
  shape most of them were tuned at); at the other head dims in `make
  test-all`."""
  return "experimental" in marks and shape[4] != 128


def _crossed(unserved=lambda **_: False, slow=lambda marks, **_: False):
  """Crosses a test's ``parametrize`` marks into one, as pytest would
  (same ids, same marks), without the combinations ``unserved(**params)``
  names (so that no item is generated only to skip), and with the
  ``slow`` marker on those ``slow(marks, **params)`` names (``marks``:
  the names of the combination's markers)."""
  def wrap(fn):
    grids = [m for m in fn.pytestmark if m.name == "parametrize"]
    axes, names = [], []
    for m in grids:  # the decorator nearest the function first
      argnames = [n.strip() for n in m.args[0].split(",")]
      ids = m.kwargs.get("ids")
      axis = []
      for i, value in enumerate(m.args[1]):
        p = ParameterSet.extract_from(value, force_tuple=len(argnames) == 1)
        axis.append((p.values, p.id if p.id is not None else ids[i],
                     list(p.marks)))
      axes.append((argnames, axis))
      names += argnames
    params = []
    for combo in itertools.product(*(axis for _, axis in axes)):
      kw = {n: v for (argnames, _), (values, _, _) in zip(axes, combo)
            for n, v in zip(argnames, values)}
      if unserved(**kw):
        continue
      marks = [mk for c in combo for mk in c[2]]
      if slow({mk.name for mk in marks}, **kw):
        marks.append(pytest.mark.slow)
      params.append(pytest.param(
          *(kw[n] for n in names), id="-".join(c[1] for c in combo),
          marks=marks))
    fn.pytestmark = [m for m in fn.pytestmark if m.name != "parametrize"]
    return pytest.mark.parametrize(",".join(names), params)(fn)
  return wrap


def _grad_kernels(loss, *args) -> list[str]:
  """The custom calls (kernels) of ``loss``'s gradient in q, k, v lowered
  for CUDA."""
  text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  return re.findall(r"custom_call @(\w+)", text)


def _mosaic_case(shape):
  """Abstract inputs and the mask of a (q_len, kv_len, heads, kv_heads,
  head_dim, causal, window) case, batch 2, bf16."""
  t, s, h, kh, d, causal, window = shape
  return (jax.ShapeDtypeStruct((2, t, h, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, s, kh, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, t), jnp.int32),
          jax.ShapeDtypeStruct((2, s), jnp.int32),
          MaskSpec(t, s, causal, None, *(window or (None, None))))


@_crossed(slow=_experimental_beyond_d128)
@pytest.mark.parametrize("cfg,segments", _with_segments([
    dict(),
    dict(p_in_smem=True),
    dict(compute_wgs=1, schedule_barrier=False),
    dict(block_kv=64, stages=4),
    dict(block_kv=128, stages=3),
    dict(persistent=True),
    dict(intra_wg_overlap=True),
    dict(intra_wg_overlap=True, block_kv=128),
    dict(intra_wg_overlap=True, named_barriers=True, block_kv=128),
    dict(named_barriers=True, persistent=True),
    dict(named_barriers=True, compute_wgs=1, schedule_barrier=False),
    dict(named_barriers=True, persistent=True, prefetch_q=True),
    dict(persistent=True, prefetch_q=True),
    dict(named_barriers=True, block_kv=192),
    dict(named_barriers=True, lean_epilogue=True),
    dict(named_barriers=True, lean_epilogue=True, persistent=True),
    # Three consumers: the d64 default's forms.
    dict(named_barriers=True, compute_wgs=3, block_kv=128),
    dict(named_barriers=True, compute_wgs=3, block_kv=128, persistent=True,
         prefetch_q=True),
    # FlashAttention-3's 80- and 176-key tiles (V and P in the 32-byte
    # swizzle), K and V unpadded.
    dict(named_barriers=True, block_kv=80),
    dict(named_barriers=True, block_kv=80, unpadded_kv=True),
    dict(named_barriers=True, block_kv=176, p_in_smem=True),
    dict(block_kv=96, p_in_smem=True, persistent=True),
    dict(named_barriers=True, block_kv=80, unpadded_kv=True,
         consumer_registers=240),
    dict(named_barriers=True, block_kv=176, unpadded_kv=True,
         intra_wg_overlap=True, consumer_registers=240),
    dict(named_barriers=True, compute_wgs=3, intra_wg_overlap=True,
         p_in_smem=True, block_kv=128),
    # rescale_threshold: on the GPU, O's rescale behind a per-warp branch
    # (inline Mosaic GPU, which the interpreter does not run, so these
    # lowerings are its only CPU check): the plain loop, the overlapped
    # loop, three consumers, and the head_dim 256 non-causal default's
    # form (lean epilogue, K/V multicast).
    dict(named_barriers=True, rescale_threshold=8),
    dict(named_barriers=True, intra_wg_overlap=True, block_kv=128,
         rescale_threshold=8),
    dict(named_barriers=True, compute_wgs=3, block_kv=128,
         rescale_threshold=8),
    dict(named_barriers=True, intra_wg_overlap=True, lean_epilogue=True,
         kv_multicast=True, consumer_registers=240, rescale_threshold=8),
    # deferred_row_sum (inline Mosaic GPU too): every loop form that sums
    # P's rows, and with the threshold.
    dict(named_barriers=True, deferred_row_sum=True),
    dict(named_barriers=True, intra_wg_overlap=True, block_kv=128,
         consumer_registers=240, persistent=True, prefetch_q=True,
         early_q_release=True, deferred_row_sum=True),
    dict(named_barriers=True, compute_wgs=3, block_kv=128,
         deferred_row_sum=True),
    dict(named_barriers=True, intra_wg_overlap=True, lean_epilogue=True,
         kv_multicast=True, consumer_registers=240, rescale_threshold=8,
         deferred_row_sum=True),
    # Two Q buffers per consumer (the head_dim 128 persistent form: 226
    # of 227 KiB; head_dim 256 does not fit).
    dict(named_barriers=True, intra_wg_overlap=True, block_kv=128,
         consumer_registers=240, persistent=True, prefetch_q=True,
         early_q_release=True, lean_epilogue=True, q_double_buffer=True),
    # The overlapped loop run on across items, with one Q buffer and two.
    dict(named_barriers=True, intra_wg_overlap=True, block_kv=128,
         consumer_registers=240, persistent=True, prefetch_q=True,
         early_q_release=True, lean_epilogue=True, item_overlap=True),
    dict(named_barriers=True, intra_wg_overlap=True, block_kv=128,
         consumer_registers=240, persistent=True, prefetch_q=True,
         q_double_buffer=True, item_overlap=True),
], ["default", "p-in-smem", "one-wg", "deep", "wide", "persistent",
        "overlap", "overlap-wide", "named-overlap-wide",
        "named-persistent", "named-one-wg",
        "named-prefetch-q", "prefetch-q", "named-kv192",
        "named-lean", "named-lean-persistent",
        "three-wg", "three-wg-prefetch-q",
        "named-kv80", "named-kv80-unpadded", "named-kv176-p-in-smem",
        "kv96-p-in-smem-persistent", "named-kv80-unpadded-regs240",
        "named-overlap-kv176-regs240",
        "named-three-wg-overlap-p-in-smem", "named-rescale",
        "named-overlap-rescale",
        "three-wg-rescale", "named-overlap-lean-multicast-rescale",
        "named-deferred-sum",
        "named-overlap-persistent-early-q-deferred-sum",
        "three-wg-deferred-sum",
        "named-overlap-lean-multicast-rescale-deferred-sum",
        "named-overlap-persistent-double-q",
        "named-overlap-persistent-item-overlap",
        "named-overlap-persistent-double-q-item-overlap"],
    every_commit={"default", "persistent", "named-persistent",
                  "named-prefetch-q", "three-wg", "three-wg-prefetch-q",
                  "named-kv80-unpadded"}))
@pytest.mark.parametrize("shape", [
    # (q_len, kv_len, heads, kv_heads, head_dim, causal, window)
    (1024, 1024, 8, 2, 128, True, None),
    (300, 1000, 4, 1, 96, False, (128, 0)),
    (2048, 2048, 4, 4, 256, True, None),
    (512, 512, 4, 2, 64, False, None),
], ids=["d128-causal", "d96-window", "d256-causal", "d64"])
def test_mosaic_lowers_for_cuda(shape, cfg, segments):
  """The Hopper kernel lowers to Mosaic GPU IR for its GPU configurations
  (the interpreter runs only some of them)."""
  from jaxflash import mosaic_gpu
  d = shape[4]
  q, kv, seg_q, seg_kv, mask = _mosaic_case(shape)
  config = mosaic_gpu.MosaicConfig(**cfg)

  def fwd(q, k, v, sq, skv):
    arrays = MaskArrays(sq, skv) if segments else MaskArrays()
    return mosaic_attention(q, k, v, mask=mask, arrays=arrays,
                                softmax_scale=0.125, config=config)[0]

  lower = lambda: jax.jit(fwd).trace(q, kv, kv, seg_q, seg_kv).lower(
      lowering_platforms=("cuda",)).as_text()
  dp = kernel_head_dim(d)
  if config.smem_bytes(dp) > 227 * 1024:
    # Our estimate and the compiler agree that this config does not fit.
    with pytest.raises(Exception, match="exceeds available shared memory"):
      lower()
  else:
    assert "mosaic_gpu" in lower()


@pytest.mark.parametrize("cfg", [
    dict(unpadded_kv=True),
    dict(named_barriers=True, block_kv=80, unpadded_kv=True),
    dict(named_barriers=True, block_kv=176, unpadded_kv=True),
    dict(unpadded_kv=True, unpadded_q=True),
    dict(named_barriers=True, compute_wgs=3, unpadded_kv=True,
         unpadded_q=True),
    dict(named_barriers=True, compute_wgs=3, persistent=True,
         prefetch_q=True, unpadded_kv=True, unpadded_q=True),
], ids=["unpadded", "named-kv80-unpadded", "named-kv176-unpadded",
        "unpadded-q", "three-wg-unpadded-q", "three-wg-prefetch-q-unpadded-q"])
@pytest.mark.parametrize("shape", [
    (200, 300, 4, 1, 96, False, (128, 0)),
    (113, 17, 2, 2, 128, True, None),
    (1000, 1000, 2, 1, 64, False, None),
], ids=["k300", "k17", "q1000-d64"])
def test_mosaic_unpadded_lowers_at_any_length(shape, cfg):
  """``unpadded_kv`` / ``unpadded_q`` at lengths that 8 does not divide
  (or 192-row query groups do not): Mosaic GPU tiles a swizzled copy's
  global array by 8 rows and refuses others at lowering (seen on the
  H200 before K and V were padded to 8 rows)."""
  from jaxflash import mosaic_gpu
  q, kv, _, _, mask = _mosaic_case(shape)
  config = mosaic_gpu.MosaicConfig(**cfg)

  def fwd(q, k, v):
    return mosaic_attention(q, k, v, mask=mask, arrays=MaskArrays(),
                                softmax_scale=0.125, config=config)[0]

  text = jax.jit(fwd).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# Beyond head_dim 128 only the paired dK/dV form runs the Mosaic GPU
# backward (the others take the Triton kernels, lowered above).
@_crossed(unserved=lambda shape, cfg, segments: shape[4] > 128 and not (
    cfg.get("bwd_paired_dkv")),
          slow=_experimental_beyond_d128)
@pytest.mark.parametrize("cfg,segments", _with_segments([
    dict(),
    dict(p_in_smem=True),
    dict(compute_wgs=1, schedule_barrier=False),
    dict(bwd_stages=3, bwd_block_kv=128),
    dict(bwd_atomic_dq=True),
    dict(bwd_atomic_dq=True, p_in_smem=True, bwd_compute_wgs=1),
    dict(bwd_consumer_registers=240),
    dict(bwd_consumer_registers=240, bwd_atomic_dq=True),
    dict(bwd_paired_dkv=True, bwd_compute_wgs=1),
    dict(bwd_paired_dkv=True, bwd_paired_dq=True, bwd_compute_wgs=1),
    dict(bwd_paired_dq=True),
    dict(bwd_softmax_overlap=True),
    dict(bwd_softmax_overlap=True, bwd_atomic_dq=True),
    dict(bwd_stats_in_acc=True),
    dict(bwd_stats_in_acc=True, bwd_softmax_overlap=True),
    dict(bwd_stats_in_acc=True, bwd_atomic_dq=True),
    dict(bwd_stats_in_acc=True, bwd_block_q=128),
    dict(bwd_stats_in_acc=True, bwd_block_q=128, bwd_atomic_dq=True),
    dict(bwd_softmax_overlap=True, bwd_early_dv=True, bwd_atomic_dq=True),
    # The tuned head_dim 128 backward (tuning.json, H200).
    dict(bwd_stats_in_acc=True, bwd_softmax_overlap=True,
         bwd_consumer_registers=240, bwd_early_dv=True),
    # FlashAttention-3's 80-query steps of the dK/dV kernel over the d128
    # default (every operand in the 32-byte swizzle).
    dict(bwd_stats_in_acc=True, bwd_softmax_overlap=True,
         bwd_consumer_registers=240, bwd_early_dv=True, bwd_dkv_block_q=80),
], ["default", "p-in-smem", "one-wg", "deep", "atomic-dq",
        "atomic-dq-p-in-smem-one-wg", "regs240", "regs240-atomic-dq",
        "paired-dkv", "paired-dq", "paired-dq-2wg-dkv", "softmax-overlap",
        "softmax-overlap-atomic-dq", "stats-in-acc", "stats-in-acc-overlap",
        "stats-in-acc-atomic-dq", "stats-in-acc-bq128",
        "stats-in-acc-bq128-atomic-dq", "early-dv-atomic-dq", "d128-default",
        "d128-dkv-q80"],
    every_commit={"default", "atomic-dq", "paired-dkv", "paired-dq",
                  "d128-default", "stats-in-acc-bq128-atomic-dq",
                  "d128-dkv-q80"}))
@pytest.mark.parametrize("shape", [
    # (q_len, kv_len, heads, kv_heads, head_dim, causal, window)
    (1024, 1024, 8, 2, 128, True, None),
    (300, 1000, 4, 1, 96, False, (128, 0)),
    (512, 512, 4, 4, 64, False, None),
    (512, 700, 4, 2, 256, True, None),
], ids=["d128-gqa-causal", "d96-window", "d64", "d256"])
def test_mosaic_backward_lowers_for_cuda(shape, cfg, segments):
  """The Hopper dK/dV and dQ kernels lower to Mosaic GPU IR in their GPU
  configurations (registers as wgmma A operands, which the interpreter
  cannot run), and the shared-memory estimate agrees with the compiler."""
  from jaxflash import mosaic_gpu
  d = shape[4]
  q, kv, seg_q, seg_kv, mask = _mosaic_case(shape)
  config = mosaic_gpu.MosaicConfig(**cfg)

  def loss(q, k, v, sq, skv):
    arrays = MaskArrays(sq, skv) if segments else MaskArrays()
    out, lse = mosaic_attention(q, k, v, mask=mask, arrays=arrays,
                                    softmax_scale=0.125, config=config)
    return out.astype(jnp.float32).sum() + jnp.where(
        jnp.isfinite(lse), lse, 0).sum()

  lower = lambda: jax.jit(jax.grad(loss, (0, 1, 2))).trace(
      q, kv, kv, seg_q, seg_kv).lower(lowering_platforms=("cuda",)).as_text()
  dp = kernel_head_dim(d)
  if needed_smem_bytes(config, dp) > 227 * 1024:
    with pytest.raises(Exception, match="exceeds available shared memory"):
      lower()
  else:
    # Mosaic GPU kernels only: the forward, dQ and dK/dV (no dQ kernel
    # with atomic dQ).
    kernels = re.findall(r"custom_call @(\w+)", lower())
    n = 3 - config.bwd_atomic_dq
    assert kernels == ["mosaic_gpu_v2"] * n, kernels


def test_mosaic_backward_soft_cap_stats_in_acc_lowers():
  """Under a soft cap ``bwd_stats_in_acc`` folds delta alone (the LSE
  stays a subtraction after the tanh); both step orders lower, and so
  does ``bwd_early_dv`` (dV issued before ``tanh``'s factor enters dS)."""
  from jaxflash import mosaic_gpu
  q, kv, _, _, mask = _mosaic_case((256, 256, 4, 2, 128, True, None))
  for overlap, early in [(False, False), (True, False), (True, True)]:
    config = mosaic_gpu.MosaicConfig(
        bwd_stats_in_acc=True, bwd_softmax_overlap=overlap,
        bwd_early_dv=early)

    def loss(q, k, v, config=config):
      out, _ = mosaic_attention(q, k, v, mask=mask, softmax_scale=0.125,
                                    logits_soft_cap=20.0, config=config)
      return out.astype(jnp.float32).sum()

    assert _grad_kernels(loss, q, kv, kv) == ["mosaic_gpu_v2"] * 3


@pytest.mark.parametrize("atomic,dbias", [
    (False, False), (True, False), (False, True)],
    ids=["dq-kernel", "atomic", "dbias"])
def test_mosaic_backward_traces_without_effects(atomic, dbias):
  """custom_partitioning (every sharded jit) cannot lower a jaxpr with
  effects: the atomic-dQ buffer and the dense bias's dS buffer must be
  discharged state (run_state), not a `jax.new_ref` (seen failing on two
  H200s)."""
  from jaxflash import mosaic_gpu
  from jaxflash.mosaic_gpu import backend
  q, kv, _, _, mask = _mosaic_case((512, 512, 4, 2, 64, True, None))
  lse = jax.ShapeDtypeStruct((2, 4, 512), jnp.float32)
  arrays = MaskArrays(bias=jnp.zeros((1, 4, 512, 512), jnp.bfloat16)
                      if dbias else None)

  def grads(q, k, v, out, lse, dout):
    return backend.backward(
        q, k, v, arrays, out, lse, dout, jnp.zeros_like(lse),
        mask=mask, softmax_scale=0.125, bias_grad=dbias,
        config=mosaic_gpu.MosaicConfig(bwd_atomic_dq=atomic))

  jaxpr = jax.make_jaxpr(grads)(q, kv, kv, q, lse, q)
  assert not jaxpr.effects, jaxpr.effects
  text = jax.jit(grads).trace(q, kv, kv, q, lse, q).lower(
      lowering_platforms=("cuda",)).as_text()
  kernels = re.findall(r"custom_call @(\w+)", text)
  assert kernels == ["mosaic_gpu_v2"] * (1 if atomic else 2), kernels


def test_ring_layers_share_their_kernels():
  """Ring attention in a model: every layer's block pairs are the same
  few kernels, lowered once (jitted pair kernels) -- 24 lowered Mosaic GPU
  kernels per layer before, so compile time grew with depth."""
  import functools

  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxflash.ring import ring_attention
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  mesh = jax.make_mesh((2,), ("context",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  ring = jax.shard_map(
      functools.partial(ring_attention, axis_name="context", causal=True,
                        implementation="mosaic_gpu"),
      mesh=mesh, in_specs=(P(None, "context"),) * 3,
      out_specs=P(None, "context"), check_vma=False)

  def kernels(layers):
    def loss(q, k, v):
      x = q
      for _ in range(layers):
        x = ring(x, k, v)
      return x.astype(jnp.float32).sum()
    x = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "context")))
    text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(x, x, x).lower(
        lowering_platforms=("cuda",)).as_text()
    return len(re.findall(r"custom_call @mosaic_gpu_v2", text))

  one = kernels(1)
  # Forward per relation (causal, full), and their backward kernels.
  assert 2 <= one <= 8, one
  assert kernels(3) == one


def _forward_kernel_ops(head_dim, causal, overrides=""):
  """The Mosaic GPU kernel module of the H200 forward for head_dim /
  causal with ``overrides`` over its tuned config (the rules of a
  4096-key call), lowered for CUDA on this machine at 1024 tokens and
  printed: the module travels as bytecode in the custom call."""
  import dataclasses

  from jax._src.interpreters import mlir as jax_mlir
  from jax.experimental.mosaic.gpu import core as mgpu_core
  from jax.experimental.mosaic.gpu import dialect as mgpu_dialect
  from jaxlib.mlir import ir

  from jaxflash import mosaic_gpu
  from jaxflash.mosaic_gpu.config import parse_overrides

  cfg = mosaic_gpu.default_config("NVIDIA H200", -(-head_dim // 64) * 64,
                                  causal=causal, kv_len=4096)
  cfg = dataclasses.replace(cfg, **parse_overrides(overrides))
  seq = 1024
  mask = MaskSpec(seq, seq, causal, None, None, None)
  x = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)
  fwd = lambda q, k, v: mosaic_attention(
      q, k, v, mask=mask, softmax_scale=head_dim ** -0.5, config=cfg)[0]
  mgpu_core.KNOWN_KERNELS.clear()
  jax.jit(fwd).trace(x, x, x).lower(lowering_platforms=("cuda",))
  (module,) = mgpu_core.KNOWN_KERNELS.values()
  ctx = jax_mlir.make_ir_context()
  mgpu_dialect.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True  # stable_mosaic_gpu's wrapper
  with ctx:
    return str(ir.Module.parse(module))


@pytest.mark.parametrize("head_dim,causal", [(256, False), (128, True)])
def test_gpu_only_forward_options_reach_the_kernel(head_dim, causal):
  """The forward options that only the GPU runs (inline Mosaic GPU, which
  the interpreter does not execute) change the kernel the GPU gets:
  ``rescale_threshold`` adds the per-warp vote of its rescale branch,
  ``deferred_row_sum`` removes shuffles from the loop (its final
  butterflies add fewer than the per-step sums drop).  A flag that
  silently stopped reaching the kernel would pass every interpreter test
  and the GPU's numerics."""
  shfl = "nvvm.shfl.sync"
  vote = "nvvm.vote.sync"
  # Both off, each alone (the H200's head_dim 256 default has both on).
  off = "rescale_threshold=0,deferred_row_sum=0"
  base = _forward_kernel_ops(head_dim, causal, off)
  rescale = _forward_kernel_ops(head_dim, causal,
                                "rescale_threshold=8,deferred_row_sum=0")
  deferred = _forward_kernel_ops(head_dim, causal,
                                 "rescale_threshold=0,deferred_row_sum=1")
  assert vote not in base and vote in rescale
  assert rescale.count(shfl) == base.count(shfl)
  assert 0 < deferred.count(shfl) < base.count(shfl)


def _store_order(module_text):
  """The forward's TMA stores and their waits, in program order: ``Wn``
  waits until at most n store groups still read shared memory, ``O`` an
  output chunk's tensor store, ``L`` the LSE's bulk store."""
  toks = []
  for line in module_text.splitlines():
    if "nvvm.cp.async.bulk.wait_group" in line:
      toks.append("W" + re.search(r"group = (\d+)", line).group(1))
    elif "cp.async.bulk.tensor.global.shared.cta" in line:
      toks.append("O")
    elif "cp.async.bulk.global.shared" in line:
      toks.append("L")
  return " ".join(toks)


def test_item_overlap_chains_the_items_in_the_kernel():
  """``item_overlap`` on the persistent head_dim 128 forward: a second
  last turn (the last ``P V`` and the next item's first ``Q K^T``, 8 + 8
  wgmma instructions at head_dim 128 with 128-key tiles) and a second
  epilogue (inside that turn), the kernel's last wait still after both.
  The interpreter runs the chain's mbarrier form; this checks that the
  option reaches the kernel the GPU gets."""
  base = _forward_kernel_ops(128, False, "persistent=1,item_overlap=0")
  chain = _forward_kernel_ops(128, False, "persistent=1,item_overlap=1")
  wgmma = "wgmma.mma_async"
  assert chain.count(wgmma) == base.count(wgmma) + 16
  assert _store_order(base) == "W1 O W1 O L W0 W0"
  assert _store_order(chain) == "W1 O W1 O L W0 W1 O W1 O L W0 W0"


def test_item_overlap_chains_the_plain_loop_in_the_kernel():
  """``item_overlap`` without the overlapped loop (head_dim 64's
  persistent form: two consumers, 128-key tiles): the first and last
  tiles leave the loops (their ``Q K^T``, 4 wgmma instructions each at
  head_dim 64, and ``P V``, 8 each), and the chained last turn adds a
  ``P V`` and the next item's ``Q K^T`` (8 + 4) with a second epilogue
  inside it; the kernel's last wait stays after both.  The interpreter
  runs the chain's mbarrier form; this checks the kernel the GPU gets.
  With three consumers at power-of-two lengths the last group's last
  consumers hold padding rows only, so it does not chain there."""
  two = "persistent=1,compute_wgs=2"
  base = _forward_kernel_ops(64, False, two + ",item_overlap=0")
  chain = _forward_kernel_ops(64, False, two + ",item_overlap=1")
  wgmma = "wgmma.mma_async"
  assert chain.count(wgmma) == base.count(wgmma) + 2 * (4 + 8) + 8 + 4
  assert _store_order(base) == "W0 O L W0 W0"
  assert _store_order(chain) == "W0 O L W0 W0 O L W0 W0"
  three = [_forward_kernel_ops(64, False, f"persistent=1,item_overlap={i}")
           for i in (0, 1)]
  assert ([m.count(wgmma) for m in three] == [base.count(wgmma)] * 2
          and {_store_order(m) for m in three} == {_store_order(base)})



@pytest.mark.parametrize("q_len,window,cap,dtype", [
    (1, None, None, jnp.bfloat16), (5, 40, 20.0, jnp.float16)])
def test_paged_decode_lowers_to_triton(fake_gpu, q_len, window, cap, dtype):
  """The paged split-K kernel (jaxflash.triton.decode) lowers to Triton
  IR: the page table's scalar loads, pages by a dynamic index, the loop
  over a split's pages."""
  from jaxflash.triton import decode
  q = jax.ShapeDtypeStruct((2, q_len, 8, 128), dtype)
  pages = jax.ShapeDtypeStruct((40, 16, 2, 128), dtype)
  table = jax.ShapeDtypeStruct((2, 13), jnp.int32)  # any table width
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

  def run(q, k, v, table, lengths):
    return decode.paged_forward(
        q, k, v, table, lengths, softmax_scale=0.1, logits_soft_cap=cap,
        window_left=window, config=None, interpret=False)

  text = jax.jit(run).trace(q, pages, pages, table, lengths).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "jaxflash_paged_decode" in text


@pytest.mark.parametrize("cfg", [
    dict(),
    pytest.param(dict(persistent=True, intra_wg_overlap=True,
                      item_overlap=True), marks=pytest.mark.slow),
    pytest.param(dict(bwd_paired_dq=True), marks=pytest.mark.slow)],
    ids=["default", "persistent-chained", "paired-dq"])
def test_mosaic_flashmask_gap_lowers_for_cuda(cfg):
  """The Hopper forward and backward over a shared question (each
  answer's query groups skip the other answers' key tiles: the gap walk
  of the forward and dQ kernels) lower through Mosaic GPU for CUDA in GPU
  configurations."""
  import jaxflash
  from jaxflash import mosaic_gpu
  t, h, d = 2048, 4, 128
  q = jax.ShapeDtypeStruct((2, t, h, d), jnp.bfloat16)
  ids = jnp.minimum(jnp.arange(t) // (t // 4), 3)[None]
  cols = jaxflash.flashmask.columns(
      jaxflash.FlashMask.shared_question(ids).explicit())
  config = mosaic_gpu.MosaicConfig(**cfg)

  def loss(q, k, v):
    out, _ = mosaic_attention(q, k, v, mask=MaskSpec(t, t, False),
                              arrays=MaskArrays(flash_mask=cols),
                              softmax_scale=0.125, config=config)
    return out.astype(jnp.float32).sum()

  assert _grad_kernels(loss, q, q, q) == ["mosaic_gpu_v2"] * 3


@pytest.mark.parametrize("q_len,heads,kv_heads,head_dim,page,kw", [
    (1, 32, 8, 128, 16, {}),
    (40, 32, 8, 128, 64, {}),
    pytest.param(1, 8, 8, 64, 32, dict(logits_soft_cap=30.0,
                                       window_left=100),
                 marks=pytest.mark.slow),
    pytest.param(1, 8, 1, 256, 16, {}, marks=pytest.mark.slow),
], ids=["d128-p16", "d128-chunk40-p64", "d64-window-softcap", "d256-mqa"])
def test_hopper_paged_decode_lowers_for_cuda(q_len, heads, kv_heads,
                                             head_dim, page, kw):
  """The Hopper paged kernel (jaxflash.mosaic_gpu.decode) lowers through
  Mosaic GPU for CUDA at its default rings (which fit its shared
  memory: Mosaic GPU checks), several row tiles included."""
  from jaxflash.mosaic_gpu import decode
  q = jax.ShapeDtypeStruct((2, q_len, heads, head_dim), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((70, page, kv_heads, head_dim), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((2, 33), jnp.int32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

  def run(q, k, v, table, lengths):
    return decode.paged_forward(
        q, k, v, table, lengths, softmax_scale=0.1,
        **{"logits_soft_cap": None, "window_left": None, **kw},
        config=None, interpret=None)

  text = jax.jit(run).trace(q, pages, pages, table, lengths).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# Every commit: 80 and 96 (the released models' head_dims); the rest slow.
_OWN_DIMS_EVERY_COMMIT = {(80, True, 2048), (96, False, 8192)}


@pytest.mark.parametrize("head_dim,causal,kv_len", [
    pytest.param(d, c, s, marks=() if (d, c, s) in _OWN_DIMS_EVERY_COMMIT
                 else pytest.mark.slow)
    for d in (32, 48, 80, 96, 112, 160)
    for c, s in ((True, 2048), (False, 1024), (False, 8192), (True, 16384))])
def test_mosaic_lowers_at_its_own_head_dims(head_dim, causal, kv_len):
  """Head_dims that 64 does not divide run the kernels at the head_dim
  rounded up to 16 (config.kernel_head_dim), with narrower swizzles: the
  H200 entry's configs (each rule's form) lower for CUDA there, forward
  and backward (at 160 the Triton backward)."""
  from jaxflash import mosaic_gpu
  dp = kernel_head_dim(head_dim)
  assert dp == -(-head_dim // 16) * 16
  cfg = mosaic_gpu.default_config("NVIDIA H200", dp, causal=causal,
                                  kv_len=kv_len)
  mask = MaskSpec(kv_len, kv_len, causal, None, None, None)
  q = jax.ShapeDtypeStruct((1, kv_len, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, kv_len, 2, head_dim), jnp.bfloat16)

  def loss(q, k, v):
    out = mosaic_attention(q, k, v, mask=mask, arrays=MaskArrays(),
                           softmax_scale=head_dim ** -0.5, config=cfg)[0]
    return out.astype(jnp.float32).sum()

  text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("fake_gpu", ["H100"], indirect=True)
def test_fp8_forward_lowers_to_triton(fake_gpu):
  """The FP8 forward (jaxflash.fp8 through the Triton kernel) lowers to
  Triton IR for an H100 with FP8 operands (P rounded to e4m3 for the P V
  product), per-head scales, a causal mask and lengths.  (Triton lowers
  no FP8 on an A100, and no e4m3 x e5m2 product: the kernel takes e4m3
  alone.)"""
  from jaxflash.triton import backend as triton_backend
  q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.float8_e4m3fn)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.float8_e4m3fn)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  dequant = jax.ShapeDtypeStruct((8, 2), jnp.float32)

  def run(q, k, v, lens, dequant):
    return triton_backend.forward_fp8(
        q, k, v, MaskArrays(None, None, None, lens),
        mask=MaskSpec(300, 300, True), softmax_scale=0.088,
        logits_soft_cap=None, dequant=dequant, out_dtype=jnp.bfloat16)

  text = jax.jit(run).trace(q, kv, kv, lens, dequant).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "jaxflash_fwd" in text


@pytest.mark.parametrize("fake_gpu", ["H100"], indirect=True)
def test_paged_fp8_cache_lowers_to_triton(fake_gpu):
  """The paged kernel over an e4m3 cache with per-head scales lowers to
  Triton IR for an H100 (pages widened to bfloat16 on chip)."""
  from jaxflash.triton import decode
  q = jax.ShapeDtypeStruct((2, 1, 8, 128), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((40, 16, 2, 128), jnp.float8_e4m3fn)
  table = jax.ShapeDtypeStruct((2, 13), jnp.int32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  scales = jax.ShapeDtypeStruct((2, 2), jnp.float32)

  def run(q, k, v, table, lengths, scales):
    return decode.paged_forward(
        q, k, v, table, lengths, softmax_scale=0.1, logits_soft_cap=None,
        window_left=None, config=None, interpret=False, kv_scales=scales)

  text = jax.jit(run).trace(q, pages, pages, table, lengths, scales).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "jaxflash_paged_decode" in text


@pytest.mark.parametrize("fake_gpu", ["H100"], indirect=True)
@pytest.mark.parametrize("fp8_latent", [False, True], ids=["bf16", "fp8"])
def test_mla_lowers_to_triton(fake_gpu, fp8_latent):
  """Latent attention at DeepSeek's widths (576 / 512, pages of 64) lowers
  to Triton IR for an H100: the latent block read once for both
  products, and FlashMLA's FP8 latent (four 128-column blocks
  dequantized by their tokens' scales, the rotary columns apart)."""
  from jaxflash.triton import decode
  q = jax.ShapeDtypeStruct((2, 1, 128, 576), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((2, 13), jnp.int32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  if fp8_latent:
    pages = (jax.ShapeDtypeStruct((40, 64, 1, 512), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((40, 64, 4), jnp.float32),
             jax.ShapeDtypeStruct((40, 64, 1, 64), jnp.bfloat16))
  else:
    pages = (jax.ShapeDtypeStruct((40, 64, 1, 576), jnp.bfloat16),)

  def run(q, table, lengths, k, *fp8):
    extra = (dict(latent_scales=fp8[0], rope_pages=fp8[1]) if fp8 else {})
    return decode.paged_forward(
        q, k, None, table, lengths, softmax_scale=192 ** -0.5,
        logits_soft_cap=None, window_left=None, config=None,
        interpret=False, v_head_dim=512, **extra)

  text = jax.jit(run).trace(q, table, lengths, *pages).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "jaxflash_paged_decode" in text


@pytest.mark.parametrize("fake_gpu", ["H100"], indirect=True)
def test_dropout_lowers_to_triton(fake_gpu):
  """Attention dropout's hash (uint32 multiplies, xors, shifts) in the
  forward and both backward kernels lowers to Triton IR."""
  q = jax.ShapeDtypeStruct((2, 300, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.bfloat16)
  seeds = jax.ShapeDtypeStruct((2, 4), jnp.int32)  # seed, first head/row/key
  mask = MaskSpec(300, 300, True)

  def loss(q, k, v, seeds):
    out, lse = triton_attention(
        q, k, v, mask=mask, arrays=MaskArrays(dropout_seeds=seeds),
        softmax_scale=0.125, dropout_rate=0.1)
    return out.astype(jnp.float32).sum()

  text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, seeds).lower(
      lowering_platforms=("cuda",)).as_text()
  for name in ("jaxflash_fwd", "jaxflash_bwd_dkv", "jaxflash_bwd_dq"):
    assert name in text


@pytest.mark.parametrize("fake_gpu", ["H100"], indirect=True)
def test_dense_terms_lower_to_triton(fake_gpu):
  """A dense bias (its gradient too), a dense mask with its tile summary,
  FlashMask columns and ALiBi slopes, all at once in the forward and both
  backward kernels, lower to Triton IR for an H100 (GQA 8:2, 300
  tokens)."""
  from jaxflash import FlashMask, flashmask
  q = jax.ShapeDtypeStruct((2, 300, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 8, 300, 300), jnp.float32)
  dense = jax.ShapeDtypeStruct((2, 1, 300, 300), jnp.bool_)
  seg = jax.ShapeDtypeStruct((2, 300), jnp.int32)
  slopes = jax.ShapeDtypeStruct((1, 8, 1, 2), jnp.float32)
  mask = MaskSpec(300, 300, True)

  def loss(q, k, v, bias, dense, seg, slopes):
    cols = flashmask.columns(FlashMask.causal_document(seg).check(
        2, 8, 300, 300))
    out, lse = triton_attention(
        q, k, v, mask=mask, softmax_scale=0.125, arrays=MaskArrays(
            bias=bias, dense_mask=dense, flash_mask=cols,
            alibi_slopes=slopes))
    return out.astype(jnp.float32).sum()

  text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(
      q, kv, kv, bias, dense, seg, slopes).lower(
          lowering_platforms=("cuda",)).as_text()
  for name in ("jaxflash_fwd", "jaxflash_bwd_dkv", "jaxflash_bwd_dq"):
    assert name in text


@pytest.mark.parametrize("cfg", [
    pytest.param(dict(), id="default"),
    pytest.param(dict(named_barriers=True, intra_wg_overlap=True,
                      block_kv=128, consumer_registers=240, persistent=True,
                      prefetch_q=True, lean_epilogue=True),
                 id="overlap-persistent", marks=pytest.mark.slow),
    pytest.param(dict(named_barriers=True, compute_wgs=3, block_kv=128,
                      bwd_paired_dkv=True, bwd_paired_dq=True),
                 id="three-wg-paired", marks=pytest.mark.slow),
    pytest.param(dict(bwd_atomic_dq=True, bwd_softmax_overlap=True,
                      bwd_early_dv=True), id="atomic-dq",
                 marks=pytest.mark.slow),
])
def test_mosaic_flashmask_lowers_for_cuda(cfg):
  """A FlashMask shared by the heads in the Hopper forward, dQ and dK/dV
  kernels: its columns' loads into the score tiles' layouts lower to
  Mosaic GPU IR (d128, GQA, causal)."""
  from jaxflash import mosaic_gpu
  q, kv, _, _, mask = _mosaic_case((1024, 1024, 8, 2, 128, True, None))
  cols = jax.ShapeDtypeStruct((2, 1, 4, 1024), jnp.int32)
  config = mosaic_gpu.MosaicConfig(**cfg)

  def loss(q, k, v, cols):
    out, lse = mosaic_attention(q, k, v, mask=mask,
                                arrays=MaskArrays(flash_mask=cols),
                                softmax_scale=0.125, config=config)
    return out.astype(jnp.float32).sum() + jnp.where(
        jnp.isfinite(lse), lse, 0).sum()

  text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, cols).lower(
      lowering_platforms=("cuda",)).as_text()
  kernels = re.findall(r"custom_call @(\w+)", text)
  assert kernels == ["mosaic_gpu_v2"] * (3 - config.bwd_atomic_dq), kernels


_TERM_CONFIGS = [
    ("default", dict()),
    ("overlap-persistent",
     dict(named_barriers=True, intra_wg_overlap=True, block_kv=128,
          consumer_registers=240, persistent=True, prefetch_q=True,
          lean_epilogue=True)),
    ("three-wg", dict(named_barriers=True, compute_wgs=3, block_kv=128)),
]


@pytest.mark.parametrize("term,cfg", [
    pytest.param(term, cfg, id=f"{term}-{name}", marks=(
        [pytest.mark.slow] if term == "dropout" and name != "default"
        else []))
    for term in ("alibi", "dropout") for name, cfg in _TERM_CONFIGS])
def test_mosaic_forward_terms_lower_for_cuda(term, cfg):
  """ALiBi (slopes read per item, the bias tile from the index vectors)
  and attention dropout (the keep mask's uint32 hash on the tile's
  positions, P scaled before P V) in the Hopper forward lower to Mosaic
  GPU IR (d128, GQA, causal)."""
  from jaxflash import mosaic_gpu
  q, kv, _, _, mask = _mosaic_case((1024, 1024, 8, 2, 128, True, None))
  if term == "alibi":
    extra = jax.ShapeDtypeStruct((1, 8, 1, 2), jnp.float32)
    arrays, kw = lambda x: MaskArrays(alibi_slopes=x), {}
  else:
    extra = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    arrays, kw = lambda x: MaskArrays(dropout_seeds=x), dict(
        dropout_rate=0.1)
  config = mosaic_gpu.MosaicConfig(**cfg)

  def fwd(q, k, v, x):
    return mosaic_attention(q, k, v, mask=mask, arrays=arrays(x),
                            softmax_scale=0.125, config=config, **kw)[0]

  text = jax.jit(fwd).trace(q, kv, kv, extra).lower(
      lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize("shape,cfg", [
    ((1024, 1024, 8, 2, 128, True, None), dict()),
    pytest.param((1024, 1024, 8, 2, 128, False, None),
                 dict(named_barriers=True, intra_wg_overlap=True,
                      block_kv=64, consumer_registers=240, persistent=True,
                      prefetch_q=True, lean_epilogue=True,
                      kv_multicast=True), marks=pytest.mark.slow),
    pytest.param((512, 700, 4, 4, 64, True, None),
                 dict(block_kv=128, item_overlap=True, persistent=True),
                 marks=pytest.mark.slow),
    pytest.param((512, 512, 4, 2, 192, False, None),
                 dict(block_q=64, block_kv=64), marks=pytest.mark.slow),
    ((512, 700, 4, 2, 256, True, None), dict(intra_wg_overlap=True)),
    ((1000, 1500, 4, 2, 128, True, None), dict(unpadded_kv=True,
                                               unpadded_q=True)),
], ids=["d128-default", "d128-overlap-persistent", "d64-item-overlap",
        "d192", "d256-key-row", "d128-unpadded"])
def test_mosaic_bias_forward_lowers_for_cuda(shape, cfg):
  """A dense bias in the Hopper forward (its tiles by TMA beside V, read
  in the wgmma layout of S; at head_dim 256 one row of keys for every
  query, read from GMEM) lowers to Mosaic GPU IR."""
  rows = 1 if shape[4] == 256 else shape[0]
  _assert_forward_lowers(shape, cfg, bias=jax.ShapeDtypeStruct(
      (2, shape[2], rows, shape[1]), jnp.bfloat16))


@pytest.mark.parametrize("d,cfg", [
    (128, dict(bwd_stats_in_acc=True, bwd_softmax_overlap=True,
               bwd_consumer_registers=240, bwd_early_dv=True)),
    pytest.param(128, dict(bwd_stats_in_acc=True, bwd_softmax_overlap=True,
                           bwd_consumer_registers=240, bwd_early_dv=True,
                           bwd_dkv_block_q=80), marks=pytest.mark.slow),
    (64, dict(bwd_atomic_dq=True)),
], ids=["d128-tuned", "d128-dkv-q80", "d64-atomic"])
@pytest.mark.parametrize("terms", ["bias-rows-dropout", "mask-alibi-keybias"])
def test_mosaic_backward_terms_lower_for_cuda(d, cfg, terms):
  """The Hopper backward with the dense terms and dropout lowers to Mosaic
  GPU IR in the tuned GPU configs (registers as wgmma A operands, the
  statistics in the accumulators, the overlapped order; an atomic-dQ
  config gives its dQ kernel back to the dense bias's gradient): a
  per-head bias with its gradient and dropout (at 64 without: the
  Triton backward's there); a dense mask, ALiBi and a key padding
  bias."""
  from jaxflash import mosaic_gpu
  q, kv, _, _, mask = _mosaic_case((1000, 1500, 8, 2, d, True, None))
  config = mosaic_gpu.MosaicConfig(**cfg)
  seeds = jnp.zeros((2, 4), jnp.int32)
  if terms == "bias-rows-dropout":
    extra = jax.ShapeDtypeStruct((1, 8, 1000, 1500), jnp.float32)
    arrays = lambda x: MaskArrays(bias=x, dropout_seeds=seeds)
    # (Dropout's backward below head_dim 128 is the Triton kernels'.)
    kw = dict(dropout_rate=0.1) if d >= 128 else {}
    assert mosaic_gpu.serves_backward(
        q, kv, mask=mask, config=config, dropout_rate=0.1) == (d >= 128)
  else:
    extra = jax.ShapeDtypeStruct((2, 1, 1000, 1500), jnp.bool_)
    slopes = jnp.zeros((1, 8, 1, 2), jnp.float32)
    key_bias = jnp.zeros((2, 1, 1, 1500), jnp.float32)
    arrays = lambda x: MaskArrays(dense_mask=x, alibi_slopes=slopes,
                                  bias=key_bias)
    kw = {}

  def loss(q, k, v, x):
    out, _ = mosaic_attention(q, k, v, mask=mask, arrays=arrays(x),
                              softmax_scale=0.125, config=config, **kw)
    return out.astype(jnp.float32).sum()

  argnums = (0, 1, 2, 3) if extra.dtype == jnp.float32 else (0, 1, 2)
  text = jax.jit(jax.grad(loss, argnums)).trace(q, kv, kv, extra).lower(
      lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"] * 3


def _assert_forward_lowers(shape, cfg, **term):
  """The Hopper forward of a ``_mosaic_case`` shape with ``cfg`` and the
  abstract mask array ``term`` (a MaskArrays field) lowers to one Mosaic
  GPU kernel."""
  from jaxflash import mosaic_gpu
  q, kv, _, _, mask = _mosaic_case(shape)
  config = mosaic_gpu.MosaicConfig(**cfg)
  (name, x), = term.items()

  def fwd(q, k, v, x):
    return mosaic_attention(q, k, v, mask=mask,
                            arrays=MaskArrays(**{name: x}),
                            softmax_scale=0.125, config=config)[0]

  text = jax.jit(fwd).trace(q, kv, kv, x).lower(
      lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]


def test_bias_ring_fits_the_tuned_configs():
  """Every tuned forward config up to MAX_BIAS_HEAD_DIM fits the bias's
  ring as it is or after with_bias_ring's steps; a config given by the
  caller that does not fit is refused, as is head_dim 256."""
  import json

  from jaxflash import mosaic_gpu
  from jaxflash.mosaic_gpu import backend
  from jaxflash.mosaic_gpu import config as cfg_lib
  tuning = json.loads(importlib.resources.files("jaxflash.mosaic_gpu")
                      .joinpath("tuning.json").read_text())
  for kind in (*tuning["devices"], *tuning["aliases"]):
    for dp in (64, 80, 96, 128, 192):
      for causal in (False, True):
        for kv_len in (1024, 8192):
          tuned = cfg_lib.default_config(kind, dp, causal=causal,
                                         kv_len=kv_len)
          fitted = cfg_lib.with_bias_ring(tuned, dp)
          assert fitted is not None, (kind, dp, causal, kv_len)
          assert fitted.smem_bytes(dp, bias=True) <= cfg_lib.SMEM_LIMIT
  q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  arrays = MaskArrays(bias=jnp.zeros((1, 2, 256, 256)))
  big = mosaic_gpu.MosaicConfig(block_kv=128, stages=3)
  with pytest.raises(NotImplementedError, match="dense bias's ring needs"):
    backend.check_supported(q, q, q, arrays=arrays, logits_soft_cap=None,
                            config=big, interpret=True)
  q256 = jnp.zeros((1, 256, 2, 256), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="at head_dim 256"):
    backend.check_supported(q256, q256, q256, arrays=arrays,
                            logits_soft_cap=None, config=None,
                            interpret=True)


@pytest.mark.parametrize("head_dim,causal,kv_len,cfg", [
    (128, True, 1000, None),
    (128, False, 8192, None),
    (64, False, 1000, None),
    (256, True, 1000, dict(intra_wg_overlap=True, persistent=True,
                           prefetch_q=True)),
], ids=["d128-causal-tuned", "d128-tuned-wide", "d64-tuned",
        "d256-overlap-prefetch"])
def test_mosaic_fp8_forward_lowers_for_cuda(head_dim, causal, kv_len, cfg):
  """The Hopper FP8 forward (e4m3 Q K^T, V^T's tiles K-major, P in e4m3
  through shared memory, O accumulated in the wgmma registers: the GPU
  form the interpreter does not run) lowers to Mosaic GPU IR, in the
  default configs (256-key tiles at 128 from 8192 keys)."""
  from jaxflash import mosaic_gpu
  from jaxflash.mosaic_gpu import backend as mosaic_backend
  q = jax.ShapeDtypeStruct((2, 1024, 8, head_dim), jnp.float8_e4m3fn)
  kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), jnp.float8_e4m3fn)
  dequant = jax.ShapeDtypeStruct((8, 2), jnp.float32)
  config = None if cfg is None else mosaic_gpu.MosaicConfig(**cfg)

  def run(q, k, v, dequant):
    return mosaic_backend.forward_fp8(
        q, k, v, MaskArrays(), mask=MaskSpec(1024, kv_len, causal),
        softmax_scale=head_dim ** -0.5, logits_soft_cap=None,
        dequant=dequant, out_dtype=jnp.bfloat16, config=config)

  text = jax.jit(run).trace(q, kv, kv, dequant).lower(
      lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize("shape,rows,per_head,cfg", [
    ((1024, 1500, 8, 2, 128, True, None), True, False,
     dict(unpadded_kv=True, unpadded_q=True)),
    ((512, 512, 4, 4, 64, False, None), True, True,
     dict(intra_wg_overlap=True, persistent=True, prefetch_q=True)),
    ((512, 700, 4, 2, 256, True, None), False, False,
     dict(intra_wg_overlap=True)),
], ids=["d128-unpadded", "d64-heads-persistent", "d256-key-row"])
def test_mosaic_dense_mask_forward_lowers_for_cuda(shape, rows, per_head,
                                                   cfg):
  """A dense boolean mask in the Hopper forward (its tiles read from GMEM
  as int8 in the wgmma layout of S, or one row of keys; its tile ranges in
  the segment inputs) lowers to Mosaic GPU IR."""
  _assert_forward_lowers(shape, cfg, dense_mask=jax.ShapeDtypeStruct(
      (2, shape[2] if per_head else 1, shape[0] if rows else 1, shape[1]),
      jnp.bool_))


# A 16-bit 4-D array in a lowered program's text (Q, K, V, O, dO or a
# gradient: [B, T, H, D]; dQ's float32 buffer is whole tiles long).
_BTHD = re.compile(r"tensor<\d+x\d+x\d+x\d+x(bf16|f16)>")


@pytest.mark.parametrize("seq,heads,kv_heads,head_dim,causal", [
    (577, 2, 2, 64, False),  # ViT-B/16's 24 x 24 patches and a class token
    pytest.param(257, 2, 2, 32, True, marks=pytest.mark.slow),
], ids=["vit577", "d32-causal"])
def test_rows_lower_with_no_copy(seq, heads, kv_heads, head_dim, causal):
  """At a length that 8 does not divide, the tuned head_dim 64 configs
  (unpadded_q, unpadded_kv) copy Q, K, V, O, dO and the gradients by
  TMA through row views (pipeline.row_buffer): the lowered forward and
  gradient pad and slice no 16-bit ``[B, T, H, D]`` array (dQ's float32
  buffer and the row statistics stay whole tiles long), and the kernels
  lower with TMA boxes past the arrays' ends.  With the paired dQ kernel
  (no row views) the backward pads its operands and slices its
  gradients again."""
  import dataclasses

  from jaxflash import mosaic_gpu
  mask = MaskSpec(seq, seq, causal, None, None, None)
  q = jax.ShapeDtypeStruct((2, seq, heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, seq, kv_heads, head_dim), jnp.bfloat16)
  tuned = mosaic_gpu.default_config("NVIDIA H200", 64, causal=causal,
                                    kv_len=seq)
  assert tuned.unpadded_q and tuned.unpadded_kv

  def copies(config):
    def loss(q, k, v):
      out = mosaic_attention(q, k, v, mask=mask, arrays=MaskArrays(),
                             softmax_scale=head_dim ** -0.5,
                             config=config)[0]
      return out.astype(jnp.float32).sum()
    text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(
        q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return [line for line in text.splitlines()
            if re.search(r"stablehlo\.(pad|slice)", line)
            and _BTHD.search(line)]

  assert copies(tuned) == []
  paired = dataclasses.replace(tuned, bwd_paired_dq=True,
                               bwd_atomic_dq=False)
  assert sum("stablehlo.slice" in line
             for line in copies(paired)) == 3  # dQ, dK and dV
