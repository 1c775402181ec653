"""A GPT in flax.linen with jaxflash attention.

Pre-norm blocks (RMSNorm), rotary position embeddings, GELU MLP, tied
embeddings; causal attention restricted to each packed document by segment
ids, optional GQA and sliding window. Every parameter and activation
carries logical axis names (``batch``, ``length``, ``embed``, ``heads``,
``kv_heads``, ``kv``, ``mlp``, ``vocab``) that the trainer maps to mesh
axes.  Where the trainer maps ``length`` to a ``context`` mesh axis, the
activations are sharded along the sequence and ``flash_attention`` runs
context parallelism by itself (ring or all-gather, causal balance inside;
docs/sharding.md): the model has no code for it.

Given a ``cache`` (one per layer: a :class:`jaxflash.paged.PagedKVCache`,
or a :class:`ContiguousKVCache` for comparison), the model runs
incrementally on new tokens: each attention layer writes their keys and
values after each row's cached ones and attends to the cache
(:class:`CachedAttention`), for prefill and decoding (``generate.py``).
The same parameters serve both forms; without a cache the forward is the
training one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxflash import checks, paged
from jaxflash.linen import FlashMultiHeadDotProductAttention


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab: int = 256
  layers: int = 2
  d_model: int = 128
  heads: int = 4
  kv_heads: int | None = None
  d_ff: int | None = None
  seq_len: int = 256
  window: int | None = None
  rope_theta: float = 10000.0
  dtype: str = "float32"   # compute dtype; parameters stay float32
  # "jaxflash" (best backend), a jaxflash backend ("triton", "mosaic_gpu",
  # "xla"), or jax.nn's "cudnn" / "jax-xla" for comparison.
  attention: str = "jaxflash"
  interpret: bool = False
  # Recompute each block's activations in the backward pass (jax.checkpoint
  # via nn.remat): activation memory of one block instead of all of them,
  # for ~1/3 more compute.  The 1B preset at seq 8192 needs it on one GPU.
  remat: bool = False
  # Attention dropout in training (in the kernels): active when the model
  # is applied with a "dropout" rng (train.py's steps), off otherwise.
  attn_dropout: float = 0.0

  @property
  def ff(self) -> int:
    return self.d_ff or 4 * self.d_model

  def flops_per_token(self) -> float:
    """Training FLOPs per token: 6 N plus attention (PaLM appendix B)."""
    n = self.layers * (4 * self.d_model * self.d_model * (
        1 + (self.kv_heads or self.heads) / self.heads) / 2
        + 2 * self.d_model * self.ff) + self.vocab * self.d_model
    attn = 6 * self.layers * self.seq_len * self.d_model  # causal: halved
    return 6 * n + attn


PRESETS = {
    "tiny": GPTConfig(layers=2, d_model=128, heads=4, seq_len=256),
    "gpt2-124m": GPTConfig(layers=12, d_model=768, heads=12, seq_len=2048,
                           dtype="bfloat16"),
    "gpt2-124m-8k": GPTConfig(layers=12, d_model=768, heads=12,
                              seq_len=8192, dtype="bfloat16"),
    "gpt2-350m": GPTConfig(layers=24, d_model=1024, heads=16, seq_len=2048,
                           dtype="bfloat16"),
    "1b": GPTConfig(layers=24, d_model=2048, heads=16, kv_heads=4,
                    seq_len=8192, dtype="bfloat16"),
    "1b-32k": GPTConfig(layers=24, d_model=2048, heads=16, kv_heads=4,
                        seq_len=32768, dtype="bfloat16"),
    # Context parallelism over 8 GPUs: 16,384 tokens per GPU.
    "1b-128k": GPTConfig(layers=24, d_model=2048, heads=16, kv_heads=4,
                         seq_len=131072, dtype="bfloat16"),
}


def jax_nn_attention(implementation: str):
  """Attention through ``jax.nn.dot_product_attention`` (cuDNN or XLA),
  for comparing end to end: segment ids become a dense [B, 1, T, T] mask,
  as those implementations take no segment ids."""
  def attend(query, key, value, *, causal, segment_ids, local_window_size,
             q_seq_lengths, kv_seq_lengths):
    del q_seq_lengths, kv_seq_lengths
    mask = None
    if segment_ids is not None:
      mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    window = local_window_size
    return jax.nn.dot_product_attention(
        query, key, value, mask=mask, is_causal=causal,
        local_window_size=window, implementation=implementation)
  return attend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousKVCache:
  """One layer's keys and values in contiguous ``[batch, max_len,
  kv_heads, head_dim]`` arrays, attended with
  ``jax.nn.dot_product_attention``: the comparison of the paged cache,
  with the same ``append`` / ``attention`` methods and ``kv_lengths``
  (valid keys per row)."""

  k: jax.Array
  v: jax.Array
  kv_lengths: jax.Array
  # jax.nn's implementation of the decode steps: "xla", or "cudnn" (one
  # query per row without a window; other calls take the XLA mask path).
  implementation: str = dataclasses.field(default="xla",
                                           metadata=dict(static=True))

  @classmethod
  def create(cls, *, batch: int, max_len: int, kv_heads: int,
             head_dim: int, dtype=jnp.float32,
             implementation: str = "xla") -> "ContiguousKVCache":
    """Zero keys and values, lengths 0."""
    kv = jnp.zeros((batch, max_len, kv_heads, head_dim), dtype)
    return cls(kv, jnp.zeros_like(kv), jnp.zeros((batch,), jnp.int32),
               implementation)

  def append(self, k_new, v_new) -> "ContiguousKVCache":
    """The cache with ``k_new, v_new [batch, n, kv_heads, head_dim]``
    written at positions ``kv_lengths[b] + t``; positions past
    ``max_len`` are dropped (as :func:`jaxflash.paged.append` drops
    tokens without a page under ``jit``)."""
    batch, n = k_new.shape[:2]
    pos = self.kv_lengths[:, None] + jnp.arange(n, dtype=jnp.int32)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]

    def put(cache, new):
      return cache.at[rows, pos].set(new.astype(cache.dtype), mode="drop")

    return dataclasses.replace(self, k=put(self.k, k_new),
                               v=put(self.v, v_new),
                               kv_lengths=self.kv_lengths + n)

  def attention(self, q, *, local_window_size=None):
    """``jax.nn.dot_product_attention`` of ``q [batch, q_len, heads,
    head_dim]``, the last ``q_len`` tokens of each row (already
    appended), over the cache: query ``t`` of row ``b`` sits at position
    ``kv_lengths[b] - q_len + t`` and sees the keys at or before it
    (causal aligned bottom-right per row, as
    :func:`jaxflash.paged_attention`), and with ``local_window_size``
    ``w`` or ``(w, 0)`` only those at most ``w`` back.  jax.nn's
    ``is_causal`` aligns top-left and its window likewise, so both are a
    boolean mask here; keys past a row's length are after its last query,
    so the causal mask hides them too.  A decode step (one query per row,
    no window) passes the lengths instead, which cuDNN takes."""
    q_len, max_len = q.shape[1], self.k.shape[1]
    left = checks.window_sizes(local_window_size)[0]
    if q_len == 1 and left is None:
      return jax.nn.dot_product_attention(
          q, self.k, self.v, key_value_seq_lengths=self.kv_lengths,
          implementation=self.implementation)
    pos = (self.kv_lengths[:, None] - q_len
           + jnp.arange(q_len, dtype=jnp.int32))[:, :, None]
    key = jnp.arange(max_len, dtype=jnp.int32)[None, None, :]
    mask = key <= pos
    if left is not None:
      mask = mask & (key >= pos - left)
    return jax.nn.dot_product_attention(q, self.k, self.v,
                                        mask=mask[:, None])


class CachedAttention:
  """The attention of the incremental forward, as the attention layer's
  ``attention_override``: the new tokens' keys and values (rotary
  embeddings already applied at their absolute positions) are appended to
  ``cache``, then the new queries attend to it, causal bottom-right (one
  call for a prefill chunk, ``q_len > 1``, and for a decode step,
  ``q_len`` 1).  ``cache`` is then the updated cache; ``options`` go to
  its ``attention``."""

  def __init__(self, cache, **options):
    self.cache = cache
    self.options = options

  def __call__(self, query, key, value, *, causal, segment_ids,
               local_window_size, q_seq_lengths, kv_seq_lengths):
    # Causal by construction; rows hold one document each (no segments),
    # and the cache's lengths replace the sequence lengths.
    del causal, segment_ids, q_seq_lengths, kv_seq_lengths
    self.cache = self.cache.append(key, value)
    return self.cache.attention(query, local_window_size=local_window_size,
                                **self.options)


def cache_options(cfg: GPTConfig, cache) -> dict[str, Any]:
  """Options of ``cache.attention`` for ``cfg``: a paged cache runs
  :func:`jaxflash.paged_attention` with ``cfg.attention`` as its
  implementation where that names one ("triton", "xla"; else the kernel
  where it serves the call, else XLA) and ``cfg.interpret``; a contiguous
  cache runs jax.nn's attention (its own ``implementation``)."""
  if isinstance(cache, paged.PagedKVCache):
    impl = (cfg.attention if cfg.attention in paged.IMPLEMENTATIONS
            else None)
    return dict(implementation=impl, interpret=cfg.interpret)
  if isinstance(cache, ContiguousKVCache):
    return {}
  raise ValueError(f"cache must be a PagedKVCache or ContiguousKVCache,"
                   f" got {type(cache).__name__}")


def _dense(features, axes, name, dtype):
  return nn.Dense(features, use_bias=False, dtype=dtype, name=name,
                  kernel_init=nn.with_logical_partitioning(
                      nn.initializers.normal(0.02), axes))


class Block(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x, segment_ids, positions=None, cache=None):
    """The block's output; with a layer ``cache`` (incremental forward)
    ``(output, updated cache)``."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    h = nn.RMSNorm(dtype=dtype, name="ln1")(x)
    window = None if cfg.window is None else (cfg.window, 0)
    override, impl = None, None
    if cache is not None:
      override = CachedAttention(cache, **cache_options(cfg, cache))
    elif cfg.attention in ("cudnn", "jax-xla"):
      override = jax_nn_attention("xla" if cfg.attention == "jax-xla"
                                  else "cudnn")
    elif cfg.attention != "jaxflash":
      impl = cfg.attention  # one jaxflash backend
    h = FlashMultiHeadDotProductAttention(
        num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, causal=True,
        local_window_size=window, rope_theta=cfg.rope_theta, dtype=dtype,
        use_bias=False, kernel_init=nn.initializers.normal(0.02),
        implementation=impl, interpret=cfg.interpret,
        attention_override=override, dropout_rate=cfg.attn_dropout,
        name="attn")(
            h, segment_ids=segment_ids, positions=positions,
            deterministic=not (cfg.attn_dropout and self.has_rng("dropout")))
    x = x + h
    h = nn.RMSNorm(dtype=dtype, name="ln2")(x)
    h = _dense(cfg.ff, ("embed", "mlp"), "up", dtype)(h)
    h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
    h = _dense(cfg.d_model, ("mlp", "embed"), "down", dtype)(h)
    out = nn.with_logical_constraint(x + h, ("batch", "length", "embed"))
    return out if cache is None else (out, override.cache)


class GPT(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, tokens, segment_ids, positions=None, cache=None):
    """Logits ``[batch, length, vocab]``; ``positions`` (default
    ``0..length-1``) are the tokens' places for the rotary embeddings.

    With ``cache`` (a sequence of one cache per layer, see
    :class:`CachedAttention`): ``tokens`` follow each row's cached ones,
    at positions ``kv_lengths[b] + t`` by default, ``segment_ids`` are
    ignored, and the result is ``(logits, updated caches)``."""
    cfg = self.cfg
    if cache is not None:
      if len(cache) != cfg.layers:
        raise ValueError(f"{len(cache)} layer caches for {cfg.layers}"
                         " layers")
      if positions is None:
        positions = cache[0].kv_lengths[:, None] + jnp.arange(
            tokens.shape[1], dtype=jnp.int32)
    embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed",
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(0.02), ("vocab", "embed")))
    x = embed(tokens).astype(jnp.dtype(cfg.dtype))
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    block = nn.remat(Block) if cfg.remat else Block
    new_cache = []
    for i in range(cfg.layers):
      if cache is None:
        x = block(cfg, name=f"block{i}")(x, segment_ids, positions)
      else:
        # No remat: nothing is differentiated (the parameter names are
        # the same either way).
        x, layer = Block(cfg, name=f"block{i}")(
            x, None, positions, cache[i])
        new_cache.append(layer)
    x = nn.RMSNorm(dtype=jnp.dtype(cfg.dtype), name="ln_f")(x)
    logits = embed.attend(x.astype(jnp.float32))
    logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
    return logits if cache is None else (logits, tuple(new_cache))
