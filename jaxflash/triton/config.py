"""Tile configuration of the Triton-lowering kernels."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def _is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tile sizes, warps and pipeline stages; frozen so it can be static.

  Every field may be ``None``, meaning "choose from the shape" (see
  :func:`default_config`).  Forward and backward tiles are separate: the
  forward holds a query tile and streams keys; the dK/dV kernel holds a key
  tile and streams queries (``block_q_dkv`` x ``block_k_dkv``); the dQ kernel
  holds a query tile and streams keys (``block_q_dq`` x ``block_k_dq``).

  Tile sizes are powers of two >= 16 (Triton's ``tl.dot`` minimum).
  """

  block_q: int | None = None
  block_k: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None
  num_warps_bwd: int | None = None
  num_stages_bwd: int | None = None

  def __post_init__(self):
    for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv",
              "block_q_dq", "block_k_dq"):
      val = getattr(self, f)
      if val is not None and (not isinstance(val, int) or not _is_pow2(val)
                              or val < 16):
        raise ValueError(f"{f}={val!r} must be a power of two >= 16")
    for f in ("num_warps", "num_warps_bwd"):
      val = getattr(self, f)
      if val is not None and (not isinstance(val, int) or
                              val not in (1, 2, 4, 8, 16)):
        raise ValueError(f"{f}={val!r} must be one of 1, 2, 4, 8, 16")
    for f in ("num_stages", "num_stages_bwd"):
      val = getattr(self, f)
      if val is not None and (not isinstance(val, int) or val < 1):
        raise ValueError(f"{f}={val!r} must be a positive integer")

  def merged_with(self, other: "TritonConfig") -> "TritonConfig":
    """Fields of ``self`` that are None are taken from ``other``."""
    return dataclasses.replace(
        self, **{f.name: getattr(other, f.name)
                 for f in dataclasses.fields(self)
                 if getattr(self, f.name) is None})


def _fit(block: int, seq_len: int) -> int:
  """Shrinks a tile to the padded sequence when the sequence is short."""
  return max(16, min(block, 1 << max(0, seq_len - 1).bit_length()))


def default_config(q_len: int, kv_len: int, head_dim_padded: int,
                   dtype, bias_itemsize: int = 0) -> TritonConfig:
  """Tiles chosen from the shape and dtype (sm80/sm90 shared memory).

  A forward tile keeps Q [block_q, D] and double-buffered K, V
  [block_k, D] in shared memory; float32 inputs take twice the bytes, so
  their tiles are halved.  Large head dims use smaller key tiles for the
  same reason.  ``bias_itemsize``: a dense bias's bytes per element (0
  for none), whose [block_q, block_k] tile rides with each K/V tile.
  """
  wide = jnp.dtype(dtype).itemsize >= 4
  # Measured on one H200, bf16, 16k tokens per call (docs/benchmarks/
  # h200-2026-11-30-a2f93e3-triton-tiles.md): the best of six forward and six
  # backward candidates at head_dim 64, 128 and 256.
  if head_dim_padded <= 64:
    bq, bk, warps, stages = 128, 64, 8, 3
  elif head_dim_padded <= 128:
    bq, bk, warps, stages = 128, 128, 8, 3
  else:
    bq, bk, warps, stages = 64, 64, 4, 3
  # Backward: dK/dV holds a key tile and accumulates two [block_k, D]
  # outputs; dQ holds a query tile.  64 x 64 with 4 warps won at every
  # head_dim (larger key tiles ran out of registers and slowed 2x).
  bq_dkv, bk_dkv, bq_dq, bk_dq, warps_b, stages_b = 64, 64, 64, 64, 4, 2
  if wide:
    # float32 operands take twice the shared memory per tile.
    bq, bk = max(16, bq // 2), max(16, bk // 2)
    bq_dkv, bk_dkv, bq_dq, bk_dq = 32, 32, 32, 32
    stages, stages_b = 2, 1
  if bias_itemsize:
    # The bias tile rides in every pipeline stage: three stages of Q-sized
    # K, V and bias tiles overflowed an H100's 227 KiB (294,912 bytes
    # asked at head_dim 128, bf16 bias); two stages fit, and a float32
    # bias halves the key tile as well.
    stages = min(stages, 2)
    if bias_itemsize >= 4:
      bk = max(16, bk // 2)
  return TritonConfig(
      block_q=_fit(bq, q_len), block_k=_fit(bk, kv_len),
      num_warps=warps, num_stages=stages,
      block_q_dkv=_fit(bq_dkv, q_len), block_k_dkv=_fit(bk_dkv, kv_len),
      block_q_dq=_fit(bq_dq, q_len), block_k_dq=_fit(bk_dq, kv_len),
      num_warps_bwd=warps_b, num_stages_bwd=stages_b)
