"""Flax integration: attention_fn, the linen module, jax.nn compatibility."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxflash
from jaxflash import reference
from jaxflash.linen import FlashMultiHeadDotProductAttention, make_attention_fn

KERNEL = dict(implementation="triton", interpret=True)
TOL = dict(atol=2e-5, rtol=2e-5)


def _close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or TOL))


def _x(shape=(2, 24, 32), seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def _packed(batch=2, length=24):
  seg = jnp.repeat(jnp.arange(3, dtype=jnp.int32), length // 3)[None]
  seg = jnp.broadcast_to(seg, (batch, length))
  return seg.at[1, -4:].set(jaxflash.PAD_SEGMENT_ID)


# -- module parity ------------------------------------------------------------

@pytest.mark.parametrize("what", [
    "causal", "packed", pytest.param("full", marks=pytest.mark.slow)])
def test_module_matches_flax(what):
  x = _x()
  flax_mha = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)
  flash = FlashMultiHeadDotProductAttention(
      num_heads=4, qkv_features=32, causal=what == "causal", **KERNEL)
  params = flax_mha.init(jax.random.key(1), x)
  kw, mask = {}, None
  if what == "causal":
    mask = nn.make_causal_mask(x[..., 0])
  elif what == "packed":
    seg = _packed()
    kw = dict(segment_ids=seg)
    mask = nn.combine_masks(nn.make_attention_mask(seg, seg, jnp.equal),
                            nn.make_attention_mask(seg >= 0, seg >= 0))

  def f_flax(p, x):
    return flax_mha.apply(p, x, mask=mask)

  def f_flash(p, x):
    return flash.apply(p, x, **kw)

  got, want = f_flash(params, x), f_flax(params, x)
  if what == "packed":  # padding rows: jaxflash gives 0, flax averages
    got, want = got[:, :-4], want[:, :-4]
  _close(got, want)
  loss = lambda f: lambda p, x: jnp.sum(f(p, x)[:, :20] ** 2)
  _close(jax.grad(loss(f_flash), (0, 1))(params, x),
         jax.grad(loss(f_flax), (0, 1))(params, x), atol=1e-4, rtol=1e-4)


def test_checkpoints_load_both_ways():
  x = _x()
  flax_mha = nn.MultiHeadDotProductAttention(num_heads=4)
  flash = FlashMultiHeadDotProductAttention(num_heads=4, **KERNEL)
  p_flax = flax_mha.init(jax.random.key(1), x)
  p_flash = flash.init(jax.random.key(2), x)
  assert jax.tree.map(jnp.shape, p_flax) == jax.tree.map(
      jnp.shape, nn.meta.unbox(p_flash))
  _close(flash.apply(p_flax, x), flax_mha.apply(p_flax, x))
  _close(flax_mha.apply(nn.meta.unbox(p_flash), x), flash.apply(p_flash, x))


def test_gqa_module_and_logical_axes():
  x = _x()
  flash = FlashMultiHeadDotProductAttention(num_heads=4, num_kv_heads=2,
                                            causal=True, **KERNEL)
  p = flash.init(jax.random.key(1), x)
  specs = nn.get_partition_spec(p)["params"]
  assert specs["query"]["kernel"] == jax.sharding.PartitionSpec(
      "embed", "heads", "kv")
  assert specs["key"]["kernel"] == jax.sharding.PartitionSpec(
      "embed", "kv_heads", "kv")
  assert specs["out"]["kernel"] == jax.sharding.PartitionSpec(
      "heads", "kv", "embed")
  u = nn.meta.unbox(p)["params"]
  assert u["key"]["kernel"].shape == (32, 2, 8)
  # The same computation by hand: projections, reference attention, out.
  proj = lambda name, x: jnp.einsum("btf,fhd->bthd", x,
                                    u[name]["kernel"]) + u[name]["bias"]
  att, _ = reference.attention(proj("query", x), proj("key", x),
                               proj("value", x), causal=True)
  want = jnp.einsum("bthd,hdf->btf", att, u["out"]["kernel"]) + u["out"][
      "bias"]
  _close(flash.apply(p, x), want)


@pytest.mark.parametrize("window", [
    None, (2, 0), pytest.param(3, marks=pytest.mark.slow),
    pytest.param((0, 0), marks=pytest.mark.slow),
    pytest.param(10**12, marks=pytest.mark.slow)])
def test_decode_matches_full_causal(window):
  """Step by step through the cache equals the whole sequence at once,
  with a local window too (placed at the cache index, not at the cache's
  last slot: every step but the last would differ).  Without a window the
  16-slot cache takes the split-K decode kernel (head_dim 16; checked in
  the step's program)."""
  x = _x((2, 16, 64) if window is None else (2, 10, 32))
  kw = dict(num_heads=4, num_kv_heads=2, causal=True,
            local_window_size=window, **KERNEL)
  flash = FlashMultiHeadDotProductAttention(**kw)
  params = flash.init(jax.random.key(1), x)
  full = flash.apply(params, x)
  dec = FlashMultiHeadDotProductAttention(decode=True, **kw)
  cache = dec.init(jax.random.key(1), x)["cache"]
  step = jax.jit(lambda c, xt: dec.apply({**params, "cache": c}, xt,
                                         mutable=["cache"]))
  routed = "jaxflash_paged_decode" in str(jax.make_jaxpr(step)(cache, x[:, :1]))
  assert routed == (window is None)
  outs = []
  for t in range(x.shape[1]):
    y, mut = step(cache, x[:, t:t + 1])
    cache = mut["cache"]
    outs.append(y)
  _close(jnp.concatenate(outs, axis=1), full)


# -- attention_fn in Flax's own modules --------------------------------------

def test_attention_fn_in_linen_mha():
  x = _x()
  base = nn.MultiHeadDotProductAttention(num_heads=4)
  ours = nn.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=make_attention_fn(causal=True, **KERNEL))
  p = base.init(jax.random.key(1), x)
  _close(ours.apply(p, x), base.apply(p, x, mask=nn.make_causal_mask(
      x[..., 0])))
  # A key-padding mask (batch, key only) is served as segment ids.
  keep = jnp.arange(24)[None, :] < jnp.array([[24], [17]])
  pad_mask = keep[:, None, None, :]  # [batch, 1, 1, keys], as Flax decode
  plain = nn.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=make_attention_fn(**KERNEL))
  _close(plain.apply(p, x, mask=pad_mask), base.apply(p, x, mask=pad_mask))


def test_deterministic_grads_reaches_flash_attention(monkeypatch):
  """``deterministic_grads`` (module and attention_fn) is
  flash_attention's ``deterministic``; Flax's ``deterministic`` (dropout)
  is not."""
  from jaxflash import api
  seen = []
  real = api.flash_attention

  def spy(*args, **kw):
    seen.append(kw["deterministic"])
    return real(*args, **kw)

  monkeypatch.setattr(api, "flash_attention", spy)
  x = _x()
  mod = FlashMultiHeadDotProductAttention(num_heads=4, causal=True,
                                          deterministic_grads=True, **KERNEL)
  p = mod.init(jax.random.key(1), x)
  mod.apply(p, x, deterministic=False)
  fn = make_attention_fn(causal=True, deterministic_grads=False, **KERNEL)
  nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fn).apply(
      p, x, deterministic=True)
  assert seen == [True, True, False]
  with pytest.raises(ValueError, match="deterministic must be a bool"):
    make_attention_fn(deterministic_grads="yes", **KERNEL)(
        x[..., None, :], x[..., None, :], x[..., None, :])


def test_attention_fn_in_nnx_mha_with_decode():
  x = _x((2, 8, 32))
  kw = dict(num_heads=4, in_features=32, num_kv_heads=2, decode=False,
            rngs=nnx.Rngs(0))
  base = nnx.MultiHeadAttention(**kw)
  ours = nnx.MultiHeadAttention(
      **{**kw, "rngs": nnx.Rngs(0)}, attention_fn=make_attention_fn(**KERNEL))
  want = base(x, is_causal=True)
  _close(ours(x, is_causal=True), want)
  ours.init_cache(x.shape)
  outs = [ours(x[:, t:t + 1], decode=True) for t in range(8)]
  _close(jnp.concatenate(outs, axis=1), want)


def test_attention_dropout():
  """Flax's attention dropout runs in the kernels: attention_fn with a
  dropout key equals flash_attention's dropout ("xla", the same keep
  mask), per head or broadcast."""
  x = _x()
  q, k, v = (x.reshape(2, 24, 4, 8)[..., :8] * s for s in (1.0, 0.5, 2.0))
  q, k, v = (jnp.concatenate([t, t], -1) for t in (q, k, v))  # head_dim 16
  key = jax.random.key(4)
  fn = make_attention_fn(causal=True, **KERNEL)
  for broadcast in (False, True):
    got = fn(q, k, v, dropout_rng=key, dropout_rate=0.3,
             deterministic=False, broadcast_dropout=broadcast)
    want = jaxflash.flash_attention(
        q, k, v, causal=True, dropout_rate=0.3, dropout_rng=key,
        dropout_broadcast=broadcast, implementation="xla")
    _close(got, want)
  _close(fn(q, k, v, dropout_rng=key, dropout_rate=0.3, deterministic=True),
         fn(q, k, v))


@pytest.mark.slow  # 7 s; the attention_fn's dropout runs per commit
def test_attention_dropout_in_modules():
  """The modules (Flax's with our attention_fn, ours) drop in training
  only, the same key giving the same output and another key another."""
  x = _x()
  for mod in (nn.MultiHeadDotProductAttention(
                  num_heads=2, dropout_rate=0.2,
                  attention_fn=make_attention_fn(**KERNEL)),
              FlashMultiHeadDotProductAttention(num_heads=2, dropout_rate=0.2,
                                                **KERNEL)):
    p = mod.init(jax.random.key(1), x, deterministic=True)
    run = lambda seed, mod=mod, p=p: mod.apply(
        p, x, deterministic=False, rngs={"dropout": jax.random.key(seed)})
    quiet = mod.apply(p, x, deterministic=True)
    assert not np.allclose(run(0), quiet)
    np.testing.assert_array_equal(run(0), run(0))
    assert not np.allclose(run(0), run(1))


def test_dense_masks_and_bias_reach_the_kernels():
  """Flax's own masks that vary over queries (make_causal_mask) and a
  bias go to the kernels as dense arrays: Flax's module with our
  attention_fn, and ours, give Flax's results."""
  x = _x()
  flax_mod = nn.MultiHeadDotProductAttention(num_heads=4)
  p = flax_mod.init(jax.random.key(1), x)
  causal = nn.make_causal_mask(x[..., 0])
  want = flax_mod.apply(p, x, mask=causal)
  ours = nn.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=make_attention_fn(**KERNEL))
  _close(ours.apply(p, x, mask=causal), want)
  flash = FlashMultiHeadDotProductAttention(num_heads=4, **KERNEL)
  _close(flash.apply(p, x, deterministic=True, mask=causal), want)
  bias = jax.random.normal(jax.random.key(2), (1, 4, 24, 24))
  fn = make_attention_fn(**KERNEL)
  q = jax.random.normal(jax.random.key(3), (2, 24, 4, 16))
  _close(fn(q, q, q, bias=bias),
         nn.dot_product_attention(q, q, q, bias=bias))


def test_refusals():
  x = _x()
  p = nn.MultiHeadDotProductAttention(num_heads=4).init(jax.random.key(1), x)
  with pytest.raises(NotImplementedError, match="sow_weights"):
    nn.MultiHeadDotProductAttention(
        num_heads=4, attention_fn=make_attention_fn(**KERNEL)).apply(
            p, x, sow_weights=True, mutable=["intermediates"])
  # Flax's own decode step with a window: the cache mask hides where the
  # query stands, so the window cannot be placed (the module can).
  windowed = nn.MultiHeadDotProductAttention(
      num_heads=4, decode=True, attention_fn=make_attention_fn(
          causal=True, local_window_size=(2, 0), **KERNEL))
  cache = windowed.init(jax.random.key(1), x)["cache"]
  with pytest.raises(NotImplementedError, match="decode=True"):
    windowed.apply({**p, "cache": cache}, x[:, :1], mutable=["cache"])
  # A window whose left side reaches slot 0 bounds nothing: served.
  for window in ((23, 0), 10**12):
    unbounded = nn.MultiHeadDotProductAttention(
        num_heads=4, decode=True, attention_fn=make_attention_fn(
            causal=True, local_window_size=window, **KERNEL))
    unbounded.apply({**p, "cache": cache}, x[:, :1], mutable=["cache"])
  with pytest.raises(NotImplementedError, match="no segment_ids"):
    dec = FlashMultiHeadDotProductAttention(num_heads=4, decode=True,
                                            local_window_size=2, **KERNEL)
    cache = dec.init(jax.random.key(1), x)["cache"]
    dec.apply({**p, "cache": cache}, x[:, :1], mutable=["cache"],
              segment_ids=(jnp.zeros((2, 1), jnp.int32),
                           jnp.zeros((2, 24), jnp.int32)))


def test_attention_fn_lengths_follow_extra_batch_dims():
  """Sequence lengths shaped like the leading batch dims are flattened
  with them, as segment ids are."""
  x = _x((3, 2, 12, 4, 16))
  ql, kl = jnp.array([[3, 12], [5, 7], [1, 2]]), jnp.array([[12, 4], [5, 9],
                                                           [2, 2]])
  got = make_attention_fn(q_seq_lengths=ql, kv_seq_lengths=kl, **KERNEL)(
      x, x, x)
  flat = x.reshape(6, 12, 4, 16)
  want = jaxflash.flash_attention(flat, flat, flat,
                                  q_seq_lengths=ql.reshape(-1),
                                  kv_seq_lengths=kl.reshape(-1),
                                  implementation="xla")
  _close(got.reshape(flat.shape), want)


def test_attention_fn_segment_pairs_follow_extra_batch_dims():
  """A (q ids, kv ids) pair shaped like the leading batch dims is
  flattened with them, as one ids array is."""
  x = _x((3, 2, 12, 4, 16))
  q_seg = jax.random.randint(jax.random.key(5), (3, 2, 12), -1, 3)
  kv_seg = jax.random.randint(jax.random.key(6), (3, 2, 12), -1, 3)
  got = make_attention_fn(segment_ids=(q_seg, kv_seg), **KERNEL)(x, x, x)
  flat = x.reshape(6, 12, 4, 16)
  want = jaxflash.flash_attention(
      flat, flat, flat, segment_ids=(q_seg.reshape(6, 12),
                                     kv_seg.reshape(6, 12)),
      implementation="xla")
  _close(got.reshape(flat.shape), want)


# -- a small transformer trains the same with either attention ---------------

class _Block(nn.Module):
  attention: str

  @nn.compact
  def __call__(self, x):
    if self.attention == "flash":
      att = FlashMultiHeadDotProductAttention(num_heads=4, causal=True,
                                              **KERNEL, name="attn")
      h = att(nn.LayerNorm(name="ln1")(x))
    else:
      att = nn.MultiHeadDotProductAttention(num_heads=4, name="attn")
      h = att(nn.LayerNorm(name="ln1")(x),
              mask=nn.make_causal_mask(x[..., 0]))
    x = x + h
    return x + nn.Dense(32, name="mlp")(nn.gelu(nn.LayerNorm(name="ln2")(x)))


def test_transformer_trains_identically():
  x = _x((4, 16, 32))
  y = _x((4, 16, 32), seed=1)
  losses = {}
  params0 = nn.meta.unbox(_Block("flax").init(jax.random.key(0), x))
  for which in ("flax", "flash"):
    block = _Block(which)
    opt = optax.adam(1e-2)

    @jax.jit
    def step(p, s, block=block, opt=opt):
      loss, g = jax.value_and_grad(
          lambda p: jnp.mean((block.apply(p, x) - y) ** 2))(p)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s, loss

    p, s, out = params0, opt.init(params0), []
    for _ in range(5):
      p, s, loss = step(p, s)
      out.append(float(loss))
    losses[which] = out
  assert losses["flash"][-1] < losses["flash"][0]
  np.testing.assert_allclose(losses["flash"], losses["flax"], rtol=1e-4)


# -- jax.nn.dot_product_attention compatibility ------------------------------

@pytest.mark.parametrize("kw", [
    pytest.param(dict(), id="plain", marks=pytest.mark.slow),
    pytest.param(dict(is_causal=True), id="causal", marks=pytest.mark.slow),
    pytest.param(dict(is_causal=True, t=12, s=20),  # top-left, as jax.nn
                 id="causal-q12-k20"),
    pytest.param(dict(local_window_size=(3, 2)), id="window"),
    pytest.param(dict(local_window_size=2, is_causal=True),
                 id="window-causal", marks=pytest.mark.slow),
    pytest.param(dict(key_value_seq_lengths=[20, 9],
                      query_seq_lengths=[20, 14]), id="lengths"),
    pytest.param(dict(kv_heads=1, scale=0.3), id="mqa-scale"),
    pytest.param(dict(rank3=True, is_causal=True), id="rank3"),
])
def test_dot_product_attention_matches_jax_nn(kw):
  kw = dict(kw)
  t, s = kw.pop("t", 20), kw.pop("s", 20)
  kv_heads = kw.pop("kv_heads", 2)
  rank3 = kw.pop("rank3", False)
  for name in ("key_value_seq_lengths", "query_seq_lengths"):
    if name in kw:
      kw[name] = jnp.array(kw[name], jnp.int32)
  q = jax.random.normal(jax.random.key(0), (2, t, 4, 16))
  k = jax.random.normal(jax.random.key(1), (2, s, kv_heads, 16))
  v = jax.random.normal(jax.random.key(2), (2, s, kv_heads, 16))
  if rank3:
    q, k, v = q[0], k[0], v[0]
  ours = functools.partial(jaxflash.dot_product_attention, **kw, **KERNEL)
  theirs = functools.partial(jax.nn.dot_product_attention, **kw)
  out, res = ours(q, k, v, return_residual=True)
  want, want_res = theirs(q, k, v, return_residual=True)
  assert out.shape == want.shape and res.shape == want_res.shape
  _close(out, want)
  # Rows that see no key: LSE -inf here, a huge finite negative in jax.nn.
  empty = np.isneginf(np.asarray(res))
  assert np.all(np.asarray(want_res)[empty] < -1e30)
  _close(np.where(empty, 0, res), np.where(empty, 0, want_res))
  g = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2))
  _close(g(ours)(q, k, v), g(theirs)(q, k, v), atol=1e-4, rtol=1e-4)


def test_dot_product_attention_dense_paths():
  """bias and mask reach the kernels (by default or named) and "xla"
  alike; the jaxpr of a call that does not differentiate the bias computes
  no bias gradient."""
  q = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))
  bias = jax.random.normal(jax.random.key(1), (2, 4, 8, 8))
  want = jax.nn.dot_product_attention(q, q, q, bias=bias)
  for implementation in (None, ("triton", "xla")):
    got = jaxflash.dot_product_attention(q, q, q, bias=bias, interpret=True,
                                         implementation=implementation)
    _close(got, want)
  with pytest.raises(ValueError, match="implementation='cuda' is not one"):
    jaxflash.dot_product_attention(q, q, q, bias=bias, implementation="cuda")
  with pytest.raises(NotImplementedError, match="logits_soft_cap"):
    jaxflash.dot_product_attention(q, q, q, bias=bias, logits_soft_cap=5.0)
  loss = lambda q, b: jnp.sum(jaxflash.dot_product_attention(
      q, q, q, bias=b, implementation="triton", interpret=True) ** 2)
  # The backward computes the bias's gradient only when it is asked for.
  from jaxflash.triton import backward as bwd_lib
  seen, kernels = [], bwd_lib.backward
  def spy(*args, **kw):
    seen.append(kw["dbias"])
    return kernels(*args, **kw)
  bwd_lib.backward = spy
  try:
    jax.make_jaxpr(jax.grad(loss))(q, bias)
    jax.make_jaxpr(jax.grad(loss, argnums=1))(q, bias)
  finally:
    bwd_lib.backward = kernels
  assert seen == [False, True]


_DENSE_CASES = [  # (keywords, id, slow on "xla", slow on the kernels)
    (dict(bias_shape=(2, 4, 12, 20)), "bias", True, True),
    (dict(bias_shape=(1, 1, 12, 20), is_causal=True),
     "bias-broadcast-causal", False, True),
    (dict(bias_shape=(2, 4, 1, 20), kv_heads=1), "bias-mqa-row", True,
     True),  # MQA, one row
    (dict(mask_shape=(2, 1, 12, 20), local_window_size=(3, 2)),
     "mask-window", True, True),
    (dict(mask_shape=(1, 4, 12, 20), bias_shape=(2, 1, 12, 1),
          key_value_seq_lengths=[20, 9], query_seq_lengths=[12, 7]),
     "mask-bias-lengths", False, True),
    (dict(bias_shape=(4, 12, 20), mask_shape=(1, 12, 20), rank3=True),
     "rank3", True, True),
]


@pytest.mark.parametrize("kw,impl", [
    pytest.param(kw, impl, id=f"{impl}-{name}",
                 marks=[pytest.mark.slow] if slow else [])
    for kw, name, slow_xla, slow_kernels in _DENSE_CASES
    for impl, slow in (("xla", slow_xla), ("triton", slow_kernels))])
def test_dot_product_attention_dense_matches_jax_nn(kw, impl, request):
  """bias and mask on the "xla" path and in the Triton kernels: jax.nn's
  results wherever a row sees a key, with its gradients (the bias's too);
  rows that see none give 0 and residual -inf (jax.nn: the mean of V and
  about -2.4e38)."""
  kw = dict(kw)
  bias_shape, mask_shape = kw.pop("bias_shape", None), kw.pop("mask_shape",
                                                              None)
  kv_heads, rank3 = kw.pop("kv_heads", 2), kw.pop("rank3", False)
  for name in ("key_value_seq_lengths", "query_seq_lengths"):
    if name in kw:
      kw[name] = jnp.array(kw[name], jnp.int32)
  key = iter(jax.random.split(jax.random.key(3), 6))
  q = jax.random.normal(next(key), (2, 12, 4, 16))
  k = jax.random.normal(next(key), (2, 20, kv_heads, 16))
  v = jax.random.normal(next(key), (2, 20, kv_heads, 16))
  if rank3:
    q, k, v = q[0], k[0], v[0]
  bias = None if bias_shape is None else jax.random.normal(next(key),
                                                           bias_shape)
  mask = None
  if mask_shape is not None:  # every row of the mask keeps some keys
    mask = jax.random.bernoulli(next(key), 0.7, mask_shape)
    mask = mask.at[..., 0].set(True).at[..., 0, :].set(False)

  def call(f, q, k, v, bias):
    return f(q, k, v, bias=bias, mask=mask, return_residual=True, **kw)

  ours = functools.partial(jaxflash.dot_product_attention,
                           implementation=impl, interpret=impl == "triton")
  out, res = call(ours, q, k, v, bias)
  want, want_res = call(jax.nn.dot_product_attention, q, k, v, bias)
  empty = np.isneginf(np.asarray(res))
  assert np.all(np.asarray(want_res)[empty] < -1e30)
  assert not np.any(np.isnan(np.asarray(out)))
  seen = ~empty[..., None]
  np.testing.assert_array_equal(np.where(seen, 0, np.asarray(out)), 0)
  _close(np.where(seen, out, 0), np.where(seen, want, 0))
  _close(np.where(empty, 0, res), np.where(empty, 0, want_res))
  # Gradients of the rows that see a key (jax.nn's empty rows are
  # averages with gradients of their own).
  weight = jnp.asarray(seen, jnp.float32)
  args = (q, k, v) + (() if bias is None else (bias,))
  loss = lambda f: lambda *a: jnp.sum(weight * call(
      f, *a[:3], a[3] if len(a) > 3 else None)[0] ** 2)
  argnums = tuple(range(len(args)))
  _close(jax.grad(loss(ours), argnums)(*args),
         jax.grad(loss(jax.nn.dot_product_attention), argnums)(*args),
         atol=1e-4, rtol=1e-4)
  # The residual is differentiable here (jax.nn stops its gradient).
  g = jax.grad(lambda q: jnp.sum(jnp.where(
      empty, 0, call(ours, q, k, v, bias)[1])))(q)
  assert np.abs(np.asarray(g)).max() > 0


def test_dot_product_attention_dense_checks_its_arguments():
  """The dense path checks every argument as the kernels' path does."""
  q = jax.random.normal(jax.random.key(0), (1, 8, 4, 16))
  kv = jax.random.normal(jax.random.key(1), (1, 8, 2, 16))
  zb = jnp.zeros((1, 1, 8, 8))
  dpa = functools.partial(jaxflash.dot_product_attention,
                          implementation="xla")
  for kwargs, match in [
      (dict(bias=jnp.zeros((1, 2, 8, 8))), r"bias must have shape \[B, N,"
       r" T, S\] = \(1, 4, 8, 8\), each axis full or 1, got \(1, 2, 8,"
       r" 8\)"),
      (dict(bias=jnp.zeros((4, 8, 8))), r"bias must have shape"),
      (dict(mask=jnp.ones((1, 1, 8, 8), jnp.int32)),
       r"mask must be a bool array, got dtype int32"),
      (dict(bias=jnp.zeros((1, 1, 8, 8), jnp.int32)),
       r"bias must be a floating-point array"),
      (dict(bias=zb, scale=0.0), r"scale=0.0 must be finite and > 0"),
      (dict(bias=zb, local_window_size=(-1, 0)), r"window sizes must be"),
      (dict(bias=zb, is_causal=1), r"is_causal must be a bool"),
      (dict(bias=zb, key_value_seq_lengths=jnp.array([100])),
       r"key_value_seq_lengths must lie in \[0, 8\]"),
  ]:
    with pytest.raises(ValueError, match=match):
      dpa(q, kv, kv, **kwargs)
  with pytest.raises(NotImplementedError, match="logits_soft_cap"):
    dpa(q, kv, kv, bias=zb, logits_soft_cap=5.0)
  # A window side past every key is unbounded (no int32 wrap).
  _close(dpa(q, kv, kv, bias=zb, local_window_size=2**31 - 1),
         dpa(q, kv, kv, bias=zb))
  _close(dpa(q, kv, kv, bias=zb, local_window_size=10**12),
         dpa(q, kv, kv, bias=zb))
  # Segment ids and a soft cap combine with a dense mask.
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2]])
  mask = jnp.ones((1, 1, 8, 8), bool)
  _close(dpa(q, kv, kv, mask=mask, segment_ids=seg, logits_soft_cap=5.0),
         jaxflash.dot_product_attention(q, kv, kv, segment_ids=seg,
                                        logits_soft_cap=5.0, **KERNEL))


@pytest.mark.parametrize("kwargs,match", [
    (dict(scale=-1.0), r"scale=-1.0 must be finite"),
    (dict(is_causal=1), r"is_causal must be a bool"),
    (dict(query_seq_lengths=jnp.array([1, 99])),
     r"query_seq_lengths must lie in \[0, 8\]"),
    (dict(key_value_seq_lengths=jnp.array([1])),
     r"key_value_seq_lengths must have shape \(2,\)"),
    (dict(return_residual="yes"), r"return_residual must be a bool"),
])
def test_dot_product_attention_errors_name_its_arguments(kwargs, match):
  """Errors speak of jax.nn's argument names, not flash_attention's."""
  q = jnp.ones((2, 8, 4, 16))
  with pytest.raises(ValueError, match=match):
    jaxflash.dot_product_attention(q, q, q, **kwargs)


def test_dot_product_attention_shapes_and_scale():
  q = jnp.ones((2, 8, 4, 16))
  for bad in ((q[0, 0], q, q), (q, q[0], q[0])):
    with pytest.raises(ValueError, match=r"query, key and value must all"
                       r" have rank 4 \[B, T, N, H\] or all rank 3"):
      jaxflash.dot_product_attention(*bad)
  with pytest.raises(ValueError, match=r"query, key and value must share"):
    jaxflash.dot_product_attention(q, q.astype(jnp.bfloat16), q)
  # A concrete 0-d array is a static scale; a traced one is not.
  x = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))
  _close(jaxflash.dot_product_attention(x, x, x, scale=jnp.float32(0.2),
                                        implementation="xla"),
         jax.nn.dot_product_attention(x, x, x, scale=0.2))
  with pytest.raises(ValueError, match="scale must be a static Python"):
    jax.jit(lambda s: jaxflash.dot_product_attention(x, x, x, scale=s))(0.2)


def test_rope_refuses_keys_of_another_length():
  """rope_theta rotates queries and keys at one set of positions: keys of
  another length (cross-attention) are a clear error, not a broadcast
  failure."""
  flash = FlashMultiHeadDotProductAttention(num_heads=4, rope_theta=1e4,
                                            implementation="xla")
  x, kv = _x((2, 12, 32)), _x((2, 20, 32), seed=1)
  with pytest.raises(ValueError, match="got 12 queries and 20 keys"):
    flash.init(jax.random.key(0), x, kv)


def test_inputs_kv_as_flax():
  """Flax's deprecated inputs_kv: keys and values from one input, with
  Flax's warning; with inputs_k as well, Flax's error."""
  x, kv = _x((2, 12, 32)), _x((2, 20, 32), seed=1)
  flash = FlashMultiHeadDotProductAttention(num_heads=4, **KERNEL)
  params = flash.init(jax.random.key(0), x, kv)
  with pytest.warns(DeprecationWarning, match="inputs_kv"):
    got = flash.apply(params, x, inputs_kv=kv)
  _close(got, flash.apply(params, x, kv, kv))
  with pytest.raises(ValueError, match="`inputs_kv` must be None"):
    flash.apply(params, x, kv, inputs_kv=kv)


def test_rope_decode_matches_full():
  """Rotary embeddings use the cache index while decoding."""
  x = _x((2, 6, 32))
  kw = dict(num_heads=4, causal=True, rope_theta=10000.0, **KERNEL)
  flash = FlashMultiHeadDotProductAttention(**kw)
  params = flash.init(jax.random.key(1), x)
  full = flash.apply(params, x)
  dec = FlashMultiHeadDotProductAttention(decode=True, **kw)
  cache = dec.init(jax.random.key(1), x)["cache"]
  step = jax.jit(lambda c, xt: dec.apply({**params, "cache": c}, xt,
                                         mutable=["cache"]))
  outs = []
  for t in range(6):
    y, mut = step(cache, x[:, t:t + 1])
    cache = mut["cache"]
    outs.append(y)
  _close(jnp.concatenate(outs, axis=1), full)
  # Relative positions: shifting every position leaves attention unchanged.
  pos = jnp.broadcast_to(jnp.arange(6) + 100, (2, 6))
  _close(flash.apply(params, x, positions=pos), full, atol=1e-4, rtol=1e-4)
