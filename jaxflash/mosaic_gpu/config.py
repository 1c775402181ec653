"""Tile configuration of the Hopper (Mosaic GPU) kernels.

Defaults are data, per device kind, in ``tuning.json`` beside this file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

# Hardware named barriers free for the kernels: ids 4..15 (Mosaic GPU's own
# below them: pipeline.FIRST_NAMED_BARRIER).  The forward takes two for the
# ping-pong schedule and one per stage for each of the K and V rings.
FREE_NAMED_BARRIERS = 12
MAX_NAMED_STAGES = (FREE_NAMED_BARRIERS - 2) // 2


# Options that do not combine: (option, other, why option excludes other).
_EXCLUSIVE_OPTIONS = (
    ("bwd_paired_dkv", "bwd_atomic_dq",
     "has no dQ in its dK/dV kernel (the dQ kernel runs)"),
    ("bwd_paired_dq", "bwd_atomic_dq",
     "is a dQ kernel, which bwd_atomic_dq=True does not run"),
)


# rescale_threshold's ceiling: P runs up to 2^threshold, exact in float16
# (and bfloat16) and far from float16's 65504; FlashAttention-4 uses 8.
MAX_RESCALE_THRESHOLD = 8

@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles and pipeline of the Hopper kernels; frozen (a static argument).

  Forward fields first, then the backward's (``bwd_*``).  The tuned
  values per device kind and head_dim are in ``tuning.json``
  (:func:`default_config`).

  Attributes:
    block_q: query rows per consumer warpgroup; a multiple of 64 (one
      ``wgmma`` M-tile).
    block_kv: key rows per stage of the forward's K/V ring; a multiple of
      16 from 64.  Widths that 64 does not divide (FlashAttention-3's 80
      and 176) put V and a staged ``P`` in a narrower swizzle
      (``pipeline.tiled_over``).
    stages: depth of the forward's K/V shared-memory ring (>= 2).
    compute_wgs: consumer warpgroups per program beside the producer
      warpgroup: 1, 2 (the ping-pong pair) or 3 (no ping-pong; padded
      head_dim up to :data:`MAX_THREE_WG_HEAD_DIM`).
    consumer_registers: registers per consumer thread (``setmaxnreg``);
      None for 232 with two consumers and 160 with three.  A multiple of
      8 that leaves the producer at least 24; two or three consumers only.
    p_in_smem: stage ``P`` through shared memory for the ``P V`` wgmma
      instead of passing it in registers.  The interpreter runs only this
      form; the backward kernels take it too.
    schedule_barrier: with two consumers, alternate their matmuls
      (FlashAttention-3's ping-pong, arXiv 2407.08608 §3.1); no effect
      otherwise.
    persistent: one program per SM looping over the work items (head,
      query group, batch) with the K/V ring running on across them.
      tuning.json's ``persistent_max_kv`` turns it on per call.
    intra_wg_overlap: FlashAttention-3's intra-warpgroup overlap (arXiv
      2407.08608 §3.2): a turn issues ``S_t = Q K_t^T`` and ``O +=
      P_{t-1} V_{t-1}`` together; tile ``t``'s softmax runs under the
      ``P V``.
    named_barriers: the forward's "slot free" signals and ping-pong on
      hardware named barriers instead of mbarriers; ``stages`` at most
      :data:`MAX_NAMED_STAGES`.  GPU only.
    prefetch_q: with ``persistent``, the producer loads each item's Q and
      the output leaves through its own 64-column slots, so the next Q
      loads under this item's epilogue.  No effect without ``persistent``.
    persistent_pairs: with ``persistent`` on causal calls, a work unit is
      the ``p``-th longest and the ``p``-th shortest query group of one
      (batch, head), so the round robin's units take equal work.
    causal_lpt: with ``persistent`` on causal calls without pairs, deal
      the work items longest first in L2-sized sections of (batch, head)
      pairs (FlashAttention-3's LPT scheduler) instead of heads fastest;
      also taken where heads-first would load one program far above the
      mean (``forward.MAX_HEADS_FIRST_IMBALANCE``).
    kv_multicast: clusters of two CTAs on adjacent query groups share each
      K/V tile by TMA multicast.  Applies where every group streams the
      same key tiles (no causal mask, window or segment ids), the group
      count is even and the program has one consumer or the ping-pong;
      other calls run without clusters.
    rescale_threshold: FlashAttention-4's conditional rescaling (arXiv
      2603.05451): a row's reference max moves only when the row max
      passes it by more than ``2^rescale_threshold``; 0 (every step) to
      :data:`MAX_RESCALE_THRESHOLD`.  On the GPU a warp then skips ``O``'s
      rescale where no row moved.
    deferred_row_sum: keep each lane's share of the row sum ``l`` and add
      the 4 lanes of a row once after the tile loop (FlashAttention-3's
      order).  GPU only in effect: the interpreter sums every step.
    early_q_release: with ``prefetch_q``, signal "done with Q" once the
      last ``Q K^T`` is read back rather than after the last ``P V``, and
      load the next Q before its K/V tiles.  Needs ``intra_wg_overlap``.
    q_double_buffer: with ``prefetch_q``, two Q buffers per consumer used
      by alternate items, so an item's Q loads without waiting for the
      previous one; not with causal ``persistent_pairs``.
    item_overlap: with ``prefetch_q``, the tile loop runs on across work
      items (an item's epilogue under the next item's first ``Q K^T``)
      where every consumer computes every key tile
      (``forward._chains_items``); with ``intra_wg_overlap`` it needs the
      ping-pong and ``early_q_release`` or ``q_double_buffer``.
    lean_epilogue: tokamax's epilogue: normalise by one reciprocal per
      row, store the output in 64-column chunks through two slots per
      consumer, and wait only for the stores' shared-memory reads.
    unpadded_kv: read K and V unpadded (to a multiple of 8 rows, at any
      length with rows one swizzle wide); TMA zero-fills the last tile
      instead of an XLA pad.  GPU only.
    unpadded_q: read Q and write O unpadded (likewise); TMA zero-fills Q
      and clips O's store.  With both, the unpaired backward reads and
      writes its operands unpadded too.  GPU only.
    bwd_block_q, bwd_block_kv: the backward's query and key tiles
      (multiples of 64): the dQ kernel holds ``bwd_block_q`` query rows per
      consumer and streams ``bwd_block_kv`` keys, the dK/dV kernel the converse.
    bwd_dkv_block_q: query rows per step of the dK/dV kernel (None:
      ``bwd_block_q``): a multiple of 16 from 64 to 256 (of 64 with
      ``bwd_atomic_dq``); not with ``bwd_paired_dkv``.
    bwd_stages: depth of the backward kernels' shared-memory rings (>= 2).
    bwd_compute_wgs: consumer warpgroups of the backward kernels (1 or 2).
    bwd_paired_dkv: dK and dV by two consumers of one key tile (dV and dK,
      ``P^T`` handed over in shared memory), one float32 accumulator each:
      the Hopper backward above padded head_dim 128 (else the Triton one);
      tuned on there.  Not with ``bwd_atomic_dq``; calls with a dense bias
      or mask, ALiBi or dropout take the Triton backward with it (as with
      ``bwd_paired_dq``).
    bwd_paired_dq: dQ by two consumers of one query tile (``P``, then
      ``dS`` and ``dQ``), Q and dO held once each: tuned on above padded
      head_dim 128.  Not with ``bwd_atomic_dq``.
    bwd_consumer_registers: registers per thread of each backward consumer
      warpgroup (``setmaxnreg``): tokamax's 232 or FlashAttention-3's 240
      (tuned at padded head_dim 128); the producer keeps the rest.
    bwd_atomic_dq: dQ added by the dK/dV kernel with TMA reduce-adds into a
      float32 buffer, as FlashAttention-3 (no dQ kernel); not bitwise
      reproducible (``deterministic=True`` turns it off, as does a dense
      bias, whose gradient the dQ kernel writes).  Padded head_dim <= 128
      and a GPU only; tuned on at padded head_dim 64 (H200 entry).
    bwd_softmax_overlap: FlashAttention-3's step order in the dK/dV and dQ
      kernels: ``P`` computed under ``dP``'s wgmma and ``dS`` under
      ``dV``'s; tuned on at padded head_dim 128.
    bwd_stats_in_acc: the dK/dV kernel starts its ``S^T`` and ``dP^T``
      accumulators at ``-lse2 / (scale log2 e)`` and ``-delta`` (``delta``
      alone under a soft cap), so the wgmmas subtract them; GPU only.
      Tuned on at padded head_dim 128 and by the H200's head_dim 64 rules.
    bwd_early_dv: with ``bwd_softmax_overlap``, ``dV += P^T dO`` is issued
      behind ``dP^T``'s wgmma, before the wait for it; tuned on at padded
      head_dim 128.
    bwd_head_splits: GQA/MQA: the dK/dV kernel's programs each take
      ``1 / bwd_head_splits`` of a key/value head's query heads and write
      float32 partials that one XLA pass sums; None: chosen per call by
      :func:`dkv_head_splits` (1 unless there are few key tiles to share
      out).  Not with ``bwd_paired_dkv``.
  """

  block_q: int = 64
  block_kv: int = 64
  stages: int = 2
  compute_wgs: int = 2
  consumer_registers: int | None = None
  p_in_smem: bool = False
  schedule_barrier: bool = True
  persistent: bool = False
  intra_wg_overlap: bool = False
  named_barriers: bool = False
  prefetch_q: bool = False
  persistent_pairs: bool = False
  causal_lpt: bool = True
  kv_multicast: bool = False
  rescale_threshold: int = 0
  deferred_row_sum: bool = False
  early_q_release: bool = False
  q_double_buffer: bool = False
  item_overlap: bool = False
  lean_epilogue: bool = False
  unpadded_kv: bool = False
  unpadded_q: bool = False
  bwd_block_q: int = 64
  bwd_block_kv: int = 64
  bwd_dkv_block_q: int | None = None
  bwd_stages: int = 2
  bwd_compute_wgs: int = 2
  bwd_paired_dkv: bool = False
  bwd_paired_dq: bool = False
  bwd_consumer_registers: int = 232
  bwd_atomic_dq: bool = False
  bwd_softmax_overlap: bool = False
  bwd_stats_in_acc: bool = False
  bwd_early_dv: bool = False
  bwd_head_splits: int | None = None

  def __post_init__(self):
    for name in ("block_q", "bwd_block_q", "bwd_block_kv"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < 64 or val % 64:
        raise ValueError(f"{name}={val!r} must be a positive multiple of 64")
    if (not isinstance(self.block_kv, int) or self.block_kv < 64
        or self.block_kv % 16):
      raise ValueError(f"block_kv={self.block_kv!r} must be a multiple of 16"
                       " from 64")
    dkv_q = self.bwd_dkv_block_q
    if dkv_q is not None:
      if (not isinstance(dkv_q, int) or dkv_q < 64 or dkv_q % 16
          or dkv_q > 256):
        raise ValueError(f"bwd_dkv_block_q={dkv_q!r} must be None or a"
                         " multiple of 16 from 64 to 256 (wgmma's N)")
      if self.bwd_atomic_dq and dkv_q % 64:
        raise ValueError(
            f"bwd_dkv_block_q={dkv_q} with bwd_atomic_dq=True: the atomic"
            " dQ's dS K takes the query rows as wgmma's M, a multiple of 64")
      if self.bwd_paired_dkv:
        raise ValueError(
            f"bwd_dkv_block_q={dkv_q} with bwd_paired_dkv=True: the paired"
            " dK/dV kernel streams bwd_block_q rows (it needs"
            " bwd_dkv_block_q=None)")
    splits = self.bwd_head_splits
    if splits is not None:
      if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"bwd_head_splits={splits!r} must be None or a"
                         " positive integer")
      if splits > 1 and self.bwd_paired_dkv:
        raise ValueError(
            f"bwd_head_splits={splits} with bwd_paired_dkv=True: the paired"
            " dK/dV kernel takes whole groups (bwd_head_splits=None or 1)")
    thr = self.rescale_threshold
    if not isinstance(thr, int) or not 0 <= thr <= MAX_RESCALE_THRESHOLD:
      raise ValueError(
          f"rescale_threshold={thr!r} must be an integer from 0 (off) to"
          f" {MAX_RESCALE_THRESHOLD} (P up to 2^threshold must stay exact"
          " in float16)")
    for name in ("stages", "bwd_stages"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < 2:
        raise ValueError(f"{name}={val!r} must be an integer >= 2")
    if self.compute_wgs not in (1, 2, 3):
      raise ValueError(
          f"compute_wgs={self.compute_wgs!r} must be 1, 2 or 3")
    if self.bwd_compute_wgs not in (1, 2):
      raise ValueError(
          f"bwd_compute_wgs={self.bwd_compute_wgs!r} must be 1 or 2")
    for option, other, why in _EXCLUSIVE_OPTIONS:
      if getattr(self, option) and getattr(self, other):
        raise ValueError(f"{option}=True {why}: it needs {other}=False"
                         f" (got {other}=True)")
    if self.named_barriers and self.stages > MAX_NAMED_STAGES:
      raise ValueError(
          f"named_barriers=True takes 2 + 2 * stages of the"
          f" {FREE_NAMED_BARRIERS} free hardware barriers: stages <="
          f" {MAX_NAMED_STAGES}, got"
          f" stages={self.stages}")
    if self.consumer_registers is not None:
      if self.compute_wgs == 1:
        raise ValueError(
            "consumer_registers moves registers from the producer to two or"
            " three consumers: it needs compute_wgs 2 or 3, got"
            f" consumer_registers={self.consumer_registers!r} with"
            " compute_wgs=1")
      _check_register_split("consumer_registers", self.consumer_registers,
                            self.compute_wgs,
                            launch_registers(self.compute_wgs + 1))
    # The backward's split: from tokamax's 232 (two consumers).
    _check_register_split("bwd_consumer_registers",
                          self.bwd_consumer_registers, 2,
                          DEFAULT_CONSUMER_REGISTERS)
    for option, parent in (("bwd_early_dv", "bwd_softmax_overlap"),
                           ("early_q_release", "intra_wg_overlap")):
      if getattr(self, option) and not getattr(self, parent):
        raise ValueError(f"{option}=True changes the order of"
                         f" {parent}=True: it needs {parent}=True (got"
                         f" {parent}=False)")

  @property
  def dkv_block_q(self) -> int:
    """Query rows per step of the dK/dV kernel
    (:attr:`bwd_dkv_block_q`, else :attr:`bwd_block_q`)."""
    return self.bwd_dkv_block_q or self.bwd_block_q

  @property
  def prefetches_q(self) -> bool:
    """The forward runs :attr:`prefetch_q`'s form (it needs persistent)."""
    return self.persistent and self.prefetch_q

  @property
  def out_slots(self) -> bool:
    """The forward's output leaves through shared-memory slots of its own
    in 64-column chunks (:attr:`prefetch_q`'s form, or
    :attr:`lean_epilogue`)."""
    return self.prefetches_q or self.lean_epilogue

  def out_chunks(self, head_dim_padded: int) -> tuple[int, int, int]:
    """The output's staging with :attr:`out_slots`: (chunk columns,
    chunks, slots); 64-column chunks, or at a head_dim that 64 does not
    divide (the forward's own 80 or 96) the widest swizzle's width that
    divides it (:func:`swizzle_columns`)."""
    width = swizzle_columns(head_dim_padded)
    chunks = head_dim_padded // width
    return width, chunks, min(2, chunks)

  def _fwd_buffers(self, head_dim_padded: int, itemsize: int,
                   bias: bool = False) -> list[int]:
    qo = self.compute_wgs * self.block_q * head_dim_padded * itemsize
    if self.prefetches_q and self.q_double_buffer:
      qo *= 2
    kv = self.stages * self.block_kv * head_dim_padded * itemsize
    buffers = [qo, kv, kv, self.compute_wgs * self.block_q * 4]
    if self.p_in_smem:
      buffers.append(self.compute_wgs * self.block_q * self.block_kv
                     * itemsize)
    if self.out_slots:  # the output's chunks
      width, _, slots = self.out_chunks(head_dim_padded)
      buffers.append(self.compute_wgs * slots * self.block_q * width
                     * itemsize)
    if bias:  # the dense bias's ring: one tile per K/V slot
      buffers.append(self.stages * self.compute_wgs * self.block_q
                     * self.block_kv * itemsize)
    return buffers

  def fwd_reduction_scratch(self, head_dim_padded: int,
                            itemsize: int = 2,
                            bias: bool = False) -> int | None:
    """``CompilerParams.reduction_scratch_bytes`` of the forward: None
    (Pallas' 2 KiB) where the buffers fit beside it, else 0.  The forward
    needs none (its reductions run along wgmma rows, within a warp; the
    lowering fails if one needed scratch), so configs just over the limit
    (``prefetch_q`` at head_dim 256, block_kv 192 at 128) drop it.
    ``prefetch_q`` always runs without it (as measured).  ``bias``: with
    a dense bias's ring."""
    buffers = self._fwd_buffers(head_dim_padded, itemsize, bias)
    with_scratch = sum(buffers) + _reserved(len(buffers))
    if self.prefetches_q or with_scratch > SMEM_LIMIT:
      return 0
    return None

  def smem_bytes(self, head_dim_padded: int, itemsize: int = 2,
                 bias: bool = False) -> int:
    """Shared memory the forward kernel allocates (``bias``: with a dense
    bias's ring)."""
    buffers = self._fwd_buffers(head_dim_padded, itemsize, bias)
    if self.fwd_reduction_scratch(head_dim_padded, itemsize, bias) == 0:
      # Exact: Pallas rounds each buffer up to 1 KiB; the barriers take
      # well under 1 KiB (checked against the compiler in test_lowering).
      return sum(-(-b // 1024) * 1024 for b in buffers) + 1024
    # With the reduction scratch: the conservative count (up to 1 KiB of
    # alignment per buffer), checked against the compiler the same way.
    return sum(buffers) + _reserved(len(buffers))

  def bwd_smem_bytes(self, head_dim_padded: int, itemsize: int = 2,
                     head_splits: int = 1, bias: bool = False,
                     ds_itemsize: int = 0) -> int:
    """Shared memory of the larger of the two backward kernels
    (``head_splits`` > 1: the dK/dV kernel's float32 staging tiles;
    ``bias``: a dense bias's rings; ``ds_itemsize`` > 0: the dQ kernel's
    staged dS tiles, the bias's gradient)."""
    bq, bk, n = self.bwd_block_q, self.bwd_block_kv, self.bwd_compute_wgs
    a_op = n * bq * bk * itemsize if self.p_in_smem else 0
    # dK/dV: K, V held per consumer; Q, dO, lse, delta streamed (in steps
    # of dkv_block_q rows).
    sq = self.dkv_block_q
    dkv = (2 * n * bk * head_dim_padded * itemsize
           + self.bwd_stages * (2 * sq * head_dim_padded * itemsize
                                + 8 * vec_slot_rows(sq))
           + n * sq * bk * itemsize * self.p_in_smem)
    dkv_buffers = 6 + self.p_in_smem
    if head_splits > 1:  # one float32 partial tile per consumer
      dkv += n * bk * head_dim_padded * 4
      dkv_buffers += 1
    if bias:  # a bias tile of every consumer's keys per slot
      dkv += self.bwd_stages * sq * n * bk * itemsize
      dkv_buffers += 1
    if self.bwd_atomic_dq:
      # dS^T staged per consumer (the dQ matmul's transposed A operand)
      # unless P's buffer exists, and one float32 dQ tile per consumer.
      dkv += (0 if self.p_in_smem else n * sq * bk * itemsize)
      dkv += n * sq * head_dim_padded * 4
      dkv_buffers += 1 + (not self.p_in_smem)
      return dkv + _reserved(dkv_buffers)
    if self.bwd_paired_dkv:
      # One K and one V tile, the ring, one P^T hand-over per slot and,
      # with p_in_smem, both consumers' staged A operands.
      dkv = (2 * bk * head_dim_padded * itemsize
             + self.bwd_stages * (2 * bq * head_dim_padded * itemsize
                                  + 8 * vec_slot_rows(bq) + bk * bq * itemsize)
             + (2 * bq * bk * itemsize if self.p_in_smem else 0))
      dkv_buffers = 7 + self.p_in_smem
    # dQ: Q, dO held per consumer; K, V streamed.
    dq = (2 * n * bq * head_dim_padded * itemsize
          + self.bwd_stages * 2 * bk * head_dim_padded * itemsize + a_op
          + bias * self.bwd_stages * n * bq * bk * itemsize
          + n * bq * bk * ds_itemsize)
    dq_buffers = 4 + self.p_in_smem + bias + (ds_itemsize > 0)
    if self.bwd_paired_dq:
      # One Q and one dO tile, the K/V ring, one P hand-over per slot and,
      # with p_in_smem, consumer 1's staged dS.
      dq = (2 * bq * head_dim_padded * itemsize
            + self.bwd_stages * (2 * bk * head_dim_padded + bq * bk)
            * itemsize + (bq * bk * itemsize if self.p_in_smem else 0))
      dq_buffers = 5 + self.p_in_smem
    return max(dkv + _reserved(dkv_buffers), dq + _reserved(dq_buffers))


def swizzle_columns(columns: int, itemsize: int = 2) -> int:
  """Columns (of ``itemsize``-byte elements) of the widest shared-memory
  swizzle (128, 64 or 32 bytes) that divides ``columns``: for 16-bit
  elements 64, 32 or 16, for FP8 128, 64 or 32.  A wgmma operand's
  swizzle must divide its contraction (Mosaic GPU: "K must be a multiple
  of 64" at 128 bytes) and its tiling its columns."""
  for swizzle in (128, 64, 32):
    if columns % (swizzle // itemsize) == 0:
      return swizzle // itemsize
  raise ValueError(f"{columns} columns of {itemsize}-byte elements are not"
                   f" a multiple of {32 // itemsize}")


def kernel_head_dim(head_dim: int) -> int:
  """The Hopper kernels' head_dim: ``head_dim`` rounded up to 16 (a
  16-bit wgmma's K step), so 80 and 96 run as themselves, with narrower
  swizzles, rather than padded to 128 (the matmuls then do 0.625 and
  0.75 of the padded work; FlashAttention-3 instantiates such head_dims
  too)."""
  return -(-head_dim // 16) * 16


# Three consumers hold their output accumulators (block_q x head_dim
# float32 each) inside the four-warpgroup launch allocation
# (launch_registers(4) = 128 per thread): at padded head_dim 256 that
# accumulator alone is 128 registers, and ptxas refused the forward
# (C7602: "Try to compile with register target of 158 or higher", H200,
# 2026-12-03); 192 compiled and passed its GPU tests.
MAX_THREE_WG_HEAD_DIM = 192


def head_dim_problem(config: "MosaicConfig", head_dim_padded: int
                     ) -> str | None:
  """Why this config cannot serve this padded head_dim (shared memory,
  the atomic dQ, three consumers' registers), None when it can: the one
  check of the backend (``NotImplementedError``), of the tuned defaults
  and of the GPU tests' config list."""
  need = needed_smem_bytes(config, head_dim_padded)
  if need > SMEM_LIMIT:
    return (f"{config} needs {need} bytes of shared memory at head_dim"
            f" {head_dim_padded} (limit {SMEM_LIMIT})")
  if config.bwd_atomic_dq and head_dim_padded > MAX_BWD_HEAD_DIM:
    # Above 128 the Hopper backward runs only as bwd_paired_dkv, which
    # does not take the atomic dQ: refused here rather than served
    # silently by the Triton backward.
    return (f"bwd_atomic_dq can serve padded head_dim up to"
            f" {MAX_BWD_HEAD_DIM}, got {head_dim_padded}")
  if config.compute_wgs == 3 and head_dim_padded > MAX_THREE_WG_HEAD_DIM:
    return (f"compute_wgs=3 serves padded head_dim up to"
            f" {MAX_THREE_WG_HEAD_DIM}, got {head_dim_padded}: three"
            f" consumers' {config.block_q} x {head_dim_padded} float32"
            " output accumulators do not fit the launch's"
            f" {launch_registers(4)} registers per thread")
  return None


# dkv_head_splits: the dK/dV grid should fill this many waves of the SMs.
# Below it, an MQA call's few programs (one per key tile: 64 at 8k keys,
# batch 1) each stream every query head of the group, while most SMs idle.
HEAD_SPLIT_WAVES = 2


def dkv_head_splits(config: "MosaicConfig", *, group_size: int,
                    programs: int, sm_count: int, head_dim_padded: int
                    ) -> int:
  """Parts of each GQA/MQA group the dK/dV kernel shares out over
  programs: ``config.bwd_head_splits`` where given (it must divide the
  group), else the least divisor of ``group_size`` that gives the
  ``programs`` (key tiles x key/value heads x batch) at least
  :data:`HEAD_SPLIT_WAVES` waves of ``sm_count`` SMs (the whole group if
  none does), and 1 where the float32 staging tile does not fit in
  shared memory or the paired kernel runs.  FlashAttention-3 sums GQA's
  dK/dV by float32 atomics instead; the partials here keep the sum in a
  fixed order (bitwise reproducible)."""
  forced = config.bwd_head_splits
  if forced is not None:
    if group_size % forced:
      raise ValueError(
          f"bwd_head_splits={forced} must divide the query heads per"
          f" key/value head ({group_size})")
    return forced
  if config.bwd_paired_dkv or group_size == 1:
    return 1
  want = HEAD_SPLIT_WAVES * sm_count
  splits = next((s for s in range(1, group_size + 1)
                 if group_size % s == 0 and programs * s >= want), group_size)
  if splits > 1 and config.bwd_smem_bytes(
      head_dim_padded, head_splits=splits) > SMEM_LIMIT:
    return 1
  return splits


def parse_overrides(text: str) -> dict:
  """``"bwd_atomic_dq=1,bwd_stages=3"`` -> ``{"bwd_atomic_dq": True,
  "bwd_stages": 3}``: MosaicConfig fields with integer values (0/1 for
  booleans), as the tuning tools and the benchmark take them.  Unknown
  fields and non-integer values raise ValueError; ``none`` sets a field
  that may be ``None`` (``consumer_registers=none``)."""
  fields = {f.name: f for f in dataclasses.fields(MosaicConfig)}
  out = {}
  for item in filter(None, (i.strip() for i in text.split(","))):
    name, _, val = item.partition("=")
    field = fields.get(name.strip())
    if field is None:
      raise ValueError(f"unknown MosaicConfig field {name.strip()!r} in"
                       f" {text!r}; fields: {sorted(fields)}")
    if val.strip().lower() == "none" and "None" in str(field.type):
      out[field.name] = None
      continue
    try:
      num = int(val)
    except ValueError:
      raise ValueError(f"{item!r}: the value must be an integer") from None
    out[field.name] = bool(num) if field.type in (bool, "bool") else num
  return out


def parse_variants(text: str) -> dict[str, dict]:
  """``"stages3:bwd_stages=3;dqk:bwd_atomic_dq=0"`` -> ``{"stages3":
  {"bwd_stages": 3}, "dqk": {...}}``: named override sets
  (:func:`parse_overrides` each), as the benchmark's
  ``--mosaic-variants`` and ``tools/kernel_times.py --variants`` take
  them.  An unnamed or repeated variant raises ValueError."""
  out = {}
  for part in filter(None, (p.strip() for p in text.split(";"))):
    name, sep, fields = part.partition(":")
    name = name.strip()
    if not sep or not name or name in out:
      raise ValueError(f"variant {part!r}: expected NAME:field=value,..."
                       " with a new NAME")
    out[name] = parse_overrides(fields)
  return out


# What a call with a dense bias gives up, in this order, until the bias's
# ring fits beside the forward's buffers (each step kept from then on).
_BIAS_RING_STEPS = (dict(q_double_buffer=False), dict(block_kv=64),
                    dict(stages=2), dict(p_in_smem=False))


def with_bias_ring(config: "MosaicConfig",
                   head_dim_padded: int) -> "MosaicConfig | None":
  """The forward config of a call with a dense bias: ``config`` where its
  buffers and the bias's ring (one tile per K/V slot) fit the shared
  memory, else ``config`` with the first steps of
  :data:`_BIAS_RING_STEPS` that make them fit; None where none does."""
  fits = lambda c: c.smem_bytes(head_dim_padded, bias=True) <= SMEM_LIMIT
  for step in ({},) + _BIAS_RING_STEPS:
    try:
      config = dataclasses.replace(config, **step)
    except ValueError:  # a field another needs (q_double_buffer)
      continue
    if fits(config):
      return config
  return None


def with_mask_tiles(config: "MosaicConfig") -> "MosaicConfig":
  """The forward config of a call with a FlashMask or a dense mask: its
  key tile rounded down to a power of two (176 becomes 128), so that
  tiles line up with the power-of-two blocks such masks are made of
  (documents, prefixes, windows), and more of them are skipped whole or
  run unmasked.  Eight 1024-token documents as three FlashMask fields
  (batch 2, 8192 tokens, 16 heads, head_dim 128, non-causal) ran 1.69x
  faster in 128-key tiles than in the tuned 176 on an H100 SXM
  (docs/benchmarks/h100-2026-12-07-5f4800d-flashmask-causal-decode-launch.md)."""
  block_kv = 1 << (config.block_kv.bit_length() - 1)
  if block_kv == config.block_kv:
    return config
  return dataclasses.replace(config, block_kv=block_kv)


def with_fp8(config: "MosaicConfig") -> "MosaicConfig":
  """The forward config of an FP8 call: ``config`` with ``block_kv`` a
  multiple of 64 (P V contracts over the keys in 8-bit swizzles: 176
  becomes 128) and the output leaving through slots of its own (Q's
  buffer holds 8-bit values, the output 16-bit ones: ``lean_epilogue``
  where the config has no such slots).  ``p_in_smem`` as the config says
  (without it P is an 8-bit register operand)."""
  config = dataclasses.replace(
      config, block_kv=max(64, config.block_kv // 64 * 64))
  if not config.out_slots:
    config = dataclasses.replace(config, lean_epilogue=True)
  return config


# The FP8 forward's own key tile where it beats the 16-bit config's: at
# padded head_dim 128, 256 keys (8-bit K and V leave the shared memory for
# them) ran 1.06-1.10x the 128-key tile on an H100, causal and not, at
# 8192 keys (docs/benchmarks/, 2026-12-07, c62583c), the one length
# measured: from FP8_WIDE_MIN_KV keys on; at 64 the 256-key kernel fails
# to compile, at 256 it does not fit.
FP8_BLOCK_KV = {128: 256}
FP8_WIDE_MIN_KV = 8192


def fp8_default(config: "MosaicConfig", head_dim_padded: int,
                kv_len: int) -> "MosaicConfig":
  """The FP8 forward's default config from the tuned 16-bit one:
  :func:`with_fp8`, with :data:`FP8_BLOCK_KV`'s key tile where one is
  listed, ``kv_len`` is at least :data:`FP8_WIDE_MIN_KV` and it fits."""
  config = with_fp8(config)
  block_kv = FP8_BLOCK_KV.get(head_dim_padded)
  if block_kv is not None and kv_len >= FP8_WIDE_MIN_KV:
    wide = dataclasses.replace(config, block_kv=block_kv)
    if fp8_problem(wide, head_dim_padded) is None:
      return wide
  return config


def fp8_problem(config: "MosaicConfig", head_dim_padded: int) -> str | None:
  """Why ``with_fp8(config)`` cannot serve an FP8 forward at this padded
  head_dim (its shared memory: 8-bit Q, K, V and P, 16-bit output
  slots; three consumers' registers), None when it can."""
  config = with_fp8(config)
  width, _, slots = config.out_chunks(head_dim_padded)
  need = (config.smem_bytes(head_dim_padded, itemsize=1)
          + config.compute_wgs * slots * config.block_q * width)
  if need > SMEM_LIMIT:
    return (f"{config} needs {need} bytes of shared memory for FP8 at"
            f" head_dim {head_dim_padded} (limit {SMEM_LIMIT})")
  if config.compute_wgs == 3 and head_dim_padded > MAX_THREE_WG_HEAD_DIM:
    return (f"compute_wgs=3 serves padded head_dim up to"
            f" {MAX_THREE_WG_HEAD_DIM}, got {head_dim_padded}")
  return None


def fp8_head_dim(head_dim: int) -> int:
  """The Hopper FP8 forward's head_dim: ``head_dim`` rounded up to 32 (an
  8-bit wgmma's K step, and the narrowest swizzle's 32 bytes)."""
  return -(-head_dim // 32) * 32


def needed_smem_bytes(config: "MosaicConfig", head_dim_padded: int) -> int:
  """Shared memory of the largest kernel a call with this config runs
  (the forward, and the Hopper backward where it serves the head_dim)."""
  need = config.smem_bytes(head_dim_padded)
  if head_dim_padded <= MAX_BWD_HEAD_DIM or config.bwd_paired_dkv:
    need = max(need, config.bwd_smem_bytes(
        head_dim_padded, head_splits=config.bwd_head_splits or 1))
  return need


def _reserved(n_buffers: int) -> int:
  """What Pallas adds to the scratch buffers: its reduction scratch
  (``CompilerParams.reduction_scratch_bytes``, 2 KiB by default) and up to
  1 KiB of alignment per buffer (swizzled tiles start on 1024-byte
  boundaries).  Without it, block_kv=128 with 3 stages at head_dim 128
  looked like 224.5 KiB and failed to compile on the H200."""
  return 2048 + 1024 * n_buffers


# Hopper: 227 KiB of shared memory per block (sm90 opt-in maximum).
SMEM_LIMIT = 227 * 1024

# A TMA copy's shared-memory destination starts on a 128-byte boundary
# (PTX cp.async.bulk.tensor), so the backward's float32 rings (log-sum-exp,
# delta) take slots of a multiple of 32 rows: 80-row slots
# (bwd_dkv_block_q) put the second one at byte 320, and the H200 raised
# CUDA_ERROR_MISALIGNED_ADDRESS.
VEC_SLOT_ROWS = 32


def vec_slot_rows(rows: int) -> int:
  """A float32 ring's slot length for ``rows`` rows (128-byte slots)."""
  return -(-rows // VEC_SLOT_ROWS) * VEC_SLOT_ROWS

# 32-bit registers of one CTA (sm90); setmaxnreg's range starts at 24.
REGISTER_FILE = 65536
MIN_REGISTERS = 24
DEFAULT_CONSUMER_REGISTERS = 232
# Three consumers and a producer start at 128 registers per thread (512
# threads); FlashAttention-3 gives its three consumers 160 and the
# producer the 32 left (hopper/flash_fwd_kernel_sm90.h).
THREE_CONSUMER_REGISTERS = 160


def _check_register_split(name: str, regs, n_consumers: int,
                          least: int) -> None:
  """ValueError unless ``regs`` per consumer thread is a multiple of 8 from
  ``least`` that leaves the producer at least ``MIN_REGISTERS`` of the
  launch allocation (``producer_registers``)."""
  n_wg = n_consumers + 1
  if (not isinstance(regs, int) or regs % 8 or regs < least
      or producer_registers(regs, n_consumers) < MIN_REGISTERS):
    raise ValueError(
        f"{name}={regs!r}: it must be a multiple of 8 from {least} that"
        f" leaves the producer at least {MIN_REGISTERS} of the launch"
        f" allocation ({launch_registers(n_wg)} per thread of each of"
        f" {n_wg} warpgroups), got {regs!r} with {n_consumers} consumers")


def launch_registers(n_warpgroups: int) -> int:
  """Registers per thread a kernel of ``n_warpgroups`` starts with: the
  register file shared out, in steps of 8 (168 for three warpgroups)."""
  return REGISTER_FILE // (128 * n_warpgroups) // 8 * 8


def producer_registers(consumer_registers: int, n_consumers: int) -> int:
  """What is left for the producer warpgroup when each of ``n_consumers``
  warpgroups takes ``consumer_registers`` per thread.

  ``setmaxnreg.inc`` takes registers only from what the CTA's other
  warpgroups gave back with ``setmaxnreg.dec`` (the pool is the CTA's
  launch allocation, not the whole register file); a consumer that asks
  for more than was freed waits forever.  So the budget is the launch
  allocation: with three warpgroups 3 x 168 per thread, 232 + 232 + 40
  (tokamax) or 240 + 240 + 24 (FlashAttention-3).  (Counting the whole
  64K file instead gave the producer 32 next to 240: the consumers then
  hung on the H200.)"""
  n_wg = n_consumers + 1
  left = n_wg * launch_registers(n_wg) - n_consumers * consumer_registers
  return left // 8 * 8
# Largest padded head_dim of the Hopper backward with dK and dV in one pass
# (two 64 x head_dim float32 accumulators per warpgroup); above it the
# backward needs ``bwd_paired_dkv`` or falls back to the Triton kernels.
MAX_BWD_HEAD_DIM = 128

# Runs under the Mosaic GPU interpreter (CPU tests): one consumer
# warpgroup, P through shared memory.
INTERPRET_CONFIG = MosaicConfig(block_q=64, block_kv=64, stages=2,
                                compute_wgs=1, p_in_smem=True,
                                schedule_barrier=False, bwd_compute_wgs=1)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
  """json's object hook: a key given twice is a ValueError (json.load
  would keep the last one silently)."""
  keys = [k for k, _ in pairs]
  twice = sorted({k for k in keys if keys.count(k) > 1})
  if twice:
    raise ValueError(f"tuning.json: keys given twice in one object: {twice}")
  return dict(pairs)


def load_tuning(text: str) -> dict:
  """tuning.json's text, parsed (no key given twice in an object) and
  checked (:func:`check_tuning`)."""
  tuning = json.loads(text, object_pairs_hook=_unique_keys)
  check_tuning(tuning)
  return tuning


@functools.cache
def _tuning() -> dict:
  with open(os.path.join(os.path.dirname(__file__), "tuning.json")) as f:
    return load_tuning(f.read())


def tuned_device_kinds() -> list[str]:
  """The device kinds with a tuned entry in tuning.json, their own or
  another kind's by ``aliases`` (others get its ``default`` entry)."""
  tuning = _tuning()
  return ([k for k in tuning["devices"] if k != "default"]
          + list(tuning.get("aliases", {})))


def _entries(device_kind: str | None) -> dict:
  """tuning.json's entry for this device kind: its own, the one its alias
  names, else ``default``."""
  tuning = _tuning()
  kind = tuning.get("aliases", {}).get(device_kind, device_kind)
  return tuning["devices"].get(kind or "", tuning["devices"]["default"])


def check_tuning(tuning: dict) -> None:
  """ValueError, naming the place and the offending value, where
  tuning.json's rules are malformed: each ``kv_rules`` item must be
  ``{"causal": bool, "min_kv": int >= 0, "fields": {MosaicConfig field:
  value}}``, and each alias must name a kind with an entry."""
  names = {f.name for f in dataclasses.fields(MosaicConfig)}

  def check(rules, where):
    if not isinstance(rules, list):
      raise ValueError(f"tuning.json {where}: a list of rules, not"
                       f" {rules!r}")
    for rule in rules:
      ok = (isinstance(rule, dict)
            and set(rule) == {"causal", "min_kv", "fields"}
            and isinstance(rule["causal"], bool)
            and isinstance(rule["min_kv"], int)
            and not isinstance(rule["min_kv"], bool)
            and rule["min_kv"] >= 0 and isinstance(rule["fields"], dict))
      if not ok:
        raise ValueError(f"tuning.json {where}: {rule!r} is not"
                         ' {"causal": bool, "min_kv": int >= 0,'
                         ' "fields": {...}}')
      unknown = sorted(set(rule["fields"]) - names)
      if unknown:
        raise ValueError(f"tuning.json {where}: {unknown} are not"
                         " MosaicConfig fields")

  for kind, entries in tuning["devices"].items():
    for dim, fields in entries.items():
      check(fields.get("kv_rules", []), f"{kind} {dim} kv_rules")
  for kind, target in tuning.get("aliases", {}).items():
    if target not in tuning["devices"]:
      raise ValueError(f"tuning.json aliases: {kind!r} names {target!r},"
                       " which has no entry")


def default_config(device_kind: str | None, head_dim_padded: int, *,
                   causal: bool = False, kv_len: int | None = None
                   ) -> MosaicConfig:
  """The tuned entry for this device kind and head_dim (nearest larger
  head_dim; the entry ``aliases`` names for an aliased kind; the
  ``default`` kind when the device is not listed).

  A field given as ``{"noncausal": ..., "causal": ...}`` takes the value
  of the call's setting (False where that setting is not given).

  An entry's ``persistent_max_kv`` rule turns on the persistent forward
  for calls with at most that many keys (per causal setting).  Its
  ``kv_rules`` (a list of ``{"causal": bool, "min_kv": int, "fields":
  {...}}``) then replace those fields, in order, for calls of that causal
  setting with at least ``min_kv`` keys (none applies where ``kv_len`` is
  not given).  Measurements behind the values: docs/benchmarks/.
  """
  entries = _entries(device_kind)
  dims = sorted(int(d) for d in entries)
  pick = next((d for d in dims if d >= head_dim_padded), dims[-1])
  fields = dict(entries[str(pick)])
  rule = fields.pop("persistent_max_kv", {})
  setting = "causal" if causal else "noncausal"
  limit = rule.get(setting)
  if kv_len is not None and limit is not None and kv_len <= limit:
    fields["persistent"] = True
  for kv_rule in fields.pop("kv_rules", []):
    if (kv_len is not None and kv_rule["causal"] == causal
        and kv_len >= kv_rule["min_kv"]):
      fields.update(kv_rule["fields"])
  for name, value in list(fields.items()):
    if isinstance(value, dict):  # per causal setting, off where not given
      fields[name] = bool(value.get(setting, False))
  cfg = MosaicConfig(**fields)
  why = head_dim_problem(cfg, head_dim_padded)
  if why:
    raise ValueError(f"tuned config for head_dim {head_dim_padded}: {why}")
  return cfg
