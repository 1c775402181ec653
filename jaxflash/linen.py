"""Flax integration: an ``attention_fn`` and a linen attention module.

* :func:`make_attention_fn` returns a function to pass as ``attention_fn=``
  to ``flax.linen.MultiHeadDotProductAttention`` or
  ``flax.nnx.MultiHeadAttention``.
* :class:`FlashMultiHeadDotProductAttention` is a drop-in for
  ``flax.linen.MultiHeadDotProductAttention`` with the same parameter
  names and shapes (checkpoints load both ways), plus causal / segment /
  window / soft-cap options, GQA (``num_kv_heads``) and logical axis names
  for sharding.

See docs/flax.md.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxflash import api, checks
from jaxflash.masks import PAD_SEGMENT_ID

# Logical axis names (flax / t5x conventions) used by the module.
BATCH, LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM = (
    "batch", "length", "embed", "heads", "kv_heads", "kv")


def _flatten_batch(x):
  """[batch..., length, heads, head_dim] -> [B, length, heads, head_dim]."""
  return x.reshape((-1,) + x.shape[-3:])


def _flatten_dense(x, batch_shape):
  """A Flax mask or bias ``[*batch, heads|1, q, kv]`` (batch dims possibly
  1) as ``[batch|1, heads|1, q, kv]``: broadcast batch dims stay 1."""
  x = jnp.asarray(x)
  lead = x.shape[:-3]
  if all(n == 1 for n in lead):
    return x.reshape((1, *x.shape[-3:]))
  x = jnp.broadcast_to(x, (*batch_shape, *x.shape[-3:]))
  return x.reshape((-1, *x.shape[-3:]))


def _key_mask_to_segments(mask, batch_shape, q_len, kv_len):
  """A dense mask that depends only on (batch, key) is a pair of segment
  ids: every query in segment 0, masked keys in PAD_SEGMENT_ID.  Returns
  None for any other mask (one that varies over queries or heads)."""
  mask = jnp.asarray(mask)
  if mask.ndim < 3 or mask.shape[-2] != 1 or mask.shape[-3] != 1:
    return None
  keys = jnp.broadcast_to(mask[..., 0, 0, :], (*batch_shape, kv_len))
  keys = keys.reshape(-1, kv_len)
  kv_seg = jnp.where(keys, 0, PAD_SEGMENT_ID).astype(jnp.int32)
  q_seg = jnp.zeros((kv_seg.shape[0], q_len), jnp.int32)
  return q_seg, kv_seg


def apply_rope(x, positions, theta: float = 10000.0):
  """Rotary position embedding (RoFormer, arXiv 2104.09864) on
  ``x [batch..., length, heads, head_dim]`` at integer ``positions
  [batch..., length]``, rotating pairs ``(i, i + head_dim/2)``."""
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"rotary embedding needs an even head_dim, got {d}")
  freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  angle = positions[..., :, None, None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def make_attention_fn(
    *,
    causal: bool = False,
    segment_ids: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    q_seq_lengths: jax.Array | None = None,
    kv_seq_lengths: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
    interpret: bool = False,
    deterministic_grads: bool | None = None,
) -> Callable[..., jax.Array]:
  """An ``attention_fn`` for Flax attention modules, served by jaxflash.

  The mask options are those of :func:`jaxflash.flash_attention` (causal
  aligned bottom-right, which equals Flax's ``make_causal_mask`` for
  self-attention).  The returned function accepts every keyword Flax
  passes: a ``mask`` that depends on (batch, key) alone (a key-padding or
  decode-cache mask) becomes segment ids; any other dense mask, and a
  ``bias``, go to the kernels as :func:`jaxflash.flash_attention`'s
  ``mask`` and ``bias`` (read tile by tile; prefer ``causal`` or
  ``segment_ids`` where they say the same: no N x N array at all);
  ``sow_weights`` (which needs the N x N weights) raises
  NotImplementedError.  Attention dropout (``dropout_rate`` with
  ``deterministic=False`` and Flax's ``dropout_rng``) runs in the kernels,
  with ``broadcast_dropout`` sharing one mask over batch and heads as in
  Flax (:func:`jaxflash.flash_attention`'s ``dropout_*``).

  ``deterministic_grads`` is :func:`jaxflash.flash_attention`'s
  ``deterministic`` (bitwise-reproducible gradients), renamed because
  Flax's ``deterministic`` means "no dropout".
  """

  def attention_fn(query, key, value, bias=None, mask=None,
                   broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
                   deterministic=False, dtype=None, precision=None,
                   module=None, is_causal=None, **unused):
    del precision
    for name, val in unused.items():
      if val is not None:
        raise NotImplementedError(
            f"jaxflash attention_fn does not support {name}={val!r}")
    if deterministic or not dropout_rate:
      dropout_rate, dropout_rng = 0.0, None
    elif dropout_rng is None:
      raise ValueError(f"attention dropout (dropout_rate={dropout_rate}) in"
                       " training needs a dropout_rng")
    if module is not None:
      raise NotImplementedError(
          "sow_weights=True needs the N x N attention weights, which jaxflash"
          " never forms")
    batch_shape, q_len = query.shape[:-3], query.shape[-3]
    kv_len = key.shape[-3]
    seg = segment_ids
    left = checks.window_sizes(local_window_size)[0]
    if mask is not None and q_len == 1 < kv_len and (
        left is not None and left < kv_len - 1):
      # Flax's decode step: one query against the whole cache, the filled
      # slots given by the mask.  The mask does not say where the query
      # stands; flash_attention would align it with the last slot and
      # place the window there.  Only its left side matters (the right
      # one reaches past the last slot either way), and only when it
      # stops short of slot 0.  (A one-query cross-attention with a key
      # mask and such a window has this shape too, and is refused with
      # it: the two cannot be told apart here.)
      raise NotImplementedError(
          "a one-token query against a longer masked key array (Flax's"
          " decode step) with local_window_size: the query's position is"
          " unknown here, so the window cannot be placed. Use"
          " FlashMultiHeadDotProductAttention(decode=True), which places it"
          " at the cache index")
    dense_mask = None
    seg_from_mask = None
    if mask is not None:
      seg_from_mask = _key_mask_to_segments(mask, batch_shape, q_len, kv_len)
      if seg_from_mask is None:  # varies over queries or heads
        # Flax's masks are often float (1 keeps, 0 hides), as its
        # dot_product_attention takes them.
        dense_mask = _flatten_dense(mask, batch_shape).astype(bool)
        mask = None
    if seg_from_mask is not None:
      if seg is not None:
        raise NotImplementedError(
            "a key-padding mask and segment_ids together: fold the padding"
            " into the segment ids (PAD_SEGMENT_ID)")
      seg = seg_from_mask
    elif isinstance(seg, (tuple, list)):  # (q ids, kv ids), each flattened
      seg = tuple(x if x is None or jnp.ndim(x) < 2
                  else jnp.reshape(x, (-1, jnp.shape(x)[-1])) for x in seg)
    elif seg is not None:
      seg = jnp.reshape(seg, (-1, jnp.shape(seg)[-1]))
    if dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    # Lengths, like segment ids, follow the batch dims flattened into one.
    q_lens, kv_lens = (None if x is None else jnp.reshape(x, (-1,))
                       for x in (q_seq_lengths, kv_seq_lengths))
    out = api.flash_attention(
        _flatten_batch(query), _flatten_batch(key), _flatten_batch(value),
        causal=bool(causal or is_causal), segment_ids=seg,
        local_window_size=local_window_size, q_seq_lengths=q_lens,
        kv_seq_lengths=kv_lens, logits_soft_cap=logits_soft_cap,
        implementation=implementation, config=config, interpret=interpret,
        deterministic=deterministic_grads, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, dropout_broadcast=bool(broadcast_dropout),
        bias=None if bias is None else _flatten_dense(bias, batch_shape),
        mask=dense_mask)
    return out.reshape(query.shape)

  return attention_fn


class FlashMultiHeadDotProductAttention(nn.Module):
  """``nn.MultiHeadDotProductAttention`` with jaxflash attention.

  Parameters are the same (``query``, ``key``, ``value``, ``out``
  DenseGeneral kernels ``[features, heads, head_dim]`` /
  ``[heads, head_dim, features]`` and biases), so a checkpoint of either
  module loads into the other (with ``num_kv_heads`` unset).  Kernels carry
  logical axis names (``embed``, ``heads`` or ``kv_heads``, ``kv``) and the
  activations are constrained to (``batch``, ``length``, ``heads``, ``kv``):
  under ``nn.logical_axis_rules`` and a mesh, the layer shards without
  extra code.

  Extra attributes: ``causal``, ``num_kv_heads`` (GQA/MQA: key/value
  projections to fewer heads), ``local_window_size``, ``logits_soft_cap``,
  ``rope_theta`` (rotary embeddings on queries and keys),
  ``implementation``, ``config``, ``interpret``, ``deterministic_grads``
  (``flash_attention``'s ``deterministic``).  Extra call arguments:
  ``segment_ids`` (packed documents), ``q_seq_lengths`` /
  ``kv_seq_lengths``, ``positions`` (for the rotary embeddings; default
  ``0..length-1``; one set for queries and keys, so ``rope_theta`` takes
  keys as long as the queries and refuses others).  Flax's deprecated
  ``inputs_kv`` (keys and values from one input) is taken, with Flax's
  ``DeprecationWarning``.

  ``decode=True``: Flax's autoregressive cache (``cached_key``,
  ``cached_value``, ``cache_index``); each single-token step attends to the
  filled part of the cache through :func:`jaxflash.flash_attention` with
  ``kv_seq_lengths``, which takes the split-K decode kernel of
  :func:`jaxflash.paged_attention` where the cache length is a multiple of
  16 and the head_dim a power of two; with ``local_window_size`` it
  attends to the slots ``[index - left, index]`` (as segment ids over the
  cache, through the prefill kernels).
  """

  num_heads: int
  dtype: Any = None
  param_dtype: Any = jnp.float32
  qkv_features: int | None = None
  out_features: int | None = None
  broadcast_dropout: bool = True
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  precision: Any = None
  kernel_init: Callable = nn.linear.default_kernel_init
  out_kernel_init: Callable | None = None
  bias_init: Callable = nn.initializers.zeros_init()
  out_bias_init: Callable | None = None
  use_bias: bool = True
  decode: bool = False
  normalize_qk: bool = False
  # jaxflash options
  causal: bool = False
  num_kv_heads: int | None = None
  local_window_size: int | tuple[int, int] | None = None
  logits_soft_cap: float | None = None
  rope_theta: float | None = None
  # Replaces the jaxflash call, e.g. to compare with another attention in
  # the same model: f(query, key, value, *, causal, segment_ids,
  # local_window_size, q_seq_lengths, kv_seq_lengths) -> output.
  attention_override: Callable | None = None
  implementation: str | Sequence[str] | None = None
  config: Any = None
  interpret: bool = False
  # flash_attention's ``deterministic`` (bitwise-reproducible gradients);
  # ``deterministic`` above is Flax's dropout switch.
  deterministic_grads: bool | None = None

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *,
               segment_ids=None, q_seq_lengths=None, kv_seq_lengths=None,
               positions=None, mask=None, deterministic=None,
               dropout_rng=None, sow_weights=False, inputs_kv=None):
    if mask is not None and (self.decode
                             or self.attention_override is not None):
      raise NotImplementedError(
          "FlashMultiHeadDotProductAttention takes no dense mask with"
          " decode=True or an attention_override: use causal=True,"
          " segment_ids, local_window_size or the sequence lengths")
    if sow_weights:
      raise NotImplementedError(
          "sow_weights needs the N x N attention weights, which jaxflash"
          " never forms")
    dropout = {}
    if self.dropout_rate > 0.0 and not nn.merge_param(
        "deterministic", self.deterministic, deterministic):
      if self.attention_override is not None:
        raise NotImplementedError(
            "attention dropout with an attention_override (the override"
            " computes the attention)")
      dropout = dict(dropout_rate=self.dropout_rate, deterministic=False,
                     broadcast_dropout=self.broadcast_dropout,
                     dropout_rng=(self.make_rng("dropout")
                                  if dropout_rng is None else dropout_rng))
    if inputs_kv is not None:
      # As nn.MultiHeadDotProductAttention (flax 0.12).
      if inputs_k is not None or inputs_v is not None:
        raise ValueError(
            "If either `inputs_k` or `inputs_v` is not None, `inputs_kv`"
            " must be None")
      warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k"
                    " and inputs_v instead.", DeprecationWarning,
                    stacklevel=2)
      inputs_k = inputs_v = inputs_kv
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None when inputs_v is given")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k

    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(
          f"qkv_features={qkv_features} must be divisible by"
          f" num_heads={self.num_heads}")
    head_dim = qkv_features // self.num_heads
    kv_heads = self.num_kv_heads or self.num_heads
    if self.num_heads % kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of"
          f" num_kv_heads={kv_heads}")
    kv_axis = HEADS if kv_heads == self.num_heads else KV_HEADS

    def dense(name, heads, heads_axis):
      return nn.DenseGeneral(
          features=(heads, head_dim), axis=-1, dtype=self.dtype,
          param_dtype=self.param_dtype, precision=self.precision,
          use_bias=self.use_bias,
          kernel_init=nn.with_logical_partitioning(
              self.kernel_init, (EMBED, heads_axis, HEAD_DIM)),
          bias_init=nn.with_logical_partitioning(
              self.bias_init, (heads_axis, HEAD_DIM)),
          name=name)

    query = dense("query", self.num_heads, HEADS)(inputs_q)
    key = dense("key", kv_heads, kv_axis)(inputs_k)
    value = dense("value", kv_heads, kv_axis)(inputs_v)
    if self.normalize_qk:
      query = nn.LayerNorm(name="query_ln", use_bias=False, dtype=self.dtype,
                           param_dtype=self.param_dtype)(query)
      key = nn.LayerNorm(name="key_ln", use_bias=False, dtype=self.dtype,
                         param_dtype=self.param_dtype)(key)
    if self.rope_theta is not None:
      query, key = self._rope(query, key, positions)
    act = (BATCH, LENGTH, HEADS, HEAD_DIM)
    query = nn.with_logical_constraint(query, act)
    key = nn.with_logical_constraint(key, (BATCH, LENGTH, kv_axis, HEAD_DIM))
    value = nn.with_logical_constraint(value,
                                       (BATCH, LENGTH, kv_axis, HEAD_DIM))

    causal, window = self.causal, self.local_window_size
    if self.decode:
      key, value, kv_seq_lengths, causal, window_segments = (
          self._decode_cache(query, key, value, kv_seq_lengths, causal,
                             segment_ids))
      if window_segments is not None:
        segment_ids, window = window_segments, None

    if self.attention_override is not None:
      x = self.attention_override(
          query, key, value, causal=causal, segment_ids=segment_ids,
          local_window_size=window,
          q_seq_lengths=q_seq_lengths, kv_seq_lengths=kv_seq_lengths)
    else:
      attend = make_attention_fn(
          causal=causal, segment_ids=segment_ids,
          local_window_size=window,
          q_seq_lengths=q_seq_lengths, kv_seq_lengths=kv_seq_lengths,
          logits_soft_cap=self.logits_soft_cap,
          implementation=self.implementation, config=self.config,
          interpret=self.interpret,
          deterministic_grads=self.deterministic_grads)
      x = attend(query, key, value, mask=mask, dtype=self.dtype, **dropout)
    x = nn.with_logical_constraint(x, act)
    out = nn.DenseGeneral(
        features=features, axis=(-2, -1), dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        use_bias=self.use_bias,
        kernel_init=nn.with_logical_partitioning(
            self.out_kernel_init or self.kernel_init,
            (HEADS, HEAD_DIM, EMBED)),
        bias_init=nn.with_logical_partitioning(
            self.out_bias_init or self.bias_init, (EMBED,)),
        name="out")(x)
    return nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED))

  def _rope(self, query, key, positions):
    """Rotary embeddings at ``positions`` (default: 0.., or the decode
    cache index) on queries and keys of self-attention."""
    if query.shape[-3] != key.shape[-3]:
      raise ValueError(
          f"rope_theta={self.rope_theta} rotates queries and keys at the"
          f" same positions (self-attention), got {query.shape[-3]} queries"
          f" and {key.shape[-3]} keys: apply rotary embeddings outside the"
          " module for cross-attention")
    if positions is None:
      start = 0
      if self.decode and self.has_variable("cache", "cache_index"):
        start = self.get_variable("cache", "cache_index")
      positions = start + jnp.arange(query.shape[-3], dtype=jnp.int32)
      positions = jnp.broadcast_to(positions, query.shape[:-2])
    return (apply_rope(query, positions, self.rope_theta),
            apply_rope(key, positions, self.rope_theta))

  def _decode_cache(self, query, key, value, kv_seq_lengths, causal,
                    segment_ids):
    """Flax's autoregressive cache; returns the cached keys/values, the
    per-row number of filled slots as kv_seq_lengths, causal, and with a
    local window the segment ids that stand for it (else None)."""
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape,
                               key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                 value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index",
                                lambda: jnp.array(0, dtype=jnp.int32))
    if not initialized:
      return key, value, kv_seq_lengths, causal, None
    *batch, max_length, heads, depth = cached_key.value.shape
    if query.shape[-3] != 1 or key.shape != (*batch, 1, heads, depth):
      raise ValueError(
          "decode=True expects one new token per step: query"
          f" {query.shape}, key {key.shape}, cache {cached_key.value.shape}")
    if kv_seq_lengths is not None:
      raise ValueError("decode=True sets kv_seq_lengths from the cache")
    idx = cache_index.value
    zero = jnp.zeros((), idx.dtype)
    start = (zero,) * len(batch) + (idx, zero, zero)
    key = jax.lax.dynamic_update_slice(cached_key.value, key, start)
    value = jax.lax.dynamic_update_slice(cached_value.value, value, start)
    cached_key.value, cached_value.value = key, value
    cache_index.value = idx + 1
    # The new token sees the filled slots [0, idx]; causal is implied.
    n = int(functools.reduce(lambda a, b: a * b, batch, 1))
    if self.local_window_size is None:
      return key, value, jnp.full((n,), idx + 1, jnp.int32), False, None
    # With a window it sees [idx - left, idx] (its right side reaches only
    # empty slots).  flash_attention would align the one query with the
    # cache's last slot, not with idx, so the window is passed as segment
    # ids: the query in segment 0, the keys outside it padding.
    if segment_ids is not None:
      raise NotImplementedError(
          "decode=True with local_window_size takes no segment_ids (the"
          " window is applied as segment ids over the cache)")
    left = checks.window_sizes(self.local_window_size)[0]
    pos = jnp.arange(max_length, dtype=jnp.int32)
    seen = pos <= idx
    if left < max_length:  # else it reaches slot 0 (and would wrap int32)
      seen &= pos >= idx - left
    kv_seg = jnp.where(seen, 0, PAD_SEGMENT_ID).astype(jnp.int32)
    return key, value, None, False, (
        jnp.zeros((n, 1), jnp.int32), jnp.broadcast_to(kv_seg,
                                                       (n, max_length)))
