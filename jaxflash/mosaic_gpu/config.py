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
# ping-pong schedule and one per stage for each of the K and V rings; the
# backward one per stage.
FREE_NAMED_BARRIERS = 12
MAX_NAMED_STAGES = (FREE_NAMED_BARRIERS - 2) // 2


# Options that do not combine: (option, other, why option excludes other).
_EXCLUSIVE_OPTIONS = (
    ("bwd_delta_in_regs", "bwd_stats_first",
     "leaves no dP^T starting value to store first"),
    ("bwd_atomic_dq", "bwd_split_dkv",
     "needs dK and dV in one pass of the dK/dV kernel (it reuses that"
     " pass's dS)"),
    ("bwd_paired_dkv", "bwd_split_dkv",
     "is another way to hold one accumulator per warpgroup"),
    ("bwd_paired_dkv", "bwd_atomic_dq",
     "has no dQ in its dK/dV kernel (the dQ kernel runs)"),
    ("bwd_dq_late_release", "bwd_atomic_dq",
     "changes the dQ kernel, which bwd_atomic_dq=True does not run"),
    ("bwd_paired_dq", "bwd_atomic_dq",
     "is a dQ kernel, which bwd_atomic_dq=True does not run"),
    ("bwd_paired_dq", "bwd_dq_late_release",
     "has its own dQ loop (bwd_dq_late_release changes the other one)"),
    ("bwd_dkv_late_release", "bwd_atomic_dq",
     "leaves dK's wgmma in flight, where bwd_atomic_dq's dS K follows it"),
    ("bwd_dkv_late_release", "bwd_paired_dkv",
     "changes the two-accumulator dK/dV kernel, which"
     " bwd_paired_dkv=True does not run"),
)


# rescale_threshold's ceiling: P runs up to 2^threshold, exact in float16
# (and bfloat16) and far from float16's 65504; FlashAttention-4 uses 8.
MAX_RESCALE_THRESHOLD = 8

@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles and pipeline of the Hopper forward kernel; frozen (static).

  Attributes:
    block_q: query rows per consumer warpgroup (a multiple of 64: one
      ``wgmma`` M-tile is 64 rows).
    block_kv: key rows per pipeline stage of the forward: a multiple of
      16 from 64.  Multiples of 64 keep the 128-byte swizzle; others
      (FlashAttention-3's 80 at head_dim 256 and 176 at 128,
      hopper/tile_size.h) store V, and ``P`` with ``p_in_smem``, with the
      widest swizzle that divides them (``pipeline.tiled_over``): 64
      bytes at multiples of 32, 32 bytes otherwise.  On the H200 the
      176-key tiles are the head_dim 128 default for non-causal calls
      from 8192 keys (tuning.json's ``kv_rules``; +4-6.5% over 128 keys
      there, level with ``intra_wg_overlap``); shorter and causal calls
      lose with them (176 keys at head_dim 128 causal spills;
      docs/benchmarks/h200-2026-12-02-fa3-tiles.md).  The 80-key tiles
      at 256 were the default there until ``intra_wg_overlap`` beat
      them (docs/benchmarks/h200-2026-12-03-s20.md).
    stages: depth of the K/V shared-memory ring filled by TMA (>= 2).
    compute_wgs: consumer warpgroups per program (1, 2 or 3); a producer
      warpgroup issues the TMA copies (warp specialisation).  Two run
      FlashAttention-3's ping-pong (``schedule_barrier``); three
      (FlashAttention-3's 192-row tile at head_dim 64, hopper/tile_size.h)
      run without it (``schedule_barrier`` has no effect), at
      ``THREE_CONSUMER_REGISTERS`` per thread, and load each key/value
      tile for a third more query rows.  Meant for head_dim 64: 160
      registers hold a 64 x 128 float32 ``S`` and a 64 x 64 ``O``; larger
      ``O`` tiles or 192-key tiles spill (876 bytes measured at
      ``block_kv=192``, head_dim 64).  Refused above padded head_dim
      192 (:data:`MAX_THREE_WG_HEAD_DIM`: ptxas cannot fit the 64 x 256
      accumulator).  The default for every head_dim 64 call from 1024
      keys on the H200 and the H100 SXM (over two consumers +4-11% on the
      H200 in s40, +3-10% on an H100 in s39).
    consumer_registers: registers per thread of each forward consumer
      warpgroup (``setmaxnreg``), None for the default: 232 with two
      consumers (tokamax's split, the producer 40), 160 with three.  240
      is FlashAttention-3's split for two (the producer 24), the H200
      default with ``intra_wg_overlap``: its two accumulators, the
      float32 ``S`` and the 16-bit ``P`` of the step before fit there
      without spills at head_dim 256 with 64-key tiles (40 bytes spilled
      at 232) and at 128 with 128-key tiles.  A multiple of 8 from the
      launch allocation that leaves the producer at least 24
      (``producer_registers``); with two or three consumers only.
    p_in_smem: stage the probabilities ``P`` through shared memory for the
      ``P V`` wgmma (``True``), or feed them from registers (``False``, as
      FlashAttention-3).  Pallas' Mosaic GPU interpreter only runs the
      shared-memory form, so interpreted tests use it; the GPU tests cover
      both.
    schedule_barrier: with two consumer warpgroups, alternate their
      matmuls (FlashAttention-3's ping-pong, arXiv 2407.08608 §3.1).
    persistent: a grid of one program per SM, each looping over work
      items (head, query group, batch) with the K/V ring running on across
      them, so one item's epilogue overlaps the next one's K/V loads (as
      tokamax's non-causal default; without ``prefetch_q`` the next Q
      load still waits for the output's copy out of shared memory).  The
      tuned defaults turn it on for non-causal calls with up to 2048 keys
      at head_dim 128 and at 64 (``persistent_max_kv`` in tuning.json;
      +3-6% there on the H200; at head_dim 128 with ``early_q_release``,
      without which the plain grid with ``lean_epilogue`` was faster
      from 1025 keys; at 64 it was the default up to 16384 keys until
      sustained-load timing had the plain grid 3-5% faster from 4096,
      2026-12-04 s29), and at head_dim 256 for non-causal calls up to
      1024 keys (with ``prefetch_q``; from 2049 keys too until s29,
      where it ran 6% behind ``kv_multicast``'s plain grid under
      sustained load), and for causal
      calls up to 4096 keys at head_dim 64 (+7.5% at 2048 keys, +2% at
      4096, 2026-12-04) and, with ``persistent_pairs``, up to 1024 keys
      at head_dim 128; without the pairs it is slower on causal calls at
      head_dim >= 128.  Since s40 every head_dim 64 causal call runs it
      (from 4097 keys by a kv rule, with three consumers): on the H200
      +11% at 8192 keys and +6% at 16384 (s40), on an H100 +5% and
      +2.4-5.6% (s39).
    intra_wg_overlap: FlashAttention-3's intra-warpgroup overlap
      (arXiv 2407.08608 §3.2): each consumer issues ``S_t = Q K_t^T`` and
      ``O += P_{t-1} V_{t-1}`` back to back and computes tile ``t``'s
      softmax while the ``P V`` wgmma runs; the producer reloads K and V
      slots on separate barriers.  The turns alternate between the two
      consumers as FlashAttention-3's ping-pong: a consumer's turn issues
      both matmuls and hands over at once, so the other's next pair
      queues behind them.  An experiment: the
      first form (both consumers meeting twice a step, so issuing
      together) ran 0.57-0.69x of the default on the H200 at head_dim
      128.
    named_barriers: the forward's "slot consumed" signals and the
      ping-pong schedule on hardware named barriers (``bar.arrive`` /
      ``bar.sync``, as tokamax's sm90 kernel) instead of mbarriers: no
      phase tracking or try-wait loop.  Ids from 4 (Mosaic GPU's own
      barriers use the lower ones): two for the schedule, ``stages`` each
      for K and V, so ``stages <= 5``.  GPU only (inline PTX, which the
      interpreter does not run).
    persistent_pairs: on a causal call on the persistent grid, a work
      unit is two query groups of one (batch, head): the ``p``-th
      longest and the ``p``-th shortest (``G`` groups: group ``p`` and
      ``G - 1 - p`` counted from the longest), one after the other, so
      that on a square causal call every unit has about the same work
      and the static round robin over units is balanced.  Over single
      items it is not: by ``tools/persistent_balance.py`` the round
      robin's makespan is 1.15-1.72x the ideal on the benchmark grid's
      causal calls at head_dim 128/256 with 1024-4096 keys, the pairs'
      1.03x (the plain grid's launch order under the hardware's
      scheduler 1.00-1.03x).  The pairing is
      the one zigzag context parallelism uses to balance causal work
      across devices.  On the H200 (2026-12-04, one run, rotated
      rounds) it made the causal persistent grid 14-69% faster at
      head_dim 128/256, but against the default plain grid it was +3.5%,
      +0.6%, -2.6% at head_dim 128 with 1024/2048/4096 keys and -1.6 to
      -5% at 256, and at head_dim 64 slower than the persistent grid
      without it.  At head_dim 128 with 1024 keys it ran +3.5-4% over the
      plain grid again in two more runs (2026-12-04, s27), and level at
      2048: the H200 default on causal calls of at most 1024 keys at
      head_dim 128 (tuning.json).  Without ``persistent`` or off causal
      calls it does nothing.
    kv_multicast: the forward runs in clusters of two CTAs, the two
      query groups of a cluster (adjacent ones of one (batch, head))
      sharing each K/V tile: each CTA's producer issues half of the tile
      by TMA multicast into both CTAs' shared memory (FlashAttention-3's
      and CUTLASS' cluster multicast), so each tile crosses from L2 once
      per two query groups instead of once per group, and the rings'
      "free" signals are cluster barriers (mbarriers arrived on in both
      CTAs; named barriers cannot span CTAs, so with ``named_barriers``
      only the ping-pong stays on them).  On the plain grid the grid has
      half the query-group programs; on the persistent grid a cluster
      takes a pair of query groups per work unit (half the programs, one
      per two SMs).  Both CTAs of a cluster must stream the same key
      tiles, so it applies only to calls whose key range is the same for
      every query group (no causal mask, local window or segment ids)
      and whose query-group count is even, with one consumer or the
      two-consumer ping-pong (a cluster barrier takes one arrival per
      warpgroup, so nothing else keeps a skipping consumer's warps
      together); elsewhere the kernel runs without clusters.  Written
      because ncu measured, at head_dim 256
      non-causal with 2048 keys, 1.43x tokamax's L2 lookups in
      jaxflash's forward, while the H200 runs it under its power cap
      at a lower clock than tokamax's and cuDNN's
      (docs/benchmarks/h200-2026-12-04-s28.md).  Measured there against
      the default (four runs): +1.2 to +4% at head_dim 128 with 1024
      keys on the persistent grid (the H200 default there), level at
      2048, and slower elsewhere: -5% at head_dim 64, -1% at 256 on the
      plain grid, -2 to -3% at 128 on the plain grid from 4096 keys, -10
      to -12% at 256 on the persistent grid from 4096 keys (not the
      cluster count: 56-66 clusters ran alike, s29 §2; lockstep between
      the two CTAs is not isolated).  Under sustained load (0.5-3 s
      back to back, at the power cap) it ran 2.4% faster than the
      default at head_dim 256 with 2048 keys on the plain grid, drawing
      tokamax's power (s28 §6), and on the plain grid 5-8% faster than
      the persistent default from 2048 to 16384 keys (s29), where the
      benchmark's 20 ms rounds had it level or up to 4% slower: the H200
      default at 256 for non-causal calls from 1025 keys since s29.  The
      interpreter runs it (cluster indexing, the persistent grid's pairs
      of groups), but not its cross-CTA synchronisation: with the
      cluster barriers replaced by per-CTA ones it still passes (s28),
      so that part is covered by the ``gpu`` tests only.
    prefetch_q: with ``persistent``, the producer loads the next work
      item's Q (one copy per consumer) as soon as both consumers finished
      their ``Q K^T`` of the current one, and the output leaves through
      its own shared-memory slots (64-column chunks, two slots per
      consumer, as tokamax's persistent sm90 kernel), so the next Q's load
      overlaps this item's epilogue instead of following it.  Without
      ``persistent`` (the per-call rule of tuning.json turns that on)
      there is no next item and the option does nothing.  The forward
      then reserves no cross-warp reduction scratch (its reductions are
      along the rows of wgmma tiles, within a warp), which keeps head_dim
      256 inside shared memory.
    rescale_threshold: FlashAttention-4's conditional rescaling (arXiv
      2603.05451): each row's reference max in the forward's online
      softmax, against which ``P``, the row sum and ``O`` are kept, moves
      only when the row's max exceeds it by more than
      ``2^rescale_threshold`` (an integer, in powers of two; 0: every
      step, the exact FlashAttention-2 update).  ``P`` then runs up to
      ``2^threshold`` (exact in float32 and in ``P``'s 16-bit format,
      hence at most 8) and the final ``O / l`` and the LSE are the same
      for any reference.  Where the reference stays, ``alpha`` is 1 and
      on the GPU each warp skips its rescale of ``O`` (a branch,
      :func:`jaxflash.mosaic_gpu.forward.rescale_rows`): one FMUL per
      accumulator element, the step's largest instruction class (130
      FMULs per thread per step at head_dim 256, against 34
      exponentials; PTX of the compiled loop and ncu's opcode counts,
      s28).  Written (s29) because the H200 forward is power-bound under
      sustained load and cuDNN's d256 forward executes 24% fewer
      instructions than ours.  The H200 default at head_dim 256 with
      ``deferred_row_sum`` (s31: 1.08-1.13x of the best anchor under
      sustained load, 1.16-1.20x in rounds, non-causal; the old default
      was level; docs/benchmarks/h200-2026-12-05-s31.md); at head_dim
      128 on causal calls up to 8192 keys and non-causal calls of
      1025-2048 keys (tuning.json's kv_rules; s35: +0.6-2.6% causal in
      rounds, +1.6% non-causal 2048 sustained, -2% non-causal at 1024
      and -1-3% from 8192; docs/benchmarks/h200-2026-12-05-s35.md).  The
      interpreter runs the
      threshold with the unconditional multiply (bit-identical: a
      multiply by 1), so only the branch is covered by the ``gpu`` tests
      alone.
    deferred_row_sum: the online softmax's row sum ``l`` kept per thread,
      over the thread's own columns of each row, and added across the 4
      lanes that share a row once after the tile loop instead of every
      step (FlashAttention-3's order: hopper/softmax.h sums without the
      warp reduction per step and runs ``quad_allreduce_`` in
      ``finalize``; :func:`jaxflash.mosaic_gpu.forward.row_sum`).  Saves
      2 shuffles and 2 adds per row and step (4 + 4 per thread; the main
      loop's count in ``tools/sass_loops.py``).  Inline Mosaic GPU: the
      interpreter runs the per-step sum, so only the ``gpu`` tests cover
      it.  Written in s30; the H200 default at head_dim 256 (s31), and
      with ``rescale_threshold`` at 128 (s35).
    early_q_release: with ``intra_wg_overlap`` and ``prefetch_q`` on the
      persistent grid, a consumer signals "done with Q" as soon as its
      last ``Q K^T`` has been read back, before the last tile's ``P V``
      turn, instead of after it, and the producer loads the next item's
      Q before that item's first K/V tiles (before, Q also waited for the
      last V slot, freed only by the last ``P V``).  Written because ncu
      measured the item-start waits at 4.3-6.4% of the stall samples in
      the short non-causal forwards, against tokamax's 0.8-1.7%
      (docs/benchmarks/h200-2026-12-03-s24.md).  On the H200: +2.2% at
      head_dim 128 with 1024 keys, level at 128 with 2048 and at 256
      with 4096, and that share unchanged
      (docs/benchmarks/h200-2026-12-04-s25.md); the default on those
      calls.  Without ``prefetch_q`` on a persistent call it does
      nothing.
    q_double_buffer: with ``prefetch_q`` on the persistent grid, two Q
      buffers per consumer, used by alternate work items: the producer
      loads an item's Q as soon as it starts that item's loads (the
      buffer was last read two items ago), ahead of the item's first K/V
      tiles, instead of waiting for the consumers to be done with the
      previous item's Q.  Q then lands about two ring steps before the
      item starts, and the next item's first K/V loads no longer queue
      behind that wait (with ``early_q_release`` they do, without it Q
      queues behind the last slot's release).  tokamax's Q warp waits
      for its consumers as our producer does; FlashAttention-3 keeps one
      Q buffer too.  Costs a second Q tile per consumer in shared memory
      (at head_dim 128 with 128-key tiles and two stages: 226 of 227
      KiB; head_dim 256 does not fit).  Not with ``persistent_pairs`` on
      causal calls (their skipped items would break the alternation;
      shared memory is still counted).  Written in s33 (no GPU that
      session) for the item-start waits; the interpreter runs it with
      race detection.  Timed first in s36 (the H100 runs of s33/s34 had
      built the default's kernel): on the H200 +6.3% in 20 ms rounds and
      +4.5% sustained at head_dim 64 non-causal with 1024 keys, level at
      2048, so the H200 default there up to 1024 keys (tuning.json);
      with ``item_overlap`` at 1025-2048 keys since s38 (see there).
      With ``prefetch_q`` on head_dim 64's persistent causal grid (s37,
      an H100): +4.0% in rounds and +1.7% sustained at 1024 keys (where
      ``prefetch_q`` alone loses 3%), +1.4% / -0.5% at 2048, level at
      4096; so both are the H200 default on causal calls of at most 1024
      keys too.
    item_overlap: with ``intra_wg_overlap``, two consumers and
      ``prefetch_q`` (with ``early_q_release`` or ``q_double_buffer``) on
      the persistent grid, the overlapped loop runs on across a
      program's work items.  An item's last turn on the tensor cores
      issues its last ``P V`` and the next item's first ``Q K^T`` back
      to back; the item's epilogue (normalise, store O and the LSE) runs
      while that ``Q K^T`` computes; the ping-pong keeps one alternation
      over all the program's items.  (FlashAttention-3's persistent
      kernel overlaps one tile's epilogue with the next tile's matmuls,
      arXiv 2407.08608 §3.1.)  Before, each item ended with its last
      ``P V`` waited for alone, the other consumer's last turn, the
      epilogue, and only then the next item's first ``Q K^T``.  Applies
      to calls where both consumers compute every key tile of every
      item: no causal mask, window or segment ids, and no consumer whose
      query rows are all padding; others run as without it.  With one Q
      buffer the last turn issues its ``P V`` and then waits for the
      next Q to land (loaded after both consumers' "done with Q"),
      holding the turn and the epilogue behind it; with
      ``q_double_buffer`` that Q is there long before.  Written in s33 (no
      GPU that session) for the per-item cost at head_dim 128 with 2048
      keys (an item takes 29-31 us against 22.5 us of matmul, s32); the
      interpreter runs its mbarrier form with race detection, the
      named-barrier form runs only on the GPU.
      Untimed: the H100 runs of s33/s34 set it on the H100's then untuned
      config (no persistent grid), where it builds the default's
      kernel.
      Without ``intra_wg_overlap`` (s36, any consumer count) the default
      loop runs on across the items the same way: the last step's turn
      issues its ``P V`` and the next item's first ``Q K^T``, the epilogue
      runs under them, and the other consumer's last ``P V`` (which waits
      for that ``Q K^T``) overlaps this epilogue instead of both
      consumers' epilogues leaving the tensor cores idle together.  "Done
      with Q" is
      signalled once the item's last ``S`` is read back.  For head_dim
      64's short items, where the per-item cost is (a two-point fit to
      the s35 grid at 1024 and 2048 keys: 2.0 us per item against
      tokamax's 0.5, docs/backends.md).  The interpreter runs it
      (mbarrier ping-pong, one, two and three consumers, one and two Q
      buffers) with race detection; on the
      CPU's ptxas (sm_90a) it has no spill at head_dim 64 (main loop 435
      instructions per trip, 429 with two Q buffers, against 426) and
      460/584 bytes at 256.  On the H200 (s36): its GPU tests pass;
      +4.8% at head_dim 64 with 1024 keys, -1-2% at 2048, below
      ``q_double_buffer`` alone (+6.3%).  With ``q_double_buffer`` at
      2048 keys: +2.3% in rounds and +0.4% sustained on the H200 (s36),
      +2.6% / +1.2% on an H100 (s38), so both are the H200 default on
      head_dim 64 non-causal calls of 1025-2048 keys (tuning.json).
    lean_epilogue: the forward's epilogue as tokamax's sm90 kernel's:
      normalise with one reciprocal per row and a multiply per element
      (instead of a divide per element), store the output in 64-column
      chunks through two slots of its own per consumer (``prefetch_q``'s
      form, also without ``persistent``), each chunk's TMA copy issued
      as soon as it is written, and end each work item waiting only
      until the stores have read shared memory, not until they reached
      global memory (kernel completion publishes them).  At head_dim 256
      the slots fit only without the reduction scratch (as
      ``prefetch_q``).  Written to time the head_dim 256 gap to
      tokamax: no faster on the H200 at 8192 and 16384 keys
      (docs/benchmarks/h200-2026-12-01-lean-epilogue.md), but +2-5% on
      the plain grid at head_dim 256 with 2048 non-causal keys in three
      runs, where it became the H200 default (1025-2048 keys;
      docs/benchmarks/h200-2026-12-03-s22.md; from 1025 keys with
      ``kv_multicast`` since s29).  With the overlap
      (``intra_wg_overlap``) it is also the H200 default on causal
      calls at head_dim 256 (+3.5-6.5% at 1024-8192 keys, level at
      16384) and on non-causal calls below 8192 keys at 128 (+0.5-2% at
      2048, +2-3.3% at 4096, level at 1024 over two sessions' runs;
      docs/benchmarks/h200-2026-12-03-s23.md).
      From 8192 keys at 128 the default's 176-key tiles leave no room
      for its output slots (247,808 bytes of shared memory against
      232,448; ``head_dim_problem`` refuses it).
    unpadded_kv: the forward reads K and V unpadded: the last key tile's
      rows past the keys are zero-filled by the TMA copy (which skips
      out-of-bounds reads) instead of by an XLA pad, which copies K and V
      whenever the key length is not a multiple of ``block_kv`` (with
      80- or 176-key tiles, at every power-of-two length: on the H200
      the unpadded forms ran 2-21% faster than the padded ones).  The
      padded keys are masked either way (``MaskSpec.kv_block_range`` ends
      the unmasked tiles at the last whole one).  K and V are still
      padded to a multiple of 8 rows where 8 does not divide the key
      length: Mosaic GPU tiles the global side of a swizzled TMA copy by
      8 rows.  GPU only: the interpreter's slices clamp at the end of
      the array.  The H200 default at every head_dim (it changed nothing
      measurable where no pad was needed).
    unpadded_q: the forward reads Q and writes O unpadded (to a multiple
      of 8 rows, as ``unpadded_kv``): the last query group's rows past
      the queries are zero-filled by the TMA copy of Q and dropped by
      the TMA store of O, instead of an XLA pad of Q and a slice of O.
      Those copies happen wherever ``compute_wgs * block_q`` does not
      divide the query length: with three consumers (192-row groups) at
      every power-of-two length.  The log-sum-exp keeps its padded
      length.  GPU only (the interpreter's slices clamp).  The H200
      default at head_dim 64: forward +1.6/+4.5/+7.4% non-causal at
      16384/8192/4096 tokens, +3.3% causal at 16384 (one run,
      docs/benchmarks/h200-2026-12-03-s19.md).
    bwd_block_q, bwd_block_kv: tiles of the backward kernels (multiples of
      64).  The dK/dV kernel gives each consumer warpgroup ``bwd_block_kv``
      key rows and streams ``bwd_block_q`` query rows (``bwd_dkv_block_q``
      where set); the dQ kernel gives
      each ``bwd_block_q`` query rows and streams ``bwd_block_kv`` keys.
      ``p_in_smem`` applies to them too (``P`` and ``dS`` are the
      register operands there).
    bwd_dkv_block_q: the query rows per step of the dK/dV kernel (None:
      ``bwd_block_q``), a multiple of 16 from 64 to 256 (of 64 with
      ``bwd_atomic_dq``, whose ``dS K`` takes them as wgmma's M):
      FlashAttention-3's 80 at head_dim 128 without a causal mask
      (hopper/tile_size.h).  The query rows are that kernel's wgmma N
      (``S^T = K Q^T``) and the contraction of ``dV += P^T dO`` and
      ``dK += dS^T Q``, so any multiple of 16 serves; a width that is
      not a multiple of 64 puts the Q and dO rings in the widest swizzle
      that divides it (``pipeline.tiled_over``, as the forward's V).
      The dQ kernel keeps ``bwd_block_q`` (its query rows are wgmma's
      M).  The last step may run past the padded queries: the TMA copies
      zero-fill Q, dO, the log-sum-exp and delta there (rows with ``dO =
      0`` and ``Q = 0`` add nothing), the segment ids are padded to whole
      steps, and the interpreter, whose slices clamp, pads the queries
      to a multiple of both tiles.  Not with ``bwd_paired_dkv`` (not
      written).
    bwd_stages: depth of the backward kernels' shared-memory rings.
    bwd_compute_wgs: consumer warpgroups of the backward kernels (1 or 2).
    bwd_split_dkv: compute dV and dK in two passes of the dK/dV kernel,
      each holding one float32 accumulator instead of two (one more
      ``K Q^T`` per tile pair, and Q/dO/LSE streamed twice).  The Hopper
      backward serves padded head_dim > 128 only with it (two 64 x 256
      float32 accumulators do not fit in a warpgroup's registers; without
      it the gradient runs the Triton kernels there), and at head_dim 256
      only with ``bwd_compute_wgs=1`` (two consumers' K and V exceed
      shared memory; ``check_supported`` refuses such a config).  The
      H200 default at head_dim 256 (fwd+bwd twice as fast as the Triton
      backward there).
    bwd_paired_dkv: compute dK and dV in one pass of a kernel with two
      consumers on one ``bwd_block_kv`` key tile: consumer 0 accumulates
      dV from ``S^T = K Q^T``, consumer 1 dK from ``dP^T = V dO^T``, and
      consumer 0 hands ``P^T`` to consumer 1 in shared memory (one
      buffer per ring slot).  One float32 accumulator per warpgroup as
      with ``bwd_split_dkv``, but 4 matmuls per tile pair instead of 5
      and Q/dO streamed once, with the two consumers' work interleaved
      on the tensor cores.  Serves any padded head_dim the Hopper
      backward does, and head_dim 256 (the dQ kernel keeps
      ``bwd_compute_wgs`` unless ``bwd_paired_dq``).  Not with
      ``bwd_split_dkv`` or ``bwd_atomic_dq``.
    bwd_paired_dq: compute dQ with two consumers on one ``bwd_block_q``
      query tile: consumer 0 holds Q and computes ``S = Q K^T`` and ``P``,
      which it hands to consumer 1 in shared memory (one buffer per ring
      slot); consumer 1 holds dO and computes ``dP = dO V^T``, ``dS`` and
      ``dQ += dS K``.  The dQ kernel's 3 matmuls per tile pair, with
      consumer 0's ``Q K^T`` and exponentials overlapping consumer 1's
      matmuls, and Q and dO held once each: at head_dim 256, where two
      consumers of the dQ kernel do not fit in shared memory, it replaces
      the one-consumer dQ kernel (``bwd_compute_wgs`` then only shapes the
      dK/dV kernel).  The tuned default at padded head_dim 192/256 (H200,
      d256 s8192 causal: dQ 1.38 ms against 1.61, fwd+bwd 1.17-1.41x
      cuDNN at s1024-16384); at 128 it loses to the two-consumer dQ
      kernel, which holds twice the query rows per program (3.45 ms
      against 2.25-2.44; docs/benchmarks/h200-2026-12-01-paired-dq.md).
      Not with ``bwd_atomic_dq`` (no dQ kernel) or
      ``bwd_dq_late_release``.
    bwd_named_barriers: the backward kernels' "slot consumed" signals on
      hardware named barriers, as ``named_barriers`` for the forward
      (``bwd_stages <= 12``; GPU only).
    bwd_consumer_registers: registers per thread of each of the backward
      kernels' two consumer warpgroups (``setmaxnreg``; the producer keeps
      what is left of the launch allocation, at most 40:
      ``producer_registers``).  232 (tokamax's split, producer
      40) by default; 240 is FlashAttention-3's (producer 24), the tuned
      default at padded head_dim 128 with ``bwd_stats_in_acc`` (H200,
      fwd+bwd +0.9-1.7% at s8192/16384 non-causal; before that option
      removed the d128 kernel's spills it measured within noise).
    bwd_atomic_dq: accumulate dQ in the dK/dV kernel instead of a dQ
      kernel: each tile's ``dS K`` (float32, through shared memory) is
      added into a zeroed float32 buffer in global memory by a TMA
      reduce-add (``cp.reduce.async.bulk``), FlashAttention-3's scheme.
      5 matmuls per tile pair instead of 7 (the dQ kernel recomputes
      ``S`` and ``dP``), but the order of the float32 additions varies
      from run to run, so gradients are not bitwise reproducible.  The
      H200 default at padded head_dim 64 (fwd+bwd +1-9%; it loses 8-16%
      at 128), turned off by ``flash_attention(deterministic=True)``.
      Needs dK and dV in one pass (padded head_dim <= 128,
      ``bwd_split_dkv=False``) and a GPU (the Mosaic GPU interpreter has
      no TMA reduction).
    bwd_shared_dq: with ``bwd_atomic_dq`` and two consumers, share each
      tile pair's dQ between them as FlashAttention-3 does: both stage
      their ``dS^T`` in shared memory (double-buffered, a barrier says
      both are written), and consumer ``w`` computes head_dim columns
      ``[w * D/2, (w + 1) * D/2)`` of ``dS K`` over both consumers' keys.
      Against one full-width ``dS K`` per consumer: half the float32 dQ
      registers (the suspected cause of atomic dQ's loss at head_dim 128)
      and half the reduce-add traffic to global memory.  Needs a padded
      head_dim that is a multiple of 128 (a half of 64 columns is one
      swizzled tile; with dK and dV in one pass that is 128 exactly).
      Not a default: see docs/perf-notes.md.
    bwd_dq_halves: with ``bwd_atomic_dq`` (per consumer, not shared), compute
      each tile pair's ``dS K`` in two head_dim halves one after the other
      (one ``bwd_block_q`` x D/2 float32 accumulator live instead of
      ``bwd_block_q`` x D), staged
      into the same float32 tile and reduce-added once.  The control
      experiment for ``bwd_shared_dq``: its register saving without its
      traffic saving or its barrier between consumers.  Needs padded
      head_dim 128.
    bwd_dq_late_release: in the dQ kernel, leave each step's ``dQ += dS
      K`` wgmma in flight into the next step instead of waiting for it
      at once: the next step's ``S`` and ``dP`` wgmmas queue behind it
      (no drain of the tensor-core pipeline between steps), and the K/V
      slot it reads is released once ``wgmma.wait_group 2`` after those
      two says it has finished (CUTLASS's ``warpgroup_wait<N>`` before
      releasing the previous stage, as in FlashAttention-3's mainloops).
      Reading ``S`` and ``dP`` then waits for all three, so what overlaps
      the previous ``dS K`` is this step's wait for its tile and the
      issue of its two wgmmas.  Not with ``bwd_atomic_dq`` (no dQ
      kernel); at padded head_dim > 128 it needs ``bwd_split_dkv`` (the
      Hopper backward) to have an effect.
      Written for the one-consumer dQ kernel at head_dim 256 (508 TFLOP/s
      causal at s8192 against 664-739 for the dK and dV passes,
      tools/kernel_times.py); not a default: 2-9% slower on the H200
      (docs/benchmarks/h200-2026-12-01-dq-late-release.md).
    bwd_softmax_overlap: FlashAttention-3's order inside a step of the
      dK/dV and dQ kernels (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp;
      the intra-warpgroup overlap of arXiv 2407.08608 §3.2 applied to the
      backward): after issuing the ``S`` and ``dP`` wgmmas, wait for
      ``S``'s alone (``wgmma.wait_group 1``) and compute ``P``'s
      exponentials while ``dP``'s still runs; in the dK/dV kernel, issue
      ``dV += P^T dO`` before computing ``dS``, so ``dS``'s arithmetic
      runs under that matmul.  The default waits for both products, then
      computes ``P`` and ``dS``, then issues the second matmuls.  The
      paired kernels (``bwd_paired_dkv``, ``bwd_paired_dq``) have one
      product per consumer before the softmax and are unchanged.  With
      ``p_in_smem`` (the interpreter's form) ``dS`` still waits for dV's
      matmul, which reads the staging buffer ``dS`` reuses.  The tuned
      default at padded head_dim 128 (H200, s8192 non-causal: dQ kernel
      2.458 -> 2.178 ms, dK/dV 3.709 -> 3.649; fwd+bwd +1-4% at 7 of 8
      shapes, s2048-16384); at 64 it loses 2-4% with atomic dQ and with
      the dQ kernel alike
      (docs/benchmarks/h200-2026-12-02-softmax-overlap.md).
    bwd_stats_in_acc: in the dK/dV kernel, start each tile's ``S^T`` and
      ``dP^T`` accumulators at ``-lse2 / (scale log2 e)`` and ``-delta``
      per query (a store into the wgmma accumulator) instead of at zero,
      so that the tensor cores' float32 additions subtract the per-query
      statistics: ``P^T = exp2(acc * scale log2 e)`` and ``dS^T = P^T
      acc``.  In the transposed tile a per-query vector is one value per
      column a thread holds, 16 registers per thread each at
      ``bwd_block_q=64``; folded, they are dead before the wgmmas are
      issued instead of live through the softmax, where the d128 kernel
      spilled (ncu, d128 s8192: spill stores and reloads every step, and
      the wait for the LSE load between ``S``'s wgmma and ``P``).  The
      tuned default at padded head_dim 128 (H200, s8192 non-causal: dK/dV
      kernel 3.61 -> 3.30 ms, ptxas spills 40 / 64 bytes -> none; fwd+bwd
      +2-6% at 9 of 10 shapes, s1024-16384); at 64 (no spills) -1..+2%
      (docs/benchmarks/h200-2026-12-02-stats-in-acc.md).  Under a soft
      cap only ``delta`` is folded (``P`` takes ``tanh`` of the raw
      product).  GPU only: the Mosaic GPU interpreter does not run stores
      into an accumulator.  The paired kernels (``bwd_paired_dkv``,
      ``bwd_paired_dq``) and the dQ kernel (whose per-query vectors are
      one value per row, 2 registers, held for the whole loop) are
      unchanged.
    bwd_stats_first: with ``bwd_stats_in_acc``, store both starting
      values before the first of the two wgmmas (``S^T``'s, then
      ``dP^T``'s) instead of ``dP^T``'s between them.  ncu's SASS of the
      d128 dK/dV kernel (H200, 2026-12-02,
      docs/benchmarks/h200-2026-12-02-d64-bq128.md) shows ptxas waiting
      for ``S^T``'s wgmma to complete before it issues ``dP^T``'s when
      the ``-delta`` stores come between them (9.0% of the stall samples
      on that wait), where with zero-started accumulators the two were
      issued back to back.  Measured a loss (H200, s8192 non-causal:
      d128 dK/dV kernel 3.35 against 3.27 ms, d64's 128-query form 6.60
      against 6.55; docs/benchmarks/h200-2026-12-02-early-dv.md), so not
      a default.  GPU only, as its parent.
    bwd_delta_in_regs: with ``bwd_stats_in_acc``, fold only the
      log-sum-exp into ``S^T``'s starting value; ``dP^T`` starts at zero
      and ``delta`` is subtracted in registers as without the option.
      The ``-delta`` starting tile is built between the two wgmmas, and
      ptxas then waits for ``S^T``'s before issuing ``dP^T``'s (its C7517
      note on the d128 and d64 dK/dV kernels: tools/ptxas_cpu.py); folded
      before both instead (``bwd_stats_first``) it ran 2% slower.  With
      this option ptxas reports neither the wait nor spills at head_dim
      128 (CPU compile), yet on the H200 the dK/dV kernel ran 8% slower
      (d128 s8192 non-causal: 3.39 against 3.13 ms, ``kernel_times``,
      docs/benchmarks/h200-2026-12-03-s21.md), so not a default.  GPU
      only, as its parent.
    bwd_dkv_late_release: the same for the dK/dV kernel (and its split
      passes): each step's last wgmma (``dK += dS^T Q``, or the pass's
      only accumulator's) is left in flight into the next step, whose
      ``S^T`` and ``dP^T`` wgmmas queue behind it, and the Q/dO slot it
      reads is released after ``wgmma.wait_group 2`` there (the last
      computed step's at the end of the tile loop).  The end-of-step wait
      for dK's wgmma was 10.4% of the d128 kernel's stall samples (ncu,
      2026-12-02).  A slot is then released a step later than before,
      so the producer refills it one step later: with two stages a
      step's tile is loaded while the step before it runs, with three
      one step earlier.  Measured a loss (H200, d128 s8192, dK/dV kernel
      3.47 ms against 3.14 non-causal, 2.14 against 1.68 causal; 3.40 and
      2.08 with 3 stages): ptxas injects ``warpgroup.wait`` for the
      in-flight wgmma's registers (C7517, at two places instead of one;
      docs/benchmarks/h200-2026-12-02-s17.md), so not a default.  Not
      with ``bwd_atomic_dq`` or ``bwd_paired_dkv``.
    bwd_early_dv: with ``bwd_softmax_overlap``, issue ``dV += P^T dO`` as
      soon as ``P^T`` is computed, queued behind ``dP^T``'s wgmma, and
      then wait for ``dP^T`` alone (``wait_n=1``), instead of waiting for
      ``dP^T`` before issuing dV's (8.4% of the d128 kernel's stall
      samples are on that wait).  Kernels that compute both dK and dV
      only.  The tuned default at padded head_dim 128 (H200: dK/dV
      kernel 3.27 -> 3.17 ms at s8192 non-causal; fwd+bwd +0.2-3.2% at
      every shape, s1024-16384, causal and not); at 64 it loses with the
      overlapped order's other costs
      (docs/benchmarks/h200-2026-12-02-early-dv.md).
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
  bwd_split_dkv: bool = False
  bwd_paired_dkv: bool = False
  bwd_paired_dq: bool = False
  bwd_named_barriers: bool = False
  bwd_consumer_registers: int = 232
  bwd_atomic_dq: bool = False
  bwd_shared_dq: bool = False
  bwd_dq_halves: bool = False
  bwd_dq_late_release: bool = False
  bwd_dkv_late_release: bool = False
  bwd_softmax_overlap: bool = False
  bwd_stats_in_acc: bool = False
  bwd_stats_first: bool = False
  bwd_delta_in_regs: bool = False
  bwd_early_dv: bool = False

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
    if self.bwd_named_barriers and self.bwd_stages > FREE_NAMED_BARRIERS:
      raise ValueError(
          "bwd_named_barriers=True takes one of the"
          f" {FREE_NAMED_BARRIERS} free hardware barriers per stage:"
          f" bwd_stages <= {FREE_NAMED_BARRIERS}, got"
          f" bwd_stages={self.bwd_stages}")
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
    if self.bwd_shared_dq and not (self.bwd_atomic_dq
                                   and self.bwd_compute_wgs == 2):
      raise ValueError(
          "bwd_shared_dq=True shares the atomic dQ between two consumers:"
          " it needs bwd_atomic_dq=True and bwd_compute_wgs=2, got"
          f" bwd_atomic_dq={self.bwd_atomic_dq},"
          f" bwd_compute_wgs={self.bwd_compute_wgs}")
    for option, parent in (("bwd_stats_first", "bwd_stats_in_acc"),
                           ("bwd_delta_in_regs", "bwd_stats_in_acc"),
                           ("bwd_early_dv", "bwd_softmax_overlap"),
                           ("early_q_release", "intra_wg_overlap")):
      if getattr(self, option) and not getattr(self, parent):
        raise ValueError(f"{option}=True changes the order of"
                         f" {parent}=True: it needs {parent}=True (got"
                         f" {parent}=False)")
    if self.bwd_dq_halves and not (self.bwd_atomic_dq
                                   and not self.bwd_shared_dq):
      raise ValueError(
          "bwd_dq_halves=True splits the per-consumer atomic dQ: it needs"
          " bwd_atomic_dq=True and bwd_shared_dq=False, got"
          f" bwd_atomic_dq={self.bwd_atomic_dq},"
          f" bwd_shared_dq={self.bwd_shared_dq}")

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

  def out_chunks(self, head_dim_padded: int) -> tuple[int, int]:
    """The output's staging with :attr:`out_slots`: (64-column chunks,
    slots)."""
    chunks = -(-head_dim_padded // 64)
    return chunks, min(2, chunks)

  def _fwd_buffers(self, head_dim_padded: int, itemsize: int) -> list[int]:
    qo = self.compute_wgs * self.block_q * head_dim_padded * itemsize
    if self.prefetches_q and self.q_double_buffer:
      qo *= 2
    kv = self.stages * self.block_kv * head_dim_padded * itemsize
    buffers = [qo, kv, kv, self.compute_wgs * self.block_q * 4]
    if self.p_in_smem:
      buffers.append(self.compute_wgs * self.block_q * self.block_kv
                     * itemsize)
    if self.out_slots:  # the output's chunks
      _, slots = self.out_chunks(head_dim_padded)
      buffers.append(self.compute_wgs * slots * self.block_q * 64
                     * itemsize)
    return buffers

  def fwd_reduction_scratch(self, head_dim_padded: int,
                            itemsize: int = 2) -> int | None:
    """``CompilerParams.reduction_scratch_bytes`` of the forward: None
    (Pallas' 2 KiB) where the buffers fit beside it, else 0.  The forward
    needs none (its reductions run along wgmma rows, within a warp; the
    lowering fails if one needed scratch), so configs just over the limit
    (``prefetch_q`` at head_dim 256, block_kv 192 at 128) drop it.
    ``prefetch_q`` always runs without it (as measured)."""
    buffers = self._fwd_buffers(head_dim_padded, itemsize)
    with_scratch = sum(buffers) + _reserved(len(buffers))
    if self.prefetches_q or with_scratch > SMEM_LIMIT:
      return 0
    return None

  def smem_bytes(self, head_dim_padded: int, itemsize: int = 2) -> int:
    """Shared memory the forward kernel allocates."""
    buffers = self._fwd_buffers(head_dim_padded, itemsize)
    if self.fwd_reduction_scratch(head_dim_padded, itemsize) == 0:
      # Exact: Pallas rounds each buffer up to 1 KiB; the barriers take
      # well under 1 KiB (checked against the compiler in test_lowering).
      return sum(-(-b // 1024) * 1024 for b in buffers) + 1024
    # With the reduction scratch: the conservative count (up to 1 KiB of
    # alignment per buffer), checked against the compiler the same way.
    return sum(buffers) + _reserved(len(buffers))

  def bwd_smem_bytes(self, head_dim_padded: int, itemsize: int = 2) -> int:
    """Shared memory of the larger of the two backward kernels."""
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
    if self.bwd_shared_dq:
      # Both consumers' dS^T, double-buffered, and a float32 half-width
      # dQ tile per consumer.
      dkv += 2 * n * bk * sq * itemsize + n * sq * head_dim_padded // 2 * 4
      return dkv + _reserved(dkv_buffers + 3)
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
          + self.bwd_stages * 2 * bk * head_dim_padded * itemsize + a_op)
    dq_buffers = 4 + self.p_in_smem
    if self.bwd_paired_dq:
      # One Q and one dO tile, the K/V ring, one P hand-over per slot and,
      # with p_in_smem, consumer 1's staged dS.
      dq = (2 * bq * head_dim_padded * itemsize
            + self.bwd_stages * (2 * bk * head_dim_padded + bq * bk)
            * itemsize + (bq * bk * itemsize if self.p_in_smem else 0))
      dq_buffers = 5 + self.p_in_smem
    return max(dkv + _reserved(dkv_buffers), dq + _reserved(dq_buffers))


def split_dq_problem(config: "MosaicConfig", head_dim_padded: int
                     ) -> str | None:
  """Why ``bwd_shared_dq`` / ``bwd_dq_halves`` cannot serve this padded
  head_dim (None when they can or are off): they split ``dS K`` into two
  halves of whole 64-column swizzled tiles."""
  if (config.bwd_shared_dq or config.bwd_dq_halves) and head_dim_padded % 128:
    return ("bwd_shared_dq / bwd_dq_halves split dQ into two halves of whole"
            " 64-column swizzled tiles: they need a padded head_dim that is"
            f" a multiple of 128, got {head_dim_padded}")
  return None


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
  the dQ split, three consumers' registers), None when it can: the one
  check of the backend (``NotImplementedError``), of the tuned defaults
  and of the GPU tests' config list."""
  need = needed_smem_bytes(config, head_dim_padded)
  if need > SMEM_LIMIT:
    return (f"{config} needs {need} bytes of shared memory at head_dim"
            f" {head_dim_padded} (limit {SMEM_LIMIT})")
  why = split_dq_problem(config, head_dim_padded)
  if why:
    return why
  if config.bwd_atomic_dq and head_dim_padded > MAX_BWD_HEAD_DIM:
    # Above 128 the Hopper backward runs only as bwd_split_dkv or
    # bwd_paired_dkv, neither of which takes the atomic dQ: refused here
    # rather than served silently by the Triton backward.
    return (f"bwd_atomic_dq (and bwd_shared_dq / bwd_dq_halves) serve"
            f" padded head_dim up to {MAX_BWD_HEAD_DIM}, got"
            f" {head_dim_padded}")
  if config.compute_wgs == 3 and head_dim_padded > MAX_THREE_WG_HEAD_DIM:
    return (f"compute_wgs=3 serves padded head_dim up to"
            f" {MAX_THREE_WG_HEAD_DIM}, got {head_dim_padded}: three"
            f" consumers' {config.block_q} x {head_dim_padded} float32"
            " output accumulators do not fit the launch's"
            f" {launch_registers(4)} registers per thread")
  return None


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
  """``"shared0:bwd_shared_dq=0;dqk:bwd_atomic_dq=0"`` -> ``{"shared0":
  {"bwd_shared_dq": False}, "dqk": {...}}``: named override sets
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


def needed_smem_bytes(config: "MosaicConfig", head_dim_padded: int) -> int:
  """Shared memory of the largest kernel a call with this config runs
  (the forward, and the Hopper backward where it serves the head_dim)."""
  need = config.smem_bytes(head_dim_padded)
  if (head_dim_padded <= MAX_BWD_HEAD_DIM or config.bwd_split_dkv
      or config.bwd_paired_dkv):
    need = max(need, config.bwd_smem_bytes(head_dim_padded))
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
# backward needs ``bwd_split_dkv`` or falls back to the Triton kernels.
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


@functools.cache
def _entries(device_kind: str | None) -> dict:
  """tuning.json's entry for this device kind: its own, the one its alias
  names (the H100 SXM runs the H200's: 1.05-1.30x of the default entry's
  forward on an H100, s35), else ``default``; with the kind's own
  ``kind_kv_rules`` after each head_dim's ``kv_rules`` (none since s40:
  the H100 SXM's head_dim 64 rules of s39 became the H200 entry's when
  the H200 measured the same gains)."""
  tuning = _tuning()
  kind = tuning.get("aliases", {}).get(device_kind, device_kind)
  entries = tuning["devices"].get(kind or "", tuning["devices"]["default"])
  extra = tuning.get("kind_kv_rules", {}).get(device_kind or "", {})
  return {dim: ({**fields, "kv_rules": [*fields.get("kv_rules", []),
                                        *extra[dim]]}
                if dim in extra else fields)
          for dim, fields in entries.items()}


def check_tuning(tuning: dict) -> None:
  """ValueError, naming the place and the offending value, where
  tuning.json's rules are malformed: each ``kv_rules`` and
  ``kind_kv_rules`` item must be ``{"causal": bool, "min_kv": int >= 0,
  "fields": {MosaicConfig field: value}}``; a ``kind_kv_rules`` kind
  must have an entry or an alias (a misspelt kind would be ignored), and
  its head_dims must be in that entry."""
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
  aliases = tuning.get("aliases", {})
  for kind, dims in tuning.get("kind_kv_rules", {}).items():
    target = aliases.get(kind, kind)
    if target not in tuning["devices"]:
      raise ValueError(f"tuning.json kind_kv_rules: {kind!r} has no entry"
                       " and no alias")
    for dim, rules in dims.items():
      if dim not in tuning["devices"][target]:
        raise ValueError(f"tuning.json kind_kv_rules {kind!r}: head_dim"
                         f" {dim} has no entry in {target!r}")
      check(rules, f"kind_kv_rules {kind!r} {dim}")


def default_config(device_kind: str | None, head_dim_padded: int, *,
                   causal: bool = False, kv_len: int | None = None
                   ) -> MosaicConfig:
  """The tuned entry for this device kind and head_dim (nearest larger
  head_dim; the entry ``aliases`` names for an aliased kind; the
  ``default`` kind when the device is not listed).

  A field given as ``{"noncausal": ..., "causal": ...}`` takes the value
  of the call's setting (False where that setting is not given).

  An entry's ``persistent_max_kv`` rule turns on the persistent forward
  for calls with at most that many keys (per causal setting): measured on
  the H200, it pays where the key loop is short and the prologue and
  epilogue it overlaps are a large share of a program, and loses on
  causal calls at head_dim >= 128 (their longest-first order is lost)
  except with ``persistent_pairs``, which restores it: the H200 head_dim
  128 entry runs causal calls of up to 1024 keys persistent with pairs.

  An entry's ``kv_rules`` (a list of ``{"causal": bool, "min_kv": int,
  "fields": {...}}``) replace those fields for calls of that causal setting
  with at least ``min_kv`` keys (none applies where ``kv_len`` is not given),
  and then a device kind's own ``kind_kv_rules`` (none since s40). On the H200
  the head_dim 64 backward's 128-query tiles pay on every non-causal call and
  on causal calls from 4096 keys, the head_dim 64 forward's three consumers on
  every call from 1024 keys (and the persistent grid on every causal call),
  the forward's 176-key tiles at head_dim 128 on non-causal calls from 8192
  keys (without the intra-warpgroup overlap, which the head_dim 128 entry sets
  for the other calls), and the overlap at head_dim 256 on causal calls and on
  non-causal ones from 1025 keys (the persistent grid without it below), and
  at head_dim 256 the lean epilogue and ``kv_multicast`` on non-causal calls
  from 1025 keys (the plain grid); the lean epilogue on every causal call at
  256 and on non-causal calls below 8192 keys at 128; ``early_q_release`` on
  non-causal calls at head_dim 128 below 8192 keys (it acts only on the
  persistent ones, up to 2048 keys); and ``kv_multicast`` on non-causal calls
  of at most 1024 keys at 128; and at 128 ``rescale_threshold`` 8 with
  ``deferred_row_sum`` on causal calls up to 8192 keys and non-causal calls of
  1025-2048 keys; at 64 ``q_double_buffer`` on non-causal calls of at most
  2048 keys (with ``item_overlap`` from 1025), and with ``prefetch_q`` on
  causal calls of at most 1024 keys. Where the benchmark's 20 ms samples and
  sustained load (0.5-1 s samples, the card at its power cap) disagree, the
  rules follow sustained load (docs/benchmarks/h200-2026-12-04-s29.md).
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
