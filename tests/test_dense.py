"""Dense bias and boolean mask (jax.nn's ``bias`` / ``mask``) in the Triton
kernels (interpreter) against the reference: outputs, gradients and the
bias's gradient for each broadcast form; tiles the mask hides are skipped;
vmap and batch/head sharding (8 CPU devices); the argument checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import check_rule, outputs_and_grads, random_inputs

import jaxflash
from jaxflash import mosaic_gpu
from jaxflash.masks import MaskArrays, MaskSpec
from jaxflash.triton import backend as triton_backend

TILES = jaxflash.TritonConfig(block_q=16, block_k=16, block_q_dkv=16,
                              block_k_dkv=16, block_q_dq=16, block_k_dq=16)

CASES = [
    pytest.param(dict(batch=2, q_len=70, kv_len=90, heads=4, kv_heads=2,
                      head_dim=32, dtype=jnp.float32),
                 (1, 4, 70, 90), (2, 1, 70, 90), dict(causal=True),
                 id="gqa-causal-bias-heads-mask-rows"),
    pytest.param(dict(batch=2, q_len=33, kv_len=48, heads=3, kv_heads=1,
                      head_dim=16, dtype=jnp.float32),
                 (2, 1, 1, 48), (1, 3, 1, 48),
                 dict(kv_seq_lengths=jnp.asarray([48, 20]),
                      segment_ids=(jnp.asarray([[0] * 20 + [1] * 13] * 2),
                                   jnp.asarray([[0] * 30 + [1] * 18] * 2))),
                 id="mqa-key-bias-head-mask-segments-lengths",
                 marks=pytest.mark.slow),
    pytest.param(dict(batch=1, q_len=64, kv_len=64, heads=2, kv_heads=2,
                      head_dim=64, dtype=jnp.bfloat16),
                 (1, 2, 64, 64), None, dict(local_window_size=(20, 5)),
                 id="bf16-window-bias", marks=pytest.mark.slow),
]


def _dense(shape_b, shape_m, seed=1):
  kb, km = jax.random.split(jax.random.key(seed))
  bias = None if shape_b is None else 2.0 * jax.random.normal(kb, shape_b)
  mask = None
  if shape_m is not None:
    mask = jax.random.bernoulli(km, 0.7, shape_m)
    mask = mask.at[..., 2, :].set(False)  # a row (or every row) hidden
  return bias, mask


def _reference_kwargs(kw, bias, mask, q_len, kv_len):
  ref = dict(causal=kw.get("causal", False),
             window=kw.get("local_window_size", (None, None)),
             kv_seq_lengths=kw.get("kv_seq_lengths"))
  if "segment_ids" in kw:
    ref["segment_ids"] = kw["segment_ids"]
  if bias is not None:
    ref["bias"] = jnp.broadcast_to(bias, (*bias.shape[:3], kv_len))
  if mask is not None:
    ref["dense_mask"] = jnp.broadcast_to(mask, (*mask.shape[:3], kv_len))
  return {n: x for n, x in ref.items() if x is not None}


@pytest.mark.parametrize("shape,bias_shape,mask_shape,kw", CASES)
def test_kernels_keep_the_numerics_rule(shape, bias_shape, mask_shape, kw):
  """Out, LSE, dQ, dK, dV keep the numerics rule; the bias's gradient
  (summed over its broadcast axes) matches the reference's; no NaN where
  the mask hides a whole row."""
  q, k, v, do, dlse = random_inputs(jax.random.key(0), **shape)
  bias, mask = _dense(bias_shape, mask_shape)
  fn = lambda q, k, v, bias=bias: jaxflash.flash_attention(
      q, k, v, bias=bias, mask=mask, implementation="triton",
      interpret=True, return_lse=True, config=TILES, **kw)
  got = outputs_and_grads(fn, q, k, v, do, dlse)
  check_rule(got, q, k, v, do, dlse, **_reference_kwargs(
      kw, bias, mask, shape["q_len"], shape["kv_len"]))
  if bias is None:
    return
  # The bias's gradient: d/d bias of <out, do> + <lse, dlse>.
  def loss(impl, bias):
    out, lse = jaxflash.flash_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), bias=bias, mask=mask,
        implementation=impl, interpret=impl == "triton", return_lse=True,
        config=TILES if impl == "triton" else None, **kw)
    return (jnp.sum(out * do.astype(jnp.float32))
            + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse * dlse)))
  got = jax.jit(jax.grad(functools.partial(loss, "triton")))(bias)
  want = jax.jit(jax.grad(functools.partial(loss, "xla")))(bias)
  assert got.shape == bias.shape
  np.testing.assert_allclose(got, want, atol=2e-5 * max(
      1.0, float(jnp.abs(want).max())))


def test_infinite_bias_and_hidden_rows_give_zeros_not_nan():
  """A bias of -inf hides keys as a mask does (even on tiles the masks
  leave whole); rows with every key hidden give output 0, LSE -inf and
  zero gradients."""
  q, k, v, do, _ = random_inputs(jax.random.key(2), batch=1, q_len=32,
                                 kv_len=32, heads=2, kv_heads=2, head_dim=16,
                                 dtype=jnp.float32)
  bias = jnp.zeros((1, 2, 32, 32)).at[:, :, :16].set(-jnp.inf)
  bias = bias.at[:, :, 20:, 5].set(-jnp.inf)
  fn = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, bias=bias, implementation="triton", interpret=True,
      return_lse=True, config=TILES)
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  grads = vjp((do, jnp.zeros_like(lse)))
  for x in (out, *grads):
    assert not np.isnan(np.asarray(x)).any()
  np.testing.assert_array_equal(out[:, :16], 0)
  assert np.isneginf(np.asarray(lse[:, :, :16])).all()
  want = jaxflash.flash_attention(q, k, v, bias=bias, implementation="xla")
  np.testing.assert_allclose(out, want, atol=2e-5)


def test_hidden_tiles_are_skipped():
  """A block-diagonal dense mask leaves the forward kernel one key tile
  per query tile (of 16 x 16 tiles), as segment ids would."""
  q = jnp.ones((1, 64, 1, 16))
  blocks = jnp.arange(64) // 16
  mask = (blocks[:, None] == blocks[None, :])[None, None]
  arrays = MaskArrays(dense_mask=mask)
  counts = triton_backend.count_visited_tiles(
      q, q, q, mask=MaskSpec(64, 64), arrays=arrays, config=TILES,
      interpret=True)
  np.testing.assert_array_equal(counts, 1)
  counts = triton_backend.count_visited_tiles(
      q, q, q, mask=MaskSpec(64, 64, causal=True),
      arrays=MaskArrays(dense_mask=jnp.ones((1, 1, 1, 64), bool)),
      config=TILES, interpret=True)
  np.testing.assert_array_equal(counts[0, 0], np.arange(64) // 16 + 1)


def _grad_of_vmapped_sum(f, axis, qs, bias):
  mapped = jax.vmap(f, in_axes=(0, axis))
  return jax.grad(lambda qs, b: jnp.sum(mapped(qs, b)), argnums=1)(qs, bias)


@pytest.mark.slow
@pytest.mark.parametrize("mapped", [False, True])
def test_vmap_over_a_batched_or_shared_bias(mapped):
  """vmap with the bias mapped (broadcast over its batch rows) or not
  (shared by every mapped slice): gradients equal a loop over the slices,
  per slice under vmap(grad), summed under grad of the vmapped sum."""
  q, k, v, _, _ = random_inputs(jax.random.key(4), batch=2, q_len=16,
                                kv_len=16, heads=2, kv_heads=1, head_dim=16,
                                dtype=jnp.float32)
  qs = jnp.stack([q, 2 * q, -q])
  bias_b = jax.random.normal(jax.random.key(5), (3, 1, 2, 16, 16))
  bias_s = bias_b[0]
  f = lambda q, b: jnp.sum(jnp.sin(jaxflash.flash_attention(
      q, k, v, bias=b, implementation="triton", interpret=True,
      config=TILES)))
  g = jax.grad(f, argnums=(0, 1))
  for bias, axis in ((bias_b, 0),) if mapped else ((bias_s, None),):
    got = jax.vmap(g, in_axes=(0, axis))(qs, bias)
    want = [g(qs[i], bias if axis is None else bias[i]) for i in range(3)]
    np.testing.assert_allclose(got[0], jnp.stack([w[0] for w in want]),
                               atol=1e-5)
    want_db = jnp.stack([w[1] for w in want])
    np.testing.assert_allclose(got[1], want_db, atol=1e-5)
    summed = _grad_of_vmapped_sum(f, axis, qs, bias)
    np.testing.assert_allclose(summed, want_db if axis is not None
                               else want_db.sum(0), atol=1e-5)


@pytest.mark.parametrize("axis_type,flash", [
    pytest.param(AxisType.Explicit, False, marks=pytest.mark.slow),
    (AxisType.Auto, True),
    pytest.param(AxisType.Auto, False, marks=pytest.mark.slow),
    pytest.param(AxisType.Explicit, True, marks=pytest.mark.slow)],
    ids=["Explicit-dense", "Auto-flashmask", "Auto-dense",
         "Explicit-flashmask"])
def test_sharded_bias_and_mask_match_single_device(axis_type, flash):
  """Batch and heads sharded over a (2, 4) mesh with a bias full in heads
  but shared by the batch rows, ALiBi slopes per head, and a mask per row
  (dense, or a FlashMask of causal documents): outputs and gradients (the
  bias's summed over every shard) equal the one-device call."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets 8 CPU devices)")
  mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(axis_type,) * 2)
  q, k, v, do, _ = random_inputs(jax.random.key(6), batch=4, q_len=32,
                                 kv_len=32, heads=8, kv_heads=4, head_dim=16,
                                 dtype=jnp.float32)
  bias, mask = _dense((1, 8, 32, 32), (4, 1, 32, 32), seed=7)
  mask_spec = P("data", None, None, None)
  if flash:
    from jaxflash import FlashMask
    seg = jnp.asarray([[0] * 10 + [1] * 22, [0] * 32] * 2, jnp.int32)
    mask = FlashMask.causal_document(seg)
    mask_spec = P("data", None, None)

  slopes = 2.0 ** -jnp.arange(1, 9, dtype=jnp.float32)

  def run(q, k, v, do, bias, mask):
    attend = lambda q, k, v, b: jaxflash.flash_attention(
        q, k, v, bias=b, mask=mask, causal=True, implementation="triton",
        interpret=True, config=TILES, alibi_slopes=slopes)
    out, vjp = jax.vjp(attend, q, k, v, bias)
    return (out, *vjp(do))

  want = jax.jit(run)(q, k, v, do, bias, mask)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  qs, kvs = P("data", None, "tensor", None), P("data", None, "tensor", None)
  got = jax.jit(run)(put(q, qs), put(k, kvs), put(v, kvs), put(do, qs),
                     put(bias, P(None, "tensor", None, None)),
                     jax.tree.map(lambda x: put(x, mask_spec), mask))
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-5)


def test_dense_errors():
  q = jnp.ones((2, 16, 4, 16))
  for kw, err, match in [
      (dict(bias=jnp.zeros((2, 3, 16, 16))), ValueError,
       r"bias must have shape \[B, N, T, S\] = \(2, 4, 16, 16\)"),
      (dict(bias=jnp.zeros((16, 16))), ValueError, "bias must have shape"),
      (dict(mask=jnp.ones((1, 1, 16, 16), jnp.int8)), ValueError,
       "mask must be a bool array, got dtype int8"),
      (dict(bias=jnp.zeros((1, 1, 16, 16), jnp.int32)), ValueError,
       "bias must be a floating-point array"),
      (dict(bias=jnp.zeros((1, 1, 16, 16)), logits_soft_cap=3.0),
       NotImplementedError, "does not combine with logits_soft_cap"),
  ]:
    with pytest.raises(err, match=match):
      jaxflash.flash_attention(q, q, q, implementation="triton",
                               interpret=True, **kw)
  # The Hopper forward takes a dense mask, but not with a FlashMask too
  # (no public argument gives both; the kernels' check refuses them).
  b = q.astype(jnp.bfloat16)
  fm = jaxflash.flashmask.columns(jaxflash.FlashMask.prefix_lm(
      jnp.asarray([4, 9]), 16))
  with pytest.raises(NotImplementedError, match="not both"):
    mosaic_gpu.check_supported(
        b, b, b, arrays=MaskArrays(dense_mask=jnp.ones((1, 1, 16, 16), bool),
                                   flash_mask=fm),
        logits_soft_cap=None, config=None, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_dense(causal):
  """The default dispatch (on Hopper the Hopper forward, with the bias's
  ring and the dense mask's tiles, and the Triton backward) with a bias
  per head and a mask per batch row at 2 x 1024 tokens, 8:2 heads,
  head_dim 128, bf16: the numerics rule, and the bias's gradient against
  the reference's."""
  q, k, v, do, dlse = random_inputs(jax.random.key(3), batch=2, q_len=1024,
                                    kv_len=1024, heads=8, kv_heads=2,
                                    head_dim=128, dtype=jnp.bfloat16)
  bias, mask = _dense((1, 8, 1024, 1024), (2, 1, 1024, 1024))
  bias = bias.astype(jnp.bfloat16)
  fn = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, bias=bias, mask=mask, causal=causal, return_lse=True)
  check_rule(outputs_and_grads(fn, q, k, v, do, dlse), q, k, v, do, dlse,
             **_reference_kwargs(dict(causal=causal), bias, mask, 1024,
                                 1024))
  loss = lambda impl: jax.jit(jax.grad(lambda b: jnp.sum(
      jaxflash.flash_attention(q, k, v, bias=b, mask=mask, causal=causal,
                               implementation=impl).astype(jnp.float32)
      * do.astype(jnp.float32))))(bias)
  got, want = loss(None), loss("xla")
  err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
  assert err.max() <= 2 ** -6 * max(1.0, float(jnp.abs(want).max()))


@pytest.mark.slow
@pytest.mark.parametrize("per_row", [False, True])
def test_alibi_equals_its_bias(per_row):
  """ALiBi slopes ([heads], or [batch, heads]) in the kernels give the
  results of the explicit bias ``-slope |i + kv_len - q_len - j|``
  (FlashAttention-2's), forward and gradients; dot_product_attention
  aligns it top-left."""
  q, k, v, do, dlse = random_inputs(jax.random.key(8), batch=2, q_len=40,
                                    kv_len=72, heads=4, kv_heads=2,
                                    head_dim=16, dtype=jnp.float32)
  slopes = 2.0 ** -jnp.arange(1, 5, dtype=jnp.float32)
  if per_row:
    slopes = jnp.stack([slopes, slopes[::-1]])
  sl = slopes.reshape(-1, 4, 1, 1)
  dist = jnp.abs(jnp.arange(40)[:, None] + 32 - jnp.arange(72)[None, :])
  fn = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, alibi_slopes=slopes, causal=True, implementation="triton",
      interpret=True, return_lse=True, config=TILES)
  check_rule(outputs_and_grads(fn, q, k, v, do, dlse), q, k, v, do, dlse,
             causal=True, bias=-sl * dist)
  top_left = jaxflash.dot_product_attention(
      q, k, v, alibi_slopes=slopes, implementation="triton", interpret=True)
  dist = jnp.abs(jnp.arange(40)[:, None] - jnp.arange(72)[None, :])
  want = jax.nn.dot_product_attention(q, k, v, bias=-sl * dist)
  np.testing.assert_allclose(top_left, want, atol=2e-5)
  for bad, match in ((jnp.ones(3), r"shape \(heads,\) = \(4,\)"),
                     (jnp.ones(4, jnp.int32), "must be floating-point")):
    with pytest.raises(ValueError, match=match):
      jaxflash.flash_attention(q, k, v, alibi_slopes=bad)


# -- FlashMask in the kernels -------------------------------------------------

def _flash_masks(batch: int, seq: int):
  from jaxflash import FlashMask
  seg = jnp.asarray([[0] * 20 + [1] * 30 + [2] * (seq - 50),
                     [0] * (seq - 20) + [1] * 20])[:batch]
  answers = jnp.asarray([[0] * 12 + [1] * 20 + [2] * (seq - 32),
                         [0] * 30 + [1] * (seq - 30)])[:batch]
  cols = jax.random.randint(jax.random.key(9), (batch, 1, 4, seq), 0, seq)
  return {
      "causal-document": FlashMask.causal_document(seg),
      "prefix-lm": FlashMask.prefix_lm(jnp.asarray([10, 33])[:batch], seq),
      "sliding-window": FlashMask.sliding_window(seq, 9),
      "global-and-window": FlashMask.global_and_window(seq, 4, 12),
      "shared-question": FlashMask.shared_question(answers),
      "random-ranges": FlashMask(*(cols[:, :, i] for i in range(4))),
  }


@pytest.mark.parametrize("pattern", [
    "causal-document",
    pytest.param("random-ranges", marks=pytest.mark.slow),
    pytest.param("prefix-lm", marks=pytest.mark.slow),
    pytest.param("shared-question", marks=pytest.mark.slow),
    pytest.param("sliding-window", marks=pytest.mark.slow),
    pytest.param("global-and-window", marks=pytest.mark.slow)])
def test_flashmask_patterns_keep_the_numerics_rule(pattern):
  """Each FlashMask pattern (GQA 4:2, 70 tokens, 16 x 16 tiles) keeps the
  numerics rule against the reference given its dense form; rows it hides
  entirely (random ranges) give zeros, not NaN."""
  q, k, v, do, dlse = random_inputs(jax.random.key(0), batch=2, q_len=70,
                                    kv_len=70, heads=4, kv_heads=2,
                                    head_dim=32, dtype=jnp.float32)
  fm = _flash_masks(2, 70)[pattern]
  fn = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, mask=fm, implementation="triton", interpret=True,
      return_lse=True, config=TILES)
  check_rule(outputs_and_grads(fn, q, k, v, do, dlse), q, k, v, do, dlse,
             dense_mask=fm.check(2, 4, 70, 70).dense(70))


@pytest.mark.slow
def test_flashmask_per_head_with_other_masks_and_cross_lengths():
  """A FlashMask per head, with q_len != kv_len (its rows are query
  positions, top-left), causal (bottom-right) and kv lengths ANDed in."""
  from jaxflash import FlashMask
  q, k, v, do, dlse = random_inputs(jax.random.key(1), batch=2, q_len=40,
                                    kv_len=72, heads=2, kv_heads=1,
                                    head_dim=16, dtype=jnp.float32)
  ends = jax.random.randint(jax.random.key(2), (1, 2, 72), 0, 41)
  fm = FlashMask(lt_start=ends // 2, lt_end=ends)
  lengths = jnp.asarray([72, 50])
  fn = lambda q, k, v: jaxflash.flash_attention(
      q, k, v, mask=fm, causal=True, kv_seq_lengths=lengths,
      implementation="triton", interpret=True, return_lse=True, config=TILES)
  check_rule(outputs_and_grads(fn, q, k, v, do, dlse), q, k, v, do, dlse,
             causal=True, kv_seq_lengths=lengths,
             dense_mask=fm.check(2, 2, 40, 72).dense(40))


def test_flashmask_skips_tiles_like_segment_ids():
  """Causal documents as a FlashMask visit the key tiles that the same
  documents as segment ids visit."""
  from jaxflash import FlashMask, flashmask
  seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 32)[None]
  q = jnp.ones((1, 128, 1, 16))
  cols = flashmask.columns(FlashMask.causal_document(seg).check(1, 1, 128,
                                                                128))
  spec = MaskSpec(128, 128, causal=True)
  as_flash = triton_backend.count_visited_tiles(
      q, q, q, mask=MaskSpec(128, 128), arrays=MaskArrays(flash_mask=cols),
      config=TILES, interpret=True)
  as_segments = triton_backend.count_visited_tiles(
      q, q, q, mask=spec, arrays=MaskArrays(seg, seg), config=TILES,
      interpret=True)
  np.testing.assert_array_equal(as_flash, as_segments)
  assert int(as_flash.max()) == 2  # a document is two 16-tiles


@pytest.mark.parametrize("q_len,kv_len", [(16, 16), (12, 16), (16, 12)])
def test_flashmask_causal_mode_at_any_alignment(q_len, kv_len, monkeypatch):
  """FlashMask's causal mode (``is_causal``) is the mask of its explicit
  upper range ``[0, j)`` in flash_attention (causal bottom-right) and
  dot_product_attention (top-left), with and without the call's causal;
  where the alignments agree the call runs it as its causal mask with the
  lower range alone (one column row), else as three rows."""
  from jaxflash import FlashMask, api
  seen = []
  attention = api.backends.attention

  def spy(backend, q, k, v, *, mask, arrays, **kw):
    seen.append((mask.causal, arrays.flash_mask.shape[2]))
    return attention(backend, q, k, v, mask=mask, arrays=arrays, **kw)

  monkeypatch.setattr(api.backends, "attention", spy)
  q, k, v, _, _ = random_inputs(jax.random.key(3), batch=2, q_len=q_len,
                                kv_len=kv_len, heads=2, kv_heads=2,
                                head_dim=16, dtype=jnp.float32)
  seg = jnp.asarray([[0] * 5 + [1] * (kv_len - 5),
                     [0] * (kv_len - 3) + [1] * 3])
  fm = FlashMask(lt_start=FlashMask.causal_document(seg).lt_start
                 .at[:, :, kv_len - 1].set(q_len), is_causal=True)
  for entry in ("flash", "dpa"):
    for causal in (False, True):
      def run(m, entry=entry, causal=causal):
        if entry == "flash":
          return jaxflash.flash_attention(q, k, v, mask=m, causal=causal,
                                          implementation="xla")
        return jaxflash.dot_product_attention(q, k, v, mask=m,
                                              is_causal=causal,
                                              implementation="xla")
      seen.clear()
      got, want = run(fm), run(fm.explicit())
      np.testing.assert_allclose(got, want, atol=1e-6)
      folds = entry == "dpa" or q_len == kv_len
      assert seen[0] == ((True, 1) if folds else (causal, 3)), (entry,
                                                               causal)


def test_flashmask_errors():
  from jaxflash import FlashMask
  q = jnp.ones((2, 16, 4, 16))
  for fm, match in [
      (FlashMask(jnp.zeros((2, 4, 15), jnp.int32)), "last axis 15 must"),
      (FlashMask(jnp.zeros((3, 1, 16), jnp.int32)), "batch axis 3 must"),
      (FlashMask(jnp.zeros((1, 1, 16))), "must have an integer dtype"),
      (FlashMask(jnp.zeros((16,), jnp.int32)), r"\(rank 3\)"),
  ]:
    with pytest.raises(ValueError, match=match):
      jaxflash.flash_attention(q, q, q, mask=fm, implementation="xla")
  with pytest.raises(ValueError, match="ut_start and ut_end come together"):
    FlashMask(jnp.zeros((1, 1, 16), jnp.int32), ut_start=jnp.zeros(16))


def test_vmap_folds_dense_arrays_of_any_batch():
  """vmap over q with a closed-over bias of batch 2 (tiled over the
  mapped slices, not read past its rows), and over the bias alone with q
  closed over (each slice's bias broadcast to q's batch rows): the
  kernels give the reference's outputs."""
  q, k, v, _, _ = random_inputs(jax.random.key(10), batch=2, q_len=32,
                                kv_len=32, heads=2, kv_heads=2, head_dim=16,
                                dtype=jnp.float32)
  bias = 3.0 * jax.random.normal(jax.random.key(11), (2, 2, 32, 32))
  biases = 3.0 * jax.random.normal(jax.random.key(12), (3, 1, 2, 32, 32))
  run = lambda impl, q, b: jaxflash.flash_attention(
      q, k, v, bias=b, implementation=impl, interpret=impl == "triton",
      config=TILES if impl == "triton" else None)
  qs = jnp.stack([q, 2 * q, -q])
  for args, axes in (((qs, bias), (0, None)), ((q, biases), (None, 0))):
    got = jax.vmap(lambda a, b: run("triton", a, b), in_axes=axes)(*args)
    want = jax.vmap(lambda a, b: run("xla", a, b), in_axes=axes)(*args)
    np.testing.assert_allclose(got, want, atol=2e-5)
