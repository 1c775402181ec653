"""Context parallelism without ceremony: flash_attention under ``jit``
with q, k, v sharded on the sequence axis runs ring attention by itself
(8 CPU devices, interpret kernels): results equal the unsharded call,
the compiled module passes key/value blocks by collective-permute and
gathers nothing, and what the ring cannot serve is refused by name."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflash

TILES = jaxflash.TritonConfig(block_q=16, block_k=16, block_q_dkv=16,
                              block_k_dkv=16, block_q_dq=16, block_k_dq=16)


def _need_devices():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets 8 CPU devices)")


def _inputs(heads=4, kv_heads=2, seq=64):
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (2, seq, heads, 16))
  k = jax.random.normal(kk, (2, seq, kv_heads, 16))
  v = jax.random.normal(kv, (2, seq, kv_heads, 16))
  do = jax.random.normal(kd, q.shape)
  seg = jnp.asarray([[0] * 20 + [1] * (seq - 20), [0] * seq], jnp.int32)
  return q, k, v, do, seg


def _run(causal, **kw):
  def run(q, k, v, do, seg):
    f = lambda q, k, v: jaxflash.flash_attention(
        q, k, v, causal=causal, segment_ids=seg, implementation="triton",
        interpret=True, config=TILES, **kw)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))
  return jax.jit(run)


CASES = [
    # (mesh shape, names, q spec, causal, axis type)
    pytest.param((8,), ("context",), P(None, "context"), True,
                 AxisType.Auto, id="8-seq-causal-Auto",
                 marks=pytest.mark.slow),
    pytest.param((2, 4), ("data", "context"), P("data", "context"), False,
                 AxisType.Explicit, id="2x4-batch-seq-Explicit",
                 marks=pytest.mark.slow),
    pytest.param((4, 2), ("context", "tensor"),
                 P(None, "context", "tensor"), True, AxisType.Explicit,
                 id="4x2-seq-heads-causal-Explicit", marks=pytest.mark.slow),
    pytest.param((2, 4), ("data", "context"), P("data", "context"), True,
                 AxisType.Auto, id="2x4-batch-seq-causal-Auto",
                 marks=pytest.mark.slow),
    pytest.param((8,), ("context",), P(None, "context"), False,
                 AxisType.Explicit, id="8-seq-Explicit",
                 marks=pytest.mark.slow),
]


def _check(mesh_shape, names, spec, causal, axis_type, mode, **kw):
  """The sharded call equals the one-device one (GQA 4:2, segment ids);
  the sequence stays sharded; returns the compiled module's text."""
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(
      names))
  q, k, v, do, seg = _inputs()
  want = _run(causal, **kw)(q, k, v, do, seg)
  spec = P(*spec, *(None,) * (4 - len(spec)))
  kv_spec = P(spec[0], spec[1], spec[2], None)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = (put(q, spec), put(k, kv_spec), put(v, kv_spec), put(do, spec),
          put(seg, P(spec[0], spec[1])))
  run = _run(causal, context_parallel=mode, **kw)
  got = run(*args)
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=2e-5)
  assert got[0].sharding.spec[1] == spec[1]
  return run.lower(*args).compile().as_text()


@pytest.mark.parametrize("mesh_shape,names,spec,causal,axis_type", CASES)
def test_sequence_sharded_runs_the_ring(mesh_shape, names, spec, causal,
                                        axis_type):
  """Forward and gradients equal the one-device call; the module holds
  collective-permutes and no all-gather (GQA 2:1 takes the ring)."""
  _need_devices()
  hlo = _check(mesh_shape, names, spec, causal, axis_type, None)
  assert "collective-permute" in hlo
  assert "all-gather" not in hlo


@pytest.mark.parametrize("axis_type,kw", [
    # (per commit: test_queries_and_keys_of_different_lengths)
    pytest.param(AxisType.Auto, {}, marks=pytest.mark.slow),
    pytest.param(AxisType.Explicit, dict(local_window_size=(9, 0)),
                 marks=pytest.mark.slow),
    pytest.param(AxisType.Explicit, {}, marks=pytest.mark.slow),
    pytest.param(AxisType.Auto, dict(local_window_size=(9, 0),
                                      kv_seq_lengths=jnp.asarray([64, 40])),
                 marks=pytest.mark.slow),
    pytest.param(AxisType.Explicit, dict(q_seq_lengths=jnp.asarray([50, 9]),
                                          kv_seq_lengths=jnp.asarray([64,
                                                                      40])),
                 marks=pytest.mark.slow),
    pytest.param(AxisType.Explicit, dict(alibi_slopes=jnp.asarray(
        [0.5, 0.25, 0.125, 0.0625])), marks=pytest.mark.slow)],
    ids=["Auto", "Explicit-window", "Explicit", "Auto-window-lengths",
         "Explicit-lengths", "Explicit-alibi"])
def test_allgather_mode(axis_type, kw):
  """context_parallel="allgather" (and the rule's choice for a window):
  K/V gathered once, each device's query pieces (causal: zig-zag halves,
  moved by ppermutes) masked at their global offsets; the backward
  returns each device its dK/dV by a reduce-scatter."""
  _need_devices()
  mode = (None if "local_window_size" in kw or "alibi_slopes" in kw
          else "allgather")
  hlo = _check((2, 4), ("data", "context"), P("data", "context"), True,
               axis_type, mode, **kw)
  assert "all-gather" in hlo
  assert "reduce-scatter" in hlo


def _cross_inputs(q_len=32, kv_len=64):
  ks = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(ks[0], (2, q_len, 4, 16))
  k = jax.random.normal(ks[1], (2, kv_len, 2, 16))
  v = jax.random.normal(ks[2], (2, kv_len, 2, 16))
  do = jax.random.normal(ks[3], q.shape)
  seg = (jnp.asarray([[0] * 10 + [1] * (q_len - 10), [0] * q_len]),
         jnp.asarray([[0] * 30 + [1] * (kv_len - 30), [0] * kv_len]))
  return q, k, v, do, seg


@pytest.mark.parametrize("entry,causal,axis_type", [
    ("flash_attention", True, AxisType.Explicit),
    pytest.param("dot_product_attention", True, AxisType.Auto,
                 marks=pytest.mark.slow),
    pytest.param("flash_attention", False, AxisType.Auto,
                 marks=pytest.mark.slow)],
    ids=["bottom-right-Explicit", "top-left-Auto", "full-Auto"])
def test_queries_and_keys_of_different_lengths(entry, causal, axis_type):
  """32 queries over 64 keys (a prefix before the queries, or
  cross-attention), both sequence-sharded over 4 devices: the rule takes
  the all-gather, each device's query pieces at their global rows under
  the call's alignment (flash_attention: bottom-right;
  dot_product_attention: top-left), segment ids of both lengths; equal to
  the one-device call, forward and gradients."""
  _need_devices()
  q, k, v, do, (qs, ks) = _cross_inputs()

  def attend(q, k, v):
    if entry == "flash_attention":
      return jaxflash.flash_attention(
          q, k, v, causal=causal, segment_ids=(qs, ks),
          implementation="triton", interpret=True, config=TILES)
    return jaxflash.dot_product_attention(
        q, k, v, is_causal=causal, query_seq_lengths=jnp.asarray([32, 20]),
        key_value_seq_lengths=jnp.asarray([64, 41]),
        implementation="triton", interpret=True, config=TILES)

  def run(q, k, v, do):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(do))

  want = jax.jit(run)(q, k, v, do)
  mesh = jax.make_mesh((2, 4), ("data", "context"),
                       axis_types=(axis_type,) * 2)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data",
                                                          "context")))
  args = tuple(put(x) for x in (q, k, v, do))
  got = jax.jit(run)(*args)
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=2e-5)
  assert got[0].sharding.spec[1] == "context"
  hlo = jax.jit(run).lower(*args).compile().as_text()
  assert "all-gather" in hlo
  assert "reduce-scatter" in hlo


def test_the_ring_refuses_queries_and_keys_of_different_lengths():
  _need_devices()
  mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Explicit,))
  q, k, v, _, _ = _cross_inputs()
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None,
                                                          "context")))
  attend = lambda ctx, q, k, v: jaxflash.flash_attention(
      q, k, v, causal=True, implementation="triton", interpret=True,
      config=TILES, context_parallel=ctx)
  with pytest.raises(ValueError, match=r"q_len=32, kv_len=64 with query 0"
                     r" aligned to key 32 \(the ring: self-attention"):
    jax.jit(functools.partial(attend, "ring"))(put(q), put(k), put(v))
  q12 = jax.device_put(jnp.zeros((2, 12, 4, 16)), NamedSharding(
      jax.make_mesh((4, 2), ("context", "x"),
                    axis_types=(AxisType.Explicit,) * 2),
      P(None, "context")))
  with pytest.raises(ValueError, match=r"kv_len=66 is not divisible by the"
                     r" 4 devices"):
    jax.jit(functools.partial(attend, None))(
        q12, jnp.zeros((2, 66, 2, 16)), jnp.zeros((2, 66, 2, 16)))


@pytest.mark.slow  # (per commit: test_global_position_terms' window)
@pytest.mark.parametrize("causal,window,axis_type", [
    (True, (9, 0), AxisType.Auto), (False, (9, 5), AxisType.Explicit),
], ids=["causal-Auto", "two-sided-Explicit"])
def test_ring_carries_a_window(causal, window, axis_type):
  """A local window on the ring (context_parallel="ring"; the rule sends
  windows to the all-gather): carried as FlashMask columns over the
  global sequence, which each block pair reads at its own offset, so the
  sharded call equals the one-device one (a ring of 4 in zig-zag
  order)."""
  _need_devices()
  hlo = _check((2, 4), ("data", "context"), P("data", "context"), causal,
               axis_type, "ring", local_window_size=window)
  assert "collective-permute" in hlo and "all-gather" not in hlo


def test_the_rule():
  from jaxflash import _context
  assert _context.choose(None, 32, 8, False) == "allgather"  # GQA 4:1
  assert _context.choose(None, 32, 16, False) == "ring"
  assert _context.choose(None, 32, 32, True) == "allgather"  # a window
  assert _context.choose("ring", 32, 8, False) == "ring"
  with pytest.raises(ValueError, match="context_parallel='gather' must be"):
    jaxflash.flash_attention(*_inputs()[:3], context_parallel="gather")


def test_what_the_ring_cannot_serve_is_named():
  _need_devices()
  mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Auto,))
  q, k, v, do, seg = _inputs()
  put = lambda x: jax.device_put(x, NamedSharding(
      mesh, P(None, "context", *(None,) * (x.ndim - 2))))
  with pytest.raises(Exception, match=r"sequence axis is sharded over mesh"
                     r" axis \('context',\): context parallelism \(ring\)"
                     r" .* not local_window_size with a FlashMask"):
    _run(True, local_window_size=8, context_parallel="ring",
         mask=jaxflash.FlashMask.prefix_lm(jnp.asarray([12, 21]), 64))(
        put(q), put(k), put(v), put(do), put(seg))


def test_zigzag_moves_match_zigzag_indices():
  """Two half-block ppermutes take contiguous blocks to the zig-zag order
  of ``ring.zigzag_indices`` and back."""
  _need_devices()
  from jaxflash import _context
  from jaxflash.ring import zigzag_indices
  mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Auto,))
  x = jnp.arange(2 * 64, dtype=jnp.float32).reshape(2, 64)
  spec = P(None, "context")
  there = jax.shard_map(
      lambda x: _context.to_zigzag(x, "context", 8), mesh=mesh,
      in_specs=spec, out_specs=spec)(x)
  np.testing.assert_array_equal(there, x[:, zigzag_indices(64, 8)])
  back = jax.shard_map(
      lambda x: _context.from_zigzag(x, "context", 8), mesh=mesh,
      in_specs=spec, out_specs=spec)(there)
  np.testing.assert_array_equal(back, x)


def _dense_terms(kind: str, seq: int = 32, heads: int = 2):
  """flash_attention keywords of one kind of global-position term."""
  kb, km = jax.random.split(jax.random.key(1))
  if kind == "bias-rows":      # [B, H, T, S]: rows sharded with q
    return dict(bias=jax.random.normal(kb, (2, heads, seq, seq)))
  if kind == "bias-broadcast":  # [1, H, 1, S]: its gradient summed
    return dict(bias=jax.random.normal(kb, (1, heads, 1, seq)))
  if kind == "mask":
    keep = jax.random.bernoulli(km, 0.7, (2, 1, seq, seq))
    return dict(mask=keep | jnp.eye(seq, dtype=bool))
  if kind == "flashmask":
    return dict(mask=jaxflash.FlashMask.prefix_lm(jnp.asarray([12, 21]),
                                                  seq))
  if kind == "flashmask-causal":  # FlashMask's causal mode: folded into
    # the call's causal mask, so the ring takes its causal (zig-zag) order
    ids = jnp.asarray([[0] * 12 + [1] * (seq - 12),
                       [0] * 21 + [1] * (seq - 21)])
    return dict(mask=jaxflash.FlashMask.causal_document(ids))
  if kind == "dropout":
    return dict(dropout_rate=0.25, dropout_rng=jax.random.key(7))
  if kind == "alibi":  # on the ring: the pair's offset as its shift
    return dict(alibi_slopes=jnp.asarray([0.5, 0.125][:heads]))
  if kind == "window":  # on the ring: FlashMask columns
    return dict(local_window_size=(5, 3))
  if kind == "lengths":  # padded rows and keys, across the blocks
    return dict(q_seq_lengths=jnp.asarray([seq - 3, seq // 2 - 5]),
                kv_seq_lengths=jnp.asarray([seq - 7, seq // 2 + 3]))
  raise ValueError(kind)


DENSE_CASES = [
    # (scheme, axis type, causal, terms)
    # (The causal ring per commit: test_gpt's context mesh and the
    # FlashMask ring_attention test below.)
    pytest.param("ring", AxisType.Auto, False, ("bias-rows", "dropout"),
                 id="ring-Auto-bias-dropout"),
    pytest.param("ring", AxisType.Auto, True, ("bias-rows", "dropout"),
                 id="ring-Auto-causal-bias-dropout", marks=pytest.mark.slow),
    pytest.param("allgather", AxisType.Explicit, False, ("flashmask",),
                 id="allgather-Explicit-flashmask"),
    pytest.param("ring", AxisType.Explicit, False, ("flashmask",),
                 id="ring-Explicit-flashmask", marks=pytest.mark.slow),
    pytest.param("allgather", AxisType.Auto, True, ("bias-broadcast",),
                 id="allgather-Auto-causal-bias-broadcast",
                 marks=pytest.mark.slow),
    pytest.param("allgather", AxisType.Explicit, True, ("mask", "dropout"),
                 id="allgather-Explicit-causal-mask-dropout",
                 marks=pytest.mark.slow),
    pytest.param("ring", AxisType.Explicit, True, ("bias-broadcast",),
                 id="ring-Explicit-causal-bias-broadcast",
                 marks=pytest.mark.slow),
    pytest.param("ring", AxisType.Auto, False, ("mask",),
                 id="ring-Auto-mask", marks=pytest.mark.slow),
    pytest.param("ring", AxisType.Explicit, False, ("lengths",),
                 id="ring-Explicit-lengths"),
    pytest.param("ring", AxisType.Auto, False, ("flashmask-causal",),
                 id="ring-Auto-flashmask-causal-mode",
                 marks=pytest.mark.slow),
    pytest.param("ring", AxisType.Auto, False, ("window",),
                 id="ring-Auto-window"),
    pytest.param("ring", AxisType.Auto, False, ("alibi",),
                 id="ring-Auto-alibi"),
    pytest.param("ring", AxisType.Explicit, True, ("alibi",),
                 id="ring-Explicit-causal-alibi", marks=pytest.mark.slow),
    pytest.param("ring", AxisType.Auto, True, ("lengths", "dropout"),
                 id="ring-Auto-causal-lengths-dropout",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mode,axis_type,causal,terms", DENSE_CASES)
def test_global_position_terms(mode, axis_type, causal, terms):
  """Dropout, a dense bias (and its gradient, rows sharded or broadcast)
  or mask, FlashMask, lengths (the ring folds them into segment ids at
  the block's global positions), a window (the ring: as FlashMask
  columns) and ALiBi (the ring: the pair's offset) under both schemes:
  each block pair gets its global rows and keys, so the sharded call
  equals the one-device one
  (same dropout mask included) on a (2, 2) batch x sequence mesh (the
  ring's loop over more devices: test_sequence_sharded_runs_the_ring)."""
  _need_devices()
  kw = {}
  for term in terms:
    kw.update(_dense_terms(term))
  bias = kw.pop("bias", None)
  q, k, v, do, seg = _inputs(heads=2, kv_heads=1, seq=32)

  # The one-device call takes a FlashMask's explicit form (its causal
  # mode as the upper range), the sharded one the mask as given.
  explicit = {n: x.explicit() if isinstance(x, jaxflash.FlashMask) else x
              for n, x in kw.items()}

  def run(q, k, v, do, seg, bias, terms=kw, **extra):
    def f(q, k, v, bias):
      return jaxflash.flash_attention(
          q, k, v, causal=causal, segment_ids=seg, bias=bias,
          implementation="triton", interpret=True, config=TILES, **terms,
          **extra)
    out, vjp = jax.vjp(f, q, k, v, bias)
    return (out, *vjp(do))

  want = jax.jit(functools.partial(run, terms=explicit))(q, k, v, do, seg,
                                                         bias)
  mesh = jax.make_mesh((2, 2), ("data", "context"), devices=jax.devices()[:4],
                       axis_types=(axis_type,) * 2)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  spec = P("data", "context", None, None)
  args = (put(q, spec), put(k, spec), put(v, spec), put(do, spec),
          put(seg, P("data", "context")),
          None if bias is None else put(bias, P()))
  sharded = jax.jit(lambda *a: run(*a, context_parallel=mode))
  got = sharded(*args)
  for a, w in zip(got, want):
    if w is not None:
      np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=3e-5)
  assert got[0].sharding.spec[1] == "context"
  hlo = sharded.lower(*args).compile().as_text()
  if mode == "ring":  # K/V move by collective-permute, nothing is gathered
    # (but a mask's int32 columns, which stay whole on every device)
    gathered = re.findall(r"= (\w+)\[[^\]]*\]\{[^}]*\} all-gather\(", hlo)
    assert "collective-permute" in hlo
    assert all(t in ("s32", "pred") for t in gathered), gathered
  else:
    assert "all-gather" in hlo


def test_ring_attention_takes_a_flashmask():
  """ring_attention (shard_map) with a FlashMask of the whole sequence in
  natural order, blocks in zig-zag order: equals flash_attention."""
  _need_devices()
  from jaxflash.ring import zigzag_indices
  from jaxflash.sharding import ring_attention
  q, k, v, do, _ = _inputs(heads=2, kv_heads=2)
  mask = jaxflash.FlashMask.causal_document(
      jnp.asarray([[0] * 20 + [1] * 44, [0] * 50 + [1] * 14], jnp.int32))
  f = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, mask=mask, implementation="triton", interpret=True,
      config=TILES)
  def out_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))

  want = jax.jit(functools.partial(out_and_grads, f))(q, k, v, do)
  mesh = jax.make_mesh((2,), ("context",), devices=jax.devices()[:2],
                       axis_types=(AxisType.Auto,))
  order = zigzag_indices(64, 2)
  spec = P(None, "context")

  def ring(q, k, v):
    return ring_attention(q, k, v, axis_name="context", causal=True,
                          mask=mask, implementation="triton",
                          interpret=True, config=TILES)

  # check_vma=False: jax 0.11.2's Pallas interpreter fails the vma check
  # of data-dependent tile loops (tests/test_ring.py).
  g = jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                    check_vma=False)
  z = lambda x: x[:, order]
  got = jax.jit(functools.partial(out_and_grads, g))(z(q), z(k), z(v),
                                                      z(do))
  for a, w in zip(got, want):
    np.testing.assert_allclose(a, z(w), atol=2e-5)
