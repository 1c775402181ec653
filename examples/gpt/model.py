"""A GPT in flax.linen with jaxflash attention.

Pre-norm blocks (RMSNorm), rotary position embeddings, GELU MLP, tied
embeddings; causal attention restricted to each packed document by segment
ids, optional GQA and sliding window. Every parameter and activation
carries logical axis names (``batch``, ``length``, ``embed``, ``heads``,
``kv_heads``, ``kv``, ``mlp``, ``vocab``) that the trainer maps to mesh
axes.  Given a mesh with a ``context`` axis of size > 1, attention is
jaxflash's ring attention over it (context parallelism; the tokens must
then be in :func:`jaxflash.ring.zigzag_indices` order, with their original
``positions`` for the rotary embeddings).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxflash import sharding
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


def context_size(mesh) -> int:
  """Size of ``mesh``'s ``context`` axis (1 without a mesh or the axis)."""
  return 1 if mesh is None else dict(mesh.shape).get("context", 1)


def ring_attention(mesh, interpret: bool):
  """Attention with the sequence split over ``mesh``'s ``context`` axis:
  jaxflash's ring attention inside ``shard_map``, batch split over
  (data, fsdp) and heads over tensor as the logical rules put them.
  Causal is zig-zag balanced, so the tokens must be in
  ``zigzag_indices`` order."""
  batch = tuple(a for a in ("data", "fsdp") if a in mesh.shape)
  heads = "tensor" if "tensor" in mesh.shape else None
  qkv, ids = P(batch, "context", heads, None), P(batch, "context")

  def attend(query, key, value, *, causal, segment_ids, local_window_size,
             q_seq_lengths, kv_seq_lengths):
    if local_window_size is not None or q_seq_lengths is not None or \
        kv_seq_lengths is not None:
      raise NotImplementedError(
          "ring attention (context parallelism) takes causal and segment"
          " ids; got a window or sequence lengths")
    ring = functools.partial(sharding.ring_attention, axis_name="context",
                             causal=causal, zigzag=True, interpret=interpret)
    return jax.shard_map(
        lambda q, k, v, s: ring(q, k, v, segment_ids=s), mesh=mesh,
        in_specs=(qkv, qkv, qkv, ids), out_specs=qkv, check_vma=False)(
            query, key, value, segment_ids)
  return attend


def _dense(features, axes, name, dtype):
  return nn.Dense(features, use_bias=False, dtype=dtype, name=name,
                  kernel_init=nn.with_logical_partitioning(
                      nn.initializers.normal(0.02), axes))


class Block(nn.Module):
  cfg: GPTConfig
  mesh: Any = None  # a context axis > 1 selects ring attention

  @nn.compact
  def __call__(self, x, segment_ids, positions=None):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    h = nn.RMSNorm(dtype=dtype, name="ln1")(x)
    window = None if cfg.window is None else (cfg.window, 0)
    override, impl = None, None
    if context_size(self.mesh) > 1:
      if cfg.attention != "jaxflash":
        raise ValueError(
            f"attention={cfg.attention!r}: context parallelism runs"
            " jaxflash's ring attention (attention='jaxflash')")
      # Ring attention runs the flash kernels (no reference fallback); on
      # a CPU they run in interpret mode.
      override = ring_attention(
          self.mesh, cfg.interpret or jax.default_backend() == "cpu")
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
        attention_override=override, name="attn")(
            h, segment_ids=segment_ids, positions=positions)
    x = x + h
    h = nn.RMSNorm(dtype=dtype, name="ln2")(x)
    h = _dense(cfg.ff, ("embed", "mlp"), "up", dtype)(h)
    h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
    h = _dense(cfg.d_model, ("mlp", "embed"), "down", dtype)(h)
    return nn.with_logical_constraint(x + h, ("batch", "length", "embed"))


class GPT(nn.Module):
  cfg: GPTConfig
  mesh: Any = None  # a context axis > 1 selects ring attention

  @nn.compact
  def __call__(self, tokens, segment_ids, positions=None):
    """Logits ``[batch, length, vocab]``; ``positions`` (default
    ``0..length-1``) are the tokens' places for the rotary embeddings."""
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed",
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(0.02), ("vocab", "embed")))
    x = embed(tokens).astype(jnp.dtype(cfg.dtype))
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    block = nn.remat(Block) if cfg.remat else Block
    for i in range(cfg.layers):
      x = block(cfg, self.mesh, name=f"block{i}")(x, segment_ids, positions)
    x = nn.RMSNorm(dtype=jnp.dtype(cfg.dtype), name="ln_f")(x)
    logits = embed.attend(x.astype(jnp.float32))
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
