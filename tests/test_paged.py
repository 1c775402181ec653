"""jaxflash.paged: attention over a paged KV cache (the split-K Triton
kernel in the Pallas interpreter, and XLA) against the dense reference,
the cache update, and the argument checks."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import (
  FLOOR,
  check_rule,
  outputs_and_grads,
  random_inputs,
  reference_kwargs,
)

import jaxflash
from jaxflash import paged, reference
from jaxflash.mosaic_gpu import decode as hopper_decode
from jaxflash.triton import decode


def _cache(seed, *, batch, q_len, heads, kv_heads, head_dim, page,
           pages_per_seq, lengths, dtype, spare=3):
  """Random queries and pages; a shuffled page table in which sequences 0
  and 1 share their first page, with entries past each length set to
  out-of-range garbage (never read)."""
  rng = np.random.default_rng(seed)
  num_pages = batch * pages_per_seq + spare
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (batch, q_len, heads, head_dim), jnp.float32)
  kp = jax.random.normal(ks[1], (num_pages, page, kv_heads, head_dim),
                         jnp.float32)
  vp = jax.random.normal(ks[2], kp.shape, jnp.float32)
  table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(
      batch, pages_per_seq)
  if batch > 1:
    table[1, 0] = table[0, 0]  # a shared prefix page
  lengths = np.asarray(lengths, np.int32)
  used = -(-lengths // page)
  for b in range(batch):
    table[b, used[b]:] = 10 ** 6 + b  # past the length: never read
  cast = lambda x: x.astype(dtype)
  return (cast(q), cast(kp), cast(vp), jnp.asarray(table, jnp.int32),
          jnp.asarray(lengths))


def _check(got, args, **kw):
  """The numerics rule (docs/numerics.md) for the output and the LSE."""
  out, lse = got
  f32 = [a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in args]
  ref32 = reference.paged_attention(*f32, **kw)
  ref_lp = reference.paged_attention(*args, upcast=False, **kw)
  dtype = args[0].dtype
  for name, x, r32, rlp in (("out", out, *(r[0] for r in (ref32, ref_lp))),
                            ("lse", lse, *(r[1] for r in (ref32, ref_lp)))):
    x, r32, rlp = (np.asarray(a, np.float32) for a in (x, r32, rlp))
    np.testing.assert_array_equal(np.isneginf(x), np.isneginf(r32),
                                  err_msg=name)
    fin = np.isfinite(r32)
    assert np.isfinite(x[fin]).all(), name
    err = np.abs(x[fin] - r32[fin]).max(initial=0.0)
    lp = np.abs(rlp[fin] - r32[fin]).max(initial=0.0)
    scale = np.abs(r32[fin]).max(initial=1.0)
    assert err <= 2 * lp + FLOOR[jnp.dtype(dtype)] * max(scale, 1.0), (
        name, err, lp)


KERNEL_CASES = [
    # GQA 4:1, decode, page 16, lengths 0 (zeros), 1, a whole page, one off.
    pytest.param(dict(batch=4, q_len=1, heads=8, kv_heads=2, head_dim=64,
                      page=16, pages_per_seq=6, lengths=[0, 1, 16, 77],
                      dtype=jnp.bfloat16), {}, id="gqa4-decode-p16"),
    # MQA, three new tokens (speculative), a window and a soft cap.
    pytest.param(dict(batch=3, q_len=3, heads=4, kv_heads=1, head_dim=64,
                      page=32, pages_per_seq=4, lengths=[3, 50, 128],
                      dtype=jnp.float16),
                 dict(local_window_size=20, logits_soft_cap=30.0),
                 id="mqa-q3-window-softcap"),
    # A prefill chunk of 40 rows x group 4: two row tiles per head, the
    # second partly padding; causal inside the chunk, which is the whole
    # of sequence 0.
    pytest.param(dict(batch=2, q_len=40, heads=8, kv_heads=2, head_dim=16,
                      page=16, pages_per_seq=4, lengths=[40, 61],
                      dtype=jnp.bfloat16), {}, id="gqa4-chunk40-row-tiles"),
    pytest.param(dict(batch=2, q_len=16, heads=8, kv_heads=1, head_dim=128,
                      page=16, pages_per_seq=5, lengths=[16, 79],
                      dtype=jnp.float32), {}, id="mqa8-chunk16-f32",
                 marks=pytest.mark.slow),
    pytest.param(dict(batch=2, q_len=4, heads=2, kv_heads=2, head_dim=32,
                      page=64, pages_per_seq=3, lengths=[64, 191],
                      dtype=jnp.bfloat16), dict(local_window_size=(70, 0)),
                 id="mha-q4-p64-window", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape,kw", KERNEL_CASES)
def test_kernel_interpret(shape, kw):
  args = _cache(1, **shape)
  got = paged.paged_attention(*args, return_lse=True, interpret=True,
                              implementation="triton", **kw)
  ref_kw = dict(logits_soft_cap=kw.get("logits_soft_cap"),
                window_left=paged._window_left(kw.get("local_window_size")))
  _check(got, args, **ref_kw)


HOPPER_CASES = [
    # GQA 4:1 decode over pages of 16, four to a ring slot, lengths 0, 1,
    # a page, one off; two ring slots.
    pytest.param(dict(batch=4, q_len=1, heads=8, kv_heads=2, head_dim=64,
                      page=16, pages_per_seq=6, lengths=[0, 1, 16, 77],
                      dtype=jnp.bfloat16), {},
                 hopper_decode.MosaicPagedConfig(stages=2),
                 id="gqa4-decode-p16"),
    # MQA, three new tokens, a window and a soft cap, pages of 32 one to
    # a slot, three splits (some of them empty).
    pytest.param(dict(batch=3, q_len=3, heads=4, kv_heads=1, head_dim=64,
                      page=32, pages_per_seq=4, lengths=[3, 50, 128],
                      dtype=jnp.float16),
                 dict(local_window_size=20, logits_soft_cap=30.0),
                 hopper_decode.MosaicPagedConfig(splits=3, block_pages=1,
                                                 stages=2),
                 id="mqa-q3-window-softcap"),
    # A prefill chunk of 40 rows x group 4: three row tiles of 64 per
    # head, the last partly padding; head_dim 128.
    pytest.param(dict(batch=2, q_len=40, heads=8, kv_heads=2, head_dim=128,
                      page=16, pages_per_seq=4, lengths=[40, 61],
                      dtype=jnp.bfloat16), {}, None,
                 id="gqa4-chunk40-row-tiles", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape,kw,config", HOPPER_CASES)
def test_hopper_kernel_interpret(shape, kw, config):
  """The Hopper kernel in the Mosaic GPU interpreter, races detected."""
  args = _cache(1, **shape)
  scale = shape["head_dim"] ** -0.5
  ref_kw = dict(logits_soft_cap=kw.get("logits_soft_cap"),
                window_left=paged._window_left(kw.get("local_window_size")))
  import jax.experimental.pallas.mosaic_gpu as plgpu
  got = hopper_decode.paged_forward(
      *args, softmax_scale=scale, config=config,
      interpret=plgpu.InterpretGPUParams(detect_races=True), **ref_kw)
  _check(got, args, **ref_kw)


def test_hopper_kernel_dispatch():
  """``implementation="mosaic_gpu"`` and a MosaicPagedConfig reach the
  Hopper kernel (the interpreter); what it does not serve is refused by
  name, or left to another kernel under None."""
  args = _cache(3, batch=2, q_len=1, heads=4, kv_heads=2, head_dim=64,
                page=16, pages_per_seq=2, lengths=[5, 32],
                dtype=jnp.bfloat16)
  got = paged.paged_attention(*args, return_lse=True, interpret=True,
                              implementation="mosaic_gpu")
  _check(got, args)
  cfg = hopper_decode.MosaicPagedConfig(splits=1, stages=1)
  assert paged._paged_kernel(None, cfg, True, args[0], args[1],
                             False) == "mosaic_gpu"
  assert paged._paged_kernel(None, None, True, args[0], args[1],
                             False) == paged.DEFAULT_KERNELS[0]
  with pytest.raises(ValueError, match="does not take"):
    paged.paged_attention(*args, interpret=True, implementation="triton",
                          config=cfg)
  f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
         for a in args]
  with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
    paged.paged_attention(*f32, interpret=True, implementation="mosaic_gpu")
  # float32 under None: the Triton kernel serves it.
  assert paged._paged_kernel(None, None, True, f32[0], f32[1],
                             False) == "triton"
  with pytest.raises(NotImplementedError, match="latent"):
    paged.mla_attention(args[0], args[1][:, :, 0], *args[3:],
                        v_head_dim=32, implementation="mosaic_gpu")
  with pytest.raises(ValueError, match="stages=0"):
    hopper_decode.MosaicPagedConfig(stages=0)


def test_xla_and_one_split():
  """The XLA path, and the kernel with one split (no merge) and with
  several, agree with the reference."""
  args = _cache(2, batch=2, q_len=2, heads=4, kv_heads=2, head_dim=64,
                page=16, pages_per_seq=4, lengths=[20, 64],
                dtype=jnp.bfloat16)
  _check(paged.paged_attention(*args, return_lse=True,
                               implementation="xla"), args)
  one = paged.paged_attention(*args, return_lse=True, interpret=True,
                              config=decode.PagedConfig(splits=1))
  _check(one, args)
  # One page per loop step, two splits (the default takes all four pages
  # of 16 in one step, so one split).
  _check(paged.paged_attention(
      *args, return_lse=True, interpret=True,
      config=decode.PagedConfig(splits=3, block_pages=1)), args)


@pytest.mark.parametrize("dtype", [
    jnp.float8_e4m3fn, pytest.param(jnp.float8_e5m2, marks=pytest.mark.slow)])
def test_fp8_cache(dtype):
  """An FP8 cache (pages quantized per key/value head) read by bfloat16
  queries: the kernel against the reference of the dequantized pages, by
  the numerics rule; the XLA path likewise."""
  q, kp, vp, table, lengths = _cache(
      4, batch=3, q_len=2, heads=8, kv_heads=2, head_dim=32, page=16,
      pages_per_seq=4, lengths=[0, 17, 64], dtype=jnp.float32)
  (k8, ks), (v8, vs) = (jaxflash.quantize_fp8(x, axis=2, dtype=dtype)
                        for x in (kp, vp))
  args = (q.astype(jnp.bfloat16), k8, v8, table, lengths)
  for impl in ("triton", "xla"):
    got = paged.paged_attention(*args, k_scale=ks, v_scale=vs,
                                return_lse=True, implementation=impl,
                                interpret=True)
    _check(got, args, k_scale=ks, v_scale=vs)
  with pytest.raises(ValueError, match="v_scale must be a scalar"):
    paged.paged_attention(*args, v_scale=jnp.ones(3))
  with pytest.raises(ValueError, match="FP8 pages only"):
    paged.paged_attention(q, kp, vp, table, lengths, k_scale=1.0)


def test_split_plan_follows_lengths():
  """A page table of far more pages than the lengths use, eight splits of
  four-page steps:
  each sequence's pages are shared among the splits by its own length
  (some splits of a short sequence see nothing and weigh 0 in the
  merge)."""
  args = _cache(6, batch=3, q_len=3, heads=4, kv_heads=2, head_dim=32,
                page=16, pages_per_seq=40, lengths=[3, 70, 600],
                dtype=jnp.float32)
  for cfg in (decode.PagedConfig(splits=8),):
    _check(paged.paged_attention(*args, return_lse=True, interpret=True,
                                 config=cfg), args)


@pytest.mark.parametrize("q_len,heads,head_dim,v_head_dim", [
    (1, 16, 80, 64), pytest.param(2, 128, 576, 512, marks=pytest.mark.slow)])
def test_mla_attention(q_len, heads, head_dim, v_head_dim):
  """Multi-head latent attention over a paged latent cache: the kernel
  (latent and rotary columns as two blocks, values from the latent
  block) against the reference of the same cache as keys and its first
  v_head_dim columns as values; lengths 0, 1, a page multiple and one
  off; DeepSeek's 576/512 at 128 heads (slow)."""
  q, kp, _, table, lengths = _cache(
      9, batch=4, q_len=q_len, heads=heads, kv_heads=1, head_dim=head_dim,
      page=16, pages_per_seq=4, lengths=[0, 1, 32, 63], dtype=jnp.float32)
  pages = kp[:, :, 0]
  got = paged.mla_attention(q, pages, table, lengths, v_head_dim=v_head_dim,
                            softmax_scale=192 ** -0.5, return_lse=True,
                            implementation="triton", interpret=True)
  assert got[0].shape == (4, q_len, heads, v_head_dim)
  args = (q, kp, kp[..., :v_head_dim], table, lengths)
  _check(got, args, softmax_scale=192 ** -0.5)
  xla = paged.mla_attention(q, pages, table, lengths, v_head_dim=v_head_dim,
                            softmax_scale=192 ** -0.5, return_lse=True,
                            implementation="xla")
  _check(xla, args, softmax_scale=192 ** -0.5)
  with pytest.raises(NotImplementedError, match="v_head_dim=48"):
    paged.mla_attention(q, pages, table, lengths, v_head_dim=48,
                        implementation="triton", interpret=True)
  with pytest.raises(ValueError, match="kv_pages must be"):
    paged.mla_attention(q, kp, table, lengths)
  with pytest.raises(ValueError, match=f"v_head_dim={head_dim}"):
    paged.mla_attention(q, pages, table, lengths, v_head_dim=head_dim)


@pytest.mark.parametrize("q_len,block", [(1, 16), (2, 32)])
def test_mla_fp8_latent(q_len, block):
  """FlashMLA's FP8 latent format: the kernel dequantizes each block of
  latent columns by its token's scale and reads the rotary columns as
  they are; against the reference of the same dequantized cache (numerics
  rule), and the XLA path; close to the unquantized cache; the
  quantizer's blocks and the format's errors."""
  q, kp, _, table, lengths = _cache(
      12, batch=4, q_len=q_len, heads=16, kv_heads=1, head_dim=80,
      page=16, pages_per_seq=4, lengths=[0, 1, 32, 63], dtype=jnp.float32)
  q, pages = q.astype(jnp.bfloat16), kp[:, :, 0].astype(jnp.bfloat16)
  cache = paged.quantize_latent(pages, v_head_dim=64, block=block)
  assert cache.latent.dtype == jnp.float8_e4m3fn
  assert cache.scales.shape == (*pages.shape[:2], 64 // block)
  assert cache.rope.dtype == jnp.bfloat16 and cache.rope.shape[2] == 16
  # Each block's largest magnitude lands on e4m3's largest.
  lat = np.abs(np.asarray(cache.latent, np.float32)).reshape(
      *pages.shape[:2], -1, block)
  np.testing.assert_array_equal(lat.max(-1)[lat.max(-1) > 0], 448.0)
  deq = cache.dequantize()
  # e4m3's relative step, or below its subnormals (2^-9 of a scale).
  np.testing.assert_allclose(deq, np.asarray(pages, np.float32),
                             rtol=2 ** -4, atol=1e-4)
  kw = dict(v_head_dim=64, softmax_scale=192 ** -0.5, return_lse=True)
  got = paged.mla_attention(q, cache, table, lengths, **kw,
                            implementation="triton", interpret=True)
  kd = cache.dequantize(jnp.bfloat16)[:, :, None]
  args = (q, kd, kd[..., :64], table, lengths)
  _check(got, args, softmax_scale=192 ** -0.5)
  xla = paged.mla_attention(q, cache, table, lengths, **kw,
                            implementation="xla")
  _check(xla, args, softmax_scale=192 ** -0.5)
  plain = paged.mla_attention(q, pages, table, lengths, **kw,
                              implementation="xla")
  err = np.abs(np.asarray(got[0], np.float32)
               - np.asarray(plain[0], np.float32))
  assert err.max() <= 0.1 * np.abs(np.asarray(plain[0], np.float32)).max()
  with pytest.raises(ValueError, match="v_head_dim=32 must be the FP8"):
    paged.mla_attention(q, cache, table, lengths, v_head_dim=32)
  with pytest.raises(ValueError, match="bfloat16 or float16 queries"):
    paged.mla_attention(q.astype(jnp.float32), cache, table, lengths,
                        v_head_dim=64)
  with pytest.raises(ValueError, match="float8_e4m3fn latent"):
    paged.mla_attention(q, cache._replace(latent=pages[..., :64]), table,
                        lengths, v_head_dim=64)
  with pytest.raises(ValueError, match="block=48"):
    paged.quantize_latent(pages, v_head_dim=64, block=48)
  with pytest.raises(NotImplementedError, match="blocks that are powers"):
    paged.mla_attention(q, paged.quantize_latent(pages, v_head_dim=64,
                                                 block=8),
                        table, lengths, v_head_dim=64,
                        implementation="triton", interpret=True)


def test_reference_matches_dense_attention():
  """The paged reference against dense attention over each sequence's
  keys in order (causal, bottom-right)."""
  q, kp, vp, table, lengths = _cache(3, batch=3, q_len=2, heads=4,
                                     kv_heads=2, head_dim=32, page=8,
                                     pages_per_seq=4, lengths=[2, 9, 32],
                                     dtype=jnp.float32)
  out, lse = reference.paged_attention(q, kp, vp, table, lengths)
  for b, n in enumerate(np.asarray(lengths)):
    k = jnp.concatenate([kp[table[b, p]] for p in range(-(-n // 8))])[:n]
    v = jnp.concatenate([vp[table[b, p]] for p in range(-(-n // 8))])[:n]
    want, want_lse = reference.attention(q[b:b + 1], k[None], v[None],
                                         causal=True)
    np.testing.assert_allclose(out[b], want[0], atol=1e-5)
    np.testing.assert_allclose(lse[b], want_lse[0], atol=1e-5)


def test_splits_rule():
  assert decode.decode_splits(1, 8, 1024, 132) == 33
  assert decode.decode_splits(1, 8, 4, 132) == 4
  assert decode.decode_splits(128, 8, 64, 132) == 1
  with pytest.raises(ValueError, match="splits=0"):
    decode.PagedConfig(splits=0)
  with pytest.raises(ValueError, match="block_pages=0"):
    decode.PagedConfig(block_pages=0)
  assert [decode.block_pages(p) for p in (8, 16, 64, 256)] == [8, 4, 1, 1]


ROUTE_CASES = [
    # A decode step: GQA 4:1, causal, lengths 0 (zeros), 1, mid, full.
    pytest.param(dict(batch=4, q_len=1, kv_len=96, heads=8, kv_heads=2,
                      head_dim=64, dtype=jnp.bfloat16),
                 dict(causal=True, kv_seq_lengths=[0, 1, 50, 96]),
                 id="gqa4-q1-lengths"),
    # Three speculative rows, non-causal two-sided window, soft cap, MQA.
    pytest.param(dict(batch=2, q_len=3, kv_len=64, heads=4, kv_heads=1,
                      head_dim=32, dtype=jnp.float16),
                 dict(local_window_size=(20, 5), logits_soft_cap=30.0,
                      kv_seq_lengths=[64, 33]), id="mqa-q3-window-softcap"),
    # A chunk of 16 rows, causal bottom-right over the whole array.
    pytest.param(dict(batch=1, q_len=16, kv_len=48, heads=2, kv_heads=2,
                      head_dim=16, dtype=jnp.float32), dict(causal=True),
                 id="mha-q16-f32", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape,kw", ROUTE_CASES)
def test_flash_attention_decode_route(shape, kw):
  """flash_attention with a few query rows takes the paged decode kernel
  over the contiguous cache (seen in the program), and its outputs and
  gradients (the Triton backward from the decode kernel's residuals)
  keep the numerics rule."""
  q, k, v, do, dlse = random_inputs(jax.random.key(7), **shape)
  kw = {n: jnp.asarray(x, jnp.int32) if n.endswith("lengths") else x
        for n, x in kw.items()}
  fn = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, return_lse=True, implementation="triton", interpret=True,
      **kw)
  assert "jaxflash_paged_decode" in str(jax.make_jaxpr(fn)(q, k, v))
  check_rule(outputs_and_grads(fn, q, k, v, do, dlse), q, k, v, do, dlse,
             **reference_kwargs(**kw))


def test_decode_route_top_left_and_fallbacks():
  """jax.nn's top-left causal alignment through the route; calls the
  route does not serve (query lengths, segment ids, a key length that 16
  does not divide, many rows) keep the prefill kernels."""
  q, k, v, _, _ = random_inputs(jax.random.key(8), batch=2, q_len=2,
                                kv_len=32, heads=2, kv_heads=1, head_dim=16,
                                dtype=jnp.float32)
  lengths = jnp.asarray([32, 7], jnp.int32)
  got = jaxflash.dot_product_attention(
      q, k, v, is_causal=True, key_value_seq_lengths=lengths,
      implementation="triton", interpret=True)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                      key_value_seq_lengths=lengths)
  np.testing.assert_allclose(got, want, atol=2e-5)

  def program(q, k, v, **kw):
    return str(jax.make_jaxpr(lambda q, k, v: jaxflash.flash_attention(
        q, k, v, implementation="triton", interpret=True, **kw))(q, k, v))

  assert "jaxflash_paged_decode" in program(q, k, v, causal=True)
  # Traced lengths past the keys mean every key, as on the other paths.
  long = jax.jit(lambda q, k, v, n: jaxflash.flash_attention(
      q, k, v, kv_seq_lengths=n, implementation="triton", interpret=True))(
          q, k, v, jnp.asarray([40, 32], jnp.int32))
  np.testing.assert_allclose(long, jaxflash.flash_attention(
      q, k, v, implementation="xla"), atol=2e-5)
  for kw in (dict(q_seq_lengths=jnp.asarray([2, 1])), dict(segment_ids=(
      jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 32), jnp.int32)))):
    assert "jaxflash_paged_decode" not in program(q, k, v, **kw)
  assert "jaxflash_paged_decode" not in program(q, k[:, :30], v[:, :30])
  many = jnp.zeros((2, 17, 2, 16), jnp.float32)
  assert "jaxflash_paged_decode" not in program(many, k, v)


def test_append_then_attend():
  """Tokens appended land in their pages: attention over the cache after
  the append equals the reference over the keys in order; appending past
  the table's capacity is refused, and dropped under jit."""
  q, kp, vp, table, lengths = _cache(4, batch=2, q_len=3, heads=2,
                                     kv_heads=1, head_dim=16, page=8,
                                     pages_per_seq=3, lengths=[5, 8],
                                     dtype=jnp.float32)
  table = jnp.asarray(np.asarray(table) % kp.shape[0])  # every entry valid
  k_new = jax.random.normal(jax.random.key(5), (2, 3, 1, 16))
  v_new = jax.random.normal(jax.random.key(6), (2, 3, 1, 16))
  kp2, vp2, len2 = paged.append(kp, vp, table, lengths, k_new, v_new)
  np.testing.assert_array_equal(len2, [8, 11])
  for b in range(2):
    for t in range(3):
      pos = int(lengths[b]) + t
      page, row = int(table[b, pos // 8]), pos % 8
      np.testing.assert_array_equal(kp2[page, row], k_new[b, t])
      np.testing.assert_array_equal(vp2[page, row], v_new[b, t])
  out = paged.paged_attention(q, kp2, vp2, table, len2)
  want, _ = reference.paged_attention(q, kp2, vp2, table, len2)
  np.testing.assert_allclose(out, want, atol=1e-6)
  big = jnp.zeros((2, 20, 1, 16))
  with pytest.raises(ValueError, match="capacity 24"):
    paged.append(kp, vp, table, lengths, big, big)
  kp3, _, _ = jax.jit(paged.append)(kp, vp, table, lengths, big, big)
  assert np.isfinite(np.asarray(kp3)).all()


def test_append_latent_then_attend():
  """New latent vectors land in their pages, in a bf16 cache and
  quantized in an FP8 one (the same as quantizing the whole cache after
  writing them); latent attention after the append equals the reference
  over the written cache; a token without a page is refused."""
  q, kp, _, table, lengths = _cache(
      11, batch=2, q_len=1, heads=16, kv_heads=1, head_dim=80, page=16,
      pages_per_seq=3, lengths=[5, 16], dtype=jnp.float32)
  q, pages = q.astype(jnp.bfloat16), kp[:, :, 0].astype(jnp.bfloat16)
  table = jnp.asarray(np.asarray(table) % pages.shape[0])
  new = jax.random.normal(jax.random.key(4), (2, 3, 80), jnp.bfloat16)
  bf16, len2 = paged.append_latent(pages, table, lengths, new)
  np.testing.assert_array_equal(len2, [8, 19])
  for b, t in itertools.product(range(2), range(3)):
    pos = int(lengths[b]) + t
    np.testing.assert_array_equal(bf16[int(table[b, pos // 16]), pos % 16],
                                  new[b, t])
  cache = paged.quantize_latent(pages, v_head_dim=64, block=32)
  fp8, len3 = jax.jit(paged.append_latent)(cache, table, lengths, new)
  np.testing.assert_array_equal(len3, len2)
  for got, want in zip(fp8, paged.quantize_latent(bf16, v_head_dim=64,
                                                  block=32)):
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(want, np.float32))
  kw = dict(v_head_dim=64, interpret=True)
  out = paged.mla_attention(q, fp8, table, len3, **kw)
  deq = fp8.dequantize(jnp.bfloat16)[:, :, None]
  want, _ = reference.paged_attention(q, deq, deq[..., :64], table, len3)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(want, np.float32), atol=2e-2)
  with pytest.raises(ValueError, match="new must be"):
    paged.append_latent(pages, table, lengths, new[..., :64])
  with pytest.raises(ValueError, match="capacity 48"):
    paged.append_latent(pages, table, lengths, jnp.zeros((2, 40, 80)))


def test_bad_arguments():
  q, kp, vp, table, lengths = _cache(7, batch=2, q_len=1, heads=4,
                                     kv_heads=2, head_dim=32, page=16,
                                     pages_per_seq=2, lengths=[3, 4],
                                     dtype=jnp.bfloat16)
  call = paged.paged_attention
  with pytest.raises(ValueError, match="kv_lengths must lie in"):
    call(q, kp, vp, table, jnp.asarray([3, 33]))
  with pytest.raises(ValueError, match="kv_lengths must be an integer"):
    call(q, kp, vp, table, jnp.asarray([3.0, 4.0]))
  with pytest.raises(ValueError, match="page_indices must be an integer"):
    call(q, kp, vp, table[0], lengths)
  with pytest.raises(ValueError, match="must match"):
    call(q, kp, vp[:, :, :1], table, lengths)
  with pytest.raises(ValueError, match="share head_dim and dtype"):
    call(q.astype(jnp.float16), kp, vp, table, lengths)
  with pytest.raises(ValueError, match="heads=4 must be a multiple"):
    call(q, kp[:, :, :1].repeat(3, 2), vp[:, :, :1].repeat(3, 2), table,
         lengths)
  with pytest.raises(ValueError, match="page_size=12"):
    call(q, kp[:, :12], vp[:, :12], table, lengths)
  with pytest.raises(ValueError, match="implementation='cuda'"):
    call(q, kp, vp, table, lengths, implementation="cuda")
  with pytest.raises(NotImplementedError, match="page_size=8"):
    call(q, kp[:, :8], vp[:, :8], table, lengths, implementation="triton",
         interpret=True)
  with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
    call(q, kp, vp, table, lengths, implementation="triton")


def test_paged_kv_cache_and_allocator():
  """Prompts of different lengths written into pages handed out on
  demand, then a decode step: the cache's attention equals the reference
  over each sequence's keys in order; a token with no page is refused
  (never written to a wrapped index); pages go back to the allocator."""
  alloc = paged.PageAllocator(8)
  cache = paged.PagedKVCache.create(num_pages=8, page_size=8, kv_heads=1,
                                    head_dim=16, batch=2,
                                    pages_per_sequence=3, dtype=jnp.float32)
  k = jax.random.normal(jax.random.key(8), (2, 12, 1, 16))
  v = jax.random.normal(jax.random.key(9), (2, 12, 1, 16))
  with pytest.raises(ValueError, match=r"no page for token 0 of sequence 0"):
    cache.append(k, v)
  cache = cache.with_pages(0, 0, alloc.allocate(2))
  cache = cache.with_pages(1, 0, alloc.allocate(2))
  assert alloc.free == 4
  cache = cache.append(k, v)
  np.testing.assert_array_equal(cache.kv_lengths, [12, 12])
  q = jax.random.normal(jax.random.key(10), (2, 1, 2, 16))
  out = jax.jit(lambda c, q: c.attention(q))(cache, q)
  for b in range(2):
    want, _ = reference.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                  causal=True)
    np.testing.assert_allclose(out[b], want[0], atol=1e-5)
  alloc.release(cache.page_indices[0, :2])
  assert alloc.free == 6
  with pytest.raises(ValueError, match="were not handed out"):
    alloc.release([0, 0])
  with pytest.raises(ValueError, match="7 pages asked, 6 of 8 free"):
    alloc.allocate(7)


def test_paged_kv_cache_donates():
  """A fresh cache goes to a jit'ed step with its buffers donated (keys
  and values are two buffers, not one)."""
  cache = paged.PagedKVCache.create(num_pages=2, page_size=8, kv_heads=1,
                                    head_dim=16, batch=1,
                                    pages_per_sequence=2, dtype=jnp.float32)
  cache = cache.with_pages(0, 0, [1, 0])
  k = jnp.ones((1, 3, 1, 16))
  step = jax.jit(lambda c, k, v: c.append(k, v), donate_argnums=0)
  cache = step(cache, k, 2 * k)
  np.testing.assert_array_equal(cache.kv_lengths, [3])
  np.testing.assert_array_equal(cache.v_pages[1, :3], 2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("q_len,batch,kv_len", [(1, 1, 8192), (1, 16, 1000),
                                                 (4, 4, 3001)])
def test_gpu_kernel(page, q_len, batch, kv_len, impl):
  """The compiled split-K kernels on a GPU (Llama-3-8B's heads, 32:8,
  head_dim 128): one sequence split over many programs, a batch of
  unequal lengths, speculative rows; by the numerics rule."""
  per_seq = -(-kv_len // page)
  lengths = [kv_len - 37 * b for b in range(batch)]
  args = _cache(12, batch=batch, q_len=q_len, heads=32, kv_heads=8,
                head_dim=128, page=page, pages_per_seq=per_seq,
                lengths=lengths, dtype=jnp.bfloat16)
  got = jax.jit(lambda *a: paged.paged_attention(
      *a, return_lse=True, implementation=impl))(*args)
  _check(got, args)


@pytest.mark.gpu
@pytest.mark.parametrize("d,q_len,kw", [
    (64, 1, dict(local_window_size=300, logits_soft_cap=30.0)),
    (256, 1, {}), (128, 40, {})])
def test_gpu_hopper_forms(d, q_len, kw):
  """The compiled Hopper kernel at head_dims 64 (window, soft cap), 256,
  and a 40-token chunk of 32:8 heads (three row tiles per key/value
  head)."""
  args = _cache(14, batch=3, q_len=q_len, heads=32, kv_heads=8,
                head_dim=d, page=64, pages_per_seq=40,
                lengths=[2560, 1000, 41], dtype=jnp.bfloat16)
  got = jax.jit(lambda *a: paged.paged_attention(
      *a, return_lse=True, implementation="mosaic_gpu", **kw))(*args)
  _check(got, args, logits_soft_cap=kw.get("logits_soft_cap"),
         window_left=paged._window_left(kw.get("local_window_size")))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len,causal", [(1, True), (4, False)])
def test_gpu_decode_route(q_len, causal):
  """flash_attention's decode route on a GPU (default dispatch: the
  Hopper backend on an H100/H200), 32:8 heads, head_dim 128, 8192 cached
  keys with unequal lengths: outputs and gradients by the numerics
  rule."""
  q, k, v, do, dlse = random_inputs(jax.random.key(9), batch=3, q_len=q_len,
                                    kv_len=8192, heads=32, kv_heads=8,
                                    head_dim=128, dtype=jnp.bfloat16)
  kw = dict(causal=causal,
            kv_seq_lengths=jnp.asarray([8192, 5000, 1], jnp.int32))
  fn = lambda q, k, v: jaxflash.flash_attention(q, k, v, return_lse=True,
                                                **kw)
  assert "jaxflash_paged_decode" in str(jax.make_jaxpr(fn)(q, k, v))
  check_rule(outputs_and_grads(fn, q, k, v, do, dlse), q, k, v, do, dlse,
             **reference_kwargs(**kw))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
def test_gpu_fp8_cache(page):
  """The compiled kernel over an e4m3 cache (32:8 heads, head_dim 128,
  unequal lengths up to 4096), by the numerics rule against the
  dequantized reference."""
  q, kp, vp, table, lengths = _cache(
      13, batch=3, q_len=1, heads=32, kv_heads=8, head_dim=128, page=page,
      pages_per_seq=4096 // page, lengths=[4096, 1000, 1],
      dtype=jnp.float32)
  (k8, ks), (v8, vs) = (jaxflash.quantize_fp8(x, axis=2) for x in (kp, vp))
  args = (q.astype(jnp.bfloat16), k8, v8, table, lengths)
  got = jax.jit(lambda *a: paged.paged_attention(
      *a, k_scale=ks, v_scale=vs, return_lse=True,
      implementation="triton"))(*args)
  _check(got, args, k_scale=ks, v_scale=vs)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len,fp8_latent", [
    (128, 1, False), (16, 2, False), (128, 1, True)])
def test_gpu_mla(heads, q_len, fp8_latent):
  """The compiled latent-attention kernel at DeepSeek's widths (576 / 512,
  pages of 64, lengths up to 4096), by the numerics rule; and over
  FlashMLA's FP8 latent (against the reference of the dequantized
  cache)."""
  q, kp, _, table, lengths = _cache(
      14, batch=3, q_len=q_len, heads=heads, kv_heads=1, head_dim=576,
      page=64, pages_per_seq=64, lengths=[4096, 1000, 1],
      dtype=jnp.float32)
  q, kp = q.astype(jnp.bfloat16), kp.astype(jnp.bfloat16)
  cache = kp[:, :, 0]
  if fp8_latent:
    cache = paged.quantize_latent(cache)
    kp = cache.dequantize(jnp.bfloat16)[:, :, None]
  got = jax.jit(lambda q, p, t, n: paged.mla_attention(
      q, p, t, n, softmax_scale=192 ** -0.5, return_lse=True,
      implementation="triton"))(q, cache, table, lengths)
  _check(got, (q, kp, kp[..., :512], table, lengths),
         softmax_scale=192 ** -0.5)
