"""Segment ids, local windows, sequence lengths and soft-capping in the
Triton kernels (interpret mode): numerics, exactness, tile skipping."""

import functools

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxflash
import jaxflash.triton as triton_backend
from jaxflash import masks, reference

TILES = jaxflash.TritonConfig(
    block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32,
    block_k_dq=16)


def packed_segments(key, batch, length, n_docs, pad_tail=0):
  """Sorted document ids 0.. with random boundaries; a padded tail."""
  cuts = jnp.sort(jax.random.randint(key, (batch, n_docs - 1), 1, length),
                  axis=1)
  ids = (jnp.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1)
  ids = ids.astype(jnp.int32)
  if pad_tail:
    ids = ids.at[:, length - pad_tail:].set(masks.PAD_SEGMENT_ID)
  return ids


def _run(args, interpret=True, config=TILES, **kw):
  fn = functools.partial(jaxflash.flash_attention, return_lse=True,
                         implementation="triton", interpret=interpret,
                         config=config, **kw)
  return numerics.outputs_and_grads(fn, *args)


def mask_kwargs(seed, t, s, *, causal=False, segments=None, window=None,
                q_seq_lengths=None, kv_seq_lengths=None, soft_cap=None):
  """flash_attention's mask keywords; ``segments``: None, ``("self",
  n_docs, pad_tail)`` (one packed array, t == s), ``("pair", n_docs)``
  (packed query and key ids, any lengths) or ``"random"``
  (non-contiguous ids and padding)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  kw = dict(causal=causal)
  if segments is not None and segments[0] == "self":
    _, n_docs, pad_tail = segments
    kw["segment_ids"] = packed_segments(k1, 2, t, n_docs, pad_tail=pad_tail)
  elif segments is not None and segments[0] == "pair":
    kw["segment_ids"] = (packed_segments(k1, 2, t, segments[1]),
                         packed_segments(k2, 2, s, segments[1]))
  elif segments == "random":
    kw["segment_ids"] = (jax.random.randint(k1, (2, t), -1, 3),
                         jax.random.randint(k2, (2, s), -1, 3))
  if window is not None:
    kw["local_window_size"] = window
  if q_seq_lengths is not None:
    kw["q_seq_lengths"] = jnp.array(q_seq_lengths)
  if kv_seq_lengths is not None:
    kw["kv_seq_lengths"] = jnp.array(kv_seq_lengths)
  if soft_cap is not None:
    kw["logits_soft_cap"] = soft_cap
  return kw


@st.composite
def mask_cases(draw):
  t = draw(st.integers(1, 130))
  same = draw(st.booleans())
  s = t if same else draw(st.integers(1, 130))
  heads, kv_heads = draw(st.sampled_from([(2, 2), (4, 2), (3, 1)]))
  seed = draw(st.integers(0, 2**16))
  seg_kind = draw(st.sampled_from([None, "self", "pair", "random"]))
  segments = None
  if seg_kind == "self" and same:
    segments = ("self", draw(st.integers(1, 6)),
                draw(st.integers(0, 5)) % t)
  elif seg_kind == "pair":
    segments = ("pair", draw(st.integers(1, 4)))
  elif seg_kind == "random":
    segments = "random"
  lengths = lambda n: st.lists(st.integers(0, n), min_size=2, max_size=2)
  kw = mask_kwargs(
      seed, t, s, causal=draw(st.booleans()), segments=segments,
      window=draw(st.one_of(st.none(), st.tuples(st.integers(0, 60),
                                                 st.integers(0, 60)))),
      q_seq_lengths=draw(st.one_of(st.none(), lengths(t))),
      kv_seq_lengths=draw(st.one_of(st.none(), lengths(s))),
      soft_cap=draw(st.one_of(st.none(),
                              st.sampled_from([1.0, 5.0, 30.0]))))
  dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
  return (t, s, heads, kv_heads, dtype, seed), kw


# Every commit's cases (`make test`): together every mask kind, each
# combined with others -- packed self-attention ids with a padded tail,
# query/key id pairs, random non-contiguous ids with padding, windows
# aligned bottom-right at q_len < kv_len and q_len > kv_len, one-sided
# windows, causal, per-row lengths (a zero one too), soft caps -- in
# float32 and bfloat16, MHA/GQA/MQA.  Hypothesis draws many more
# (`slow`, `make test-all`).
EXPLICIT = {
    "packed-causal-softcap-gqa-bf16": (
        (70, 70, 4, 2, jnp.bfloat16, 1),
        dict(causal=True, segments=("self", 4, 5), soft_cap=5.0)),
    "pairs-window-lengths-mqa-f32": (
        (37, 90, 3, 1, jnp.float32, 2),
        dict(segments=("pair", 3), window=(20, 3),
             q_seq_lengths=[37, 20], kv_seq_lengths=[90, 41])),
    "random-ids-causal-window-zero-length-mha-bf16": (
        (90, 37, 2, 2, jnp.bfloat16, 3),
        dict(causal=True, segments="random", window=(0, 10),
             kv_seq_lengths=[0, 30], soft_cap=30.0)),
}


def _explicit(name):
  (t, s, heads, kv_heads, dtype, seed), kw = EXPLICIT[name]
  return (t, s, heads, kv_heads, dtype, seed), mask_kwargs(seed, t, s, **kw)


def _check_against_reference(case):
  (t, s, heads, kv_heads, dtype, seed), kw = case
  args = numerics.random_inputs(
      jax.random.key(seed + 1), batch=2, q_len=t, kv_len=s, heads=heads,
      kv_heads=kv_heads, head_dim=32, dtype=dtype)
  got = _run(args, **kw)
  numerics.check_rule(got, *args, **numerics.reference_kwargs(**kw))


@pytest.mark.parametrize("name", list(EXPLICIT))
def test_mask_kinds_match_reference(name):
  _check_against_reference(_explicit(name))


@pytest.mark.slow
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=mask_cases())
def test_mask_combinations_match_reference(case):
  _check_against_reference(case)


def _check_hidden_keys_do_not_matter(case):
  """Perturbing every key/value a query may not see leaves its output
  bitwise unchanged (masked logits contribute exact zeros)."""
  (t, s, heads, kv_heads, _, seed), kw = case
  q, k, v, _, _ = numerics.random_inputs(
      jax.random.key(seed), batch=2, q_len=t, kv_len=s, heads=heads,
      kv_heads=kv_heads, head_dim=32, dtype=jnp.float32)
  ref_kw = numerics.reference_kwargs(**kw)
  allowed = np.asarray(reference.mask(
      t, s, causal=kw["causal"], window=ref_kw.get("window", (None, None)),
      segment_ids=ref_kw.get("segment_ids"),
      q_seq_lengths=kw.get("q_seq_lengths"),
      kv_seq_lengths=kw.get("kv_seq_lengths")))
  if allowed.ndim == 2:
    allowed = np.broadcast_to(allowed, (2, t, s))
  row = t // 2
  hidden = ~allowed[:, row, :]  # [B, S] keys query `row` may not see
  noise = 50.0 * jax.random.normal(jax.random.key(seed + 7), k.shape)
  k2 = jnp.where(hidden[:, :, None, None], k + noise, k)
  v2 = jnp.where(hidden[:, :, None, None], v - noise, v)
  attend = jax.jit(functools.partial(
      jaxflash.flash_attention, implementation="triton", interpret=True,
      config=TILES, **kw))
  a = np.asarray(attend(q, k, v))[:, row]
  b = np.asarray(attend(q, k2, v2))[:, row]
  np.testing.assert_array_equal(a, b)


def test_keys_outside_the_mask_do_not_matter():
  _check_hidden_keys_do_not_matter(_explicit("pairs-window-lengths-mqa-f32"))


@pytest.mark.slow
@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=mask_cases())
def test_keys_outside_the_mask_do_not_matter_drawn(case):
  _check_hidden_keys_do_not_matter(case)


@pytest.mark.parametrize("what", ["padding", "empty_window", "zero_length",
                                  "causal_q_longer"])
def test_rows_that_see_nothing(what):
  """Output 0, LSE -inf, zero gradients, nothing NaN — forward and
  backward."""
  t = s = 40
  kw = {}
  empty_rows = slice(None)
  if what == "padding":
    seg = jnp.zeros((2, t), jnp.int32).at[:, 30:].set(-1)
    kw["segment_ids"] = seg
    empty_rows = slice(30, None)
  elif what == "empty_window":
    # Window strictly to the right of the aligned key, then causal: empty.
    kw = dict(local_window_size=(0, 5), causal=True)
    # causal keeps j <= i, the window keeps j >= i: only the diagonal.
    empty_rows = None
  elif what == "zero_length":
    kw = dict(kv_seq_lengths=jnp.array([0, 40]))
    empty_rows = (0, slice(None))
  else:
    t = 60
    kw = dict(causal=True)
    empty_rows = slice(0, 20)
  args = numerics.random_inputs(jax.random.key(0), batch=2, q_len=t,
                                kv_len=s, heads=2, kv_heads=1, head_dim=32,
                                dtype=jnp.float32)
  out, lse, dq, dk, dv = _run(args, **kw)
  for x in (out, lse, dq, dk, dv):
    assert not np.isnan(np.asarray(x)).any()
  numerics.check_rule((out, lse, dq, dk, dv), *args,
                      **numerics.reference_kwargs(**kw))
  if empty_rows is None:
    return
  if isinstance(empty_rows, tuple):
    b, rows = empty_rows
    o, l_, g = out[b][rows], lse[b][:, rows], dq[b][rows]
  else:
    o, l_, g = out[:, empty_rows], lse[:, :, empty_rows], dq[:, empty_rows]
  assert np.all(np.asarray(o) == 0)
  assert np.all(np.isneginf(np.asarray(l_)))
  assert np.all(np.asarray(g) == 0)


def test_packed_documents_visit_fewer_tiles():
  """A row of many short documents visits ~1/16 of the key tiles."""
  t = 1024
  cfg = jaxflash.TritonConfig(block_q=64, block_k=64)
  q = jax.random.normal(jax.random.key(0), (1, t, 1, 32))
  docs = jnp.repeat(jnp.arange(t // 64, dtype=jnp.int32), 64)[None]
  unaligned = (jnp.arange(t, dtype=jnp.int32) // 100)[None]

  def visited(**kw):
    spec = masks.MaskSpec(t, t, kw.pop("causal", False))
    counts = triton_backend.count_visited_tiles(
        q, q, q, mask=spec, arrays=masks.MaskArrays(**kw), config=cfg,
        interpret=True)
    return int(np.asarray(counts)[0, 0, ::64].sum())  # one row per tile

  def live_pairs(ids, causal=False):
    """Brute force: (query tile, key tile) pairs holding a visible pair."""
    ids = np.asarray(ids)[0]
    n = 0
    for i in range(16):
      for j in range(16 if not causal else i + 1):
        a, b = ids[i * 64:(i + 1) * 64], ids[j * 64:(j + 1) * 64]
        n += bool(np.intersect1d(a, b).size)
    return n

  assert visited() == 16 * 16
  assert visited(causal=True) == sum(range(1, 17))
  assert visited(q_segment_ids=docs, kv_segment_ids=docs) == 16
  # Documents of 100 tokens straddle tiles: only the tiles they touch.
  assert visited(q_segment_ids=unaligned,
                 kv_segment_ids=unaligned) == live_pairs(unaligned) == 56
  assert visited(causal=True, q_segment_ids=unaligned,
                 kv_segment_ids=unaligned) == live_pairs(unaligned, True)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [
    dict(causal=True, segments=True),
    dict(local_window_size=(256, 0)),
    dict(segments=True, local_window_size=(128, 128), logits_soft_cap=30.0),
    dict(causal=True, lengths=True),
], ids=["causal+segments", "sliding", "segments+window+softcap",
        "causal+lengths"])
def test_masks_gpu(kw):
  kw = dict(kw)
  t = 1000
  args = numerics.random_inputs(jax.random.key(1), batch=2, q_len=t,
                                kv_len=t, heads=8, kv_heads=2, head_dim=128,
                                dtype=jnp.bfloat16)
  if kw.pop("segments", False):
    kw["segment_ids"] = packed_segments(jax.random.key(2), 2, t, 7,
                                        pad_tail=13)
  if kw.pop("lengths", False):
    kw["q_seq_lengths"] = jnp.array([1000, 517])
    kw["kv_seq_lengths"] = jnp.array([733, 1000])
  got = _run(args, interpret=False, config=None, **kw)
  numerics.check_rule(got, *args, **numerics.reference_kwargs(**kw))
