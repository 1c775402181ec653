"""Hopper forward kernel in Pallas Mosaic GPU (FlashAttention-3 structure).

One program per (head, query tile group, batch), or with ``persistent``
one per SM looping over those work items.  Warp specialisation
(arXiv 2407.08608 §3.1): a producer warpgroup streams K and V tiles with
TMA into a ``stages``-deep shared-memory ring, each slot completing on a
barrier; ``compute_wgs`` consumer warpgroups each own ``block_q`` query
rows, compute ``S = Q K^T`` and ``O += P V`` with ``wgmma`` into float32
register accumulators, and release each slot on a "consumed" barrier.
With two consumers a schedule barrier alternates their matmuls so one's
softmax overlaps the other's tensor-core work (ping-pong).

The online softmax (FlashAttention-2, arXiv 2307.08691 Algorithm 1) runs in
base 2 with the softmax scale folded into one multiplier.  Key tiles come
from :meth:`jaxflash.masks.MaskSpec.kv_block_range`: the producer loads the
union of the consumers' ranges; each consumer computes its own live tiles
(masked or fully visible) and only acknowledges the others ("skip" steps),
so every barrier phase is observed by every warpgroup.

Accumulators: ``S = Q K^T`` goes into a fresh scoped accumulator
(``pl.run_scoped(..., plgpu.ACC)``).  On the GPU, ``O`` is rescaled in
registers and ``P V`` accumulates into it in place
(``pl.run_state(...)(plgpu.ACC.init(acc))``, as FlashAttention-3 and JAX's
attention_mgpu); the Mosaic GPU interpreter rejects that idiom, so
interpreted runs write ``P V`` into a fresh scoped accumulator and add it
in registers (docs/backends.md lists what only the GPU tests cover).

Where things are, in the order of this module: the online softmax
(:func:`softmax_step`, :func:`rescale_rows`, :func:`row_sum`); the
operands (:class:`_Refs`); the schedule of work items, plain grid,
persistent grid and its pairs (:class:`_Schedule`); one work item on a
consumer (:class:`_Item`: the scores, the element mask in
:meth:`_Item.apply_mask` (a dense boolean mask's tiles in
:meth:`_Item.dense_visible`), the additive terms ALiBi
(:meth:`_Item.alibi_bias`) and the dense bias (:meth:`_Item.bias_tile`,
its tiles in a ring beside V's that the producer fills), attention
dropout (:meth:`_Item.dropped`), ``P V``, the epilogue); the main loops over
an item's key tiles (:func:`_plain_loop`, :func:`_overlapped_loop`,
:func:`_chained_loop`); the producer (:func:`_produce`); the kernel
(:func:`_kernel`); the launch (:func:`forward`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, nvvm, scf, vector

from jaxflash._util import out_struct, sm_count
from jaxflash.masks import MaskSpec
from jaxflash.mosaic_gpu import pipeline
from jaxflash.mosaic_gpu.config import MosaicConfig

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# ---------------------------------------------------------------------------
# The online softmax (FlashAttention, arXiv 2205.14135; FlashAttention-2,
# 2307.08691 Algorithm 1; FlashAttention-3, 2407.08608): per key tile the
# new row max, P against it, the rescale of the row sum and of O.


def rescale_rows(acc, alpha, *, skip_unmoved: bool):
  """``acc * alpha`` row by row (``alpha`` in the row layout of the wgmma
  accumulator ``acc``): the online softmax's rescale of ``O``.

  With ``skip_unmoved`` (on the GPU, with
  :attr:`MosaicConfig.rescale_threshold`) each thread multiplies its
  share of ``acc`` only where ``alpha`` is not exactly 1 in one of the
  rows its warp holds, a branch per warp (``vote.any`` over the lanes'
  rows; inline Mosaic GPU: Pallas has no per-thread or per-warp
  scalar).  Under the threshold a row's reference max rarely moves
  after its first tiles, so ``alpha`` is 1 in nearly every step
  and the branch skips the step's largest instruction class: one FMUL
  per accumulator element, 128 per thread per step at head_dim 256 and
  64 at 128 against 32 or 64 exponentials (the compiled loop's PTX;
  ncu's top opcode class at head_dim 256).  Multiplying by exactly 1
  changes no value, so both forms give bit-identical results; the
  interpreter runs the multiply."""
  if not skip_unmoved:
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
      return_type=plgpu.ShapeDtypeStruct(acc.shape, acc.dtype,
                                         layout=plgpu.Layout.WGMMA))
  def rescale_where_moved(_, acc, alpha):
    one = arith.constant(ir.F32Type.get(), 1.0)
    moved = None  # this thread's rows: is any alpha != 1?
    for reg in alpha.registers.flat:
      n = reg.type.shape[0] if isinstance(reg.type, ir.VectorType) else 0
      for x in ([vector.extract(reg, [], [i]) for i in range(n)] or [reg]):
        ne = arith.cmpf(arith.CmpFPredicate.UNE, x, one)
        moved = ne if moved is None else arith.ori(moved, ne)
    # One decision per warp (vote.any): a warp runs the multiplies
    # whenever one of its lanes needs them anyway, and the branch then
    # never splits a warp ahead of the next step's .sync.aligned wgmma.
    moved = nvvm.vote_sync(
        arith.constant(ir.IntegerType.get_signless(32), 0xFFFFFFFF),
        moved, "any")
    regs = acc.registers
    branch = scf.IfOp(moved, [r.type for r in regs.flat], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      scaled = acc * alpha.broadcast_in_dim(acc.shape, (0,), acc.layout)
      scf.yield_(list(scaled.registers.flat))
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(list(regs.flat))
    out = np.empty(regs.shape, dtype=object)
    out.flat[:] = list(branch.results)
    return mgpu.FragmentedArray(_registers=out, _layout=acc.layout,
                                _is_signed=acc.is_signed)

  return rescale_where_moved(acc, alpha)


def _thread_row_sums(p):
  """Each thread's sum of its own elements of every row of ``p`` (a
  Mosaic GPU ``FragmentedArray`` in the wgmma layout), in the row layout
  but not yet added across the lanes that share a row.  Mirrors the
  in-thread part of ``FragmentedArray.reduce`` (pairwise, for
  instruction-level parallelism) and stops before its lane shuffles."""
  layout = p.layout
  axis = 1 - (len(p.shape) - len(layout.base_tile_shape))  # tiled axis
  reduced = layout.tiling.tile_dimension(axis)
  if any(reduced[d] for d in layout.partitioned_warp_dims):
    raise NotImplementedError(f"rows of {layout} span warps")
  regs = p.registers
  red_shape = tuple(d if r else 1 for r, d in zip(reduced, regs.shape))
  out_shape = tuple(1 if r else d for r, d in zip(reduced, regs.shape))
  out = np.empty(out_shape, dtype=object)

  def tree_sum(xs):
    while len(xs) > 1:
      xs = [arith.addf(a, b) for a, b in zip(xs[::2], xs[1::2])] + (
          [xs[-1]] if len(xs) % 2 else [])
    return xs[0]

  for idx in np.ndindex(out_shape):
    acc = tree_sum([regs[tuple(i + j for i, j in zip(idx, r))]
                    for r in np.ndindex(red_shape)])
    if reduced[layout.vector_dim]:
      vec = ir.VectorType(acc.type)
      acc = vector.broadcast(
          ir.VectorType.get((1,), vec.element_type),
          tree_sum([vector.extract(acc, dynamic_position=[],
                                   static_position=ir.DenseI64ArrayAttr.get(
                                       [i])) for i in range(vec.shape[0])]))
    out[idx] = acc
  out_layout = layout.reduce((axis,))
  return mgpu.FragmentedArray(
      _registers=out.reshape(out_layout.registers_shape((p.shape[0],))),
      _layout=out_layout, _is_signed=None)


def row_sum(p, *, deferred: bool):
  """``p.sum(axis=1)`` for the online softmax's ``l``.

  With ``deferred`` (on the GPU, :attr:`MosaicConfig.deferred_row_sum`)
  each thread returns the sum of its own columns of each row only, and
  the lanes that share a row (4 in the wgmma layout) hold different
  partial sums until :func:`finish_row_sum` adds them once, after the
  tile loop: FlashAttention-3's order (hopper/softmax.h: ``reduce_sum``
  with ``warp_reduce=false`` per step, ``quad_allreduce_`` at the end).
  That saves two shuffles and two adds per row and step.  In between,
  ``l`` meets only elementwise operations (``l * alpha + rowsum``, with
  ``alpha`` equal across those lanes), so each lane's partial stays the
  sum of its own columns' terms.  Inline Mosaic GPU, which the
  interpreter does not run: there, the plain sum."""
  if not deferred:
    return p.sum(axis=1)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct((p.shape[0],), p.dtype,
                                         layout=plgpu.Layout.WGMMA.reduce(1)))
  def thread_sums(_, p):
    return _thread_row_sums(p)

  return thread_sums(p)


def finish_row_sum(l, *, deferred: bool):
  """``l`` made whole after :func:`row_sum` with ``deferred``: the partial
  sums of the lanes that share a row, added by two butterfly shuffles
  over the lane bits that the row layout replicates."""
  if not deferred:
    return l

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA.reduce(1),),
      return_type=plgpu.ShapeDtypeStruct(l.shape, l.dtype,
                                         layout=plgpu.Layout.WGMMA.reduce(1)))
  def quad_sum(_, l):
    last = l.layout.lane_dims[-1]  # the minor lane dim: lanes 4i .. 4i + 3
    if not isinstance(last, mgpu_fa.Replicated) or last.times != 4:
      raise NotImplementedError(f"row layout {l.layout}")
    regs = np.empty(l.registers.shape, dtype=object)
    for idx, r in np.ndenumerate(l.registers):
      for stride in (1, 2):
        r = arith.addf(r, mgpu_utils.shfl_bfly(r, stride))
      regs[idx] = r
    return mgpu.FragmentedArray(_registers=regs, _layout=l.layout,
                                _is_signed=None)

  return quad_sum(l)


def softmax_step(s, m, *, scale, threshold: int, masked: bool):
  """One tile's online-softmax update in base 2 (FlashAttention-2,
  arXiv 2307.08691 Algorithm 1; the running max and rescale of
  FlashAttention, arXiv 2205.14135): from the scores ``s`` of a tile and
  the running row max ``m`` (already scaled), ``(P, m_next, alpha)``:
  ``P = 2^(s scale - m_next)`` (float32), the new max and ``alpha =
  2^(m - m_next)``, the factor that rescales the row sum and ``O``
  accumulated so far.  ``scale`` None: ``s`` is already scaled.

  ``threshold`` > 0: FlashAttention-4's conditional rescaling (arXiv
  2603.05451): the row's reference max (against which ``P``, the row sum
  and ``O`` are kept) moves only when the row's max grows past it by
  more than ``2^threshold``, else ``P`` runs up to ``2^threshold``, exact
  in float32 and in ``P``'s 16-bit format.  The final ``O / l`` and the
  LSE (``m + log2 l``) are the same for any reference.  A row that has
  seen no key moves at once (anything > -inf); -inf stays -inf.

  ``masked``: the tile took the element mask, so a row may have seen no
  key yet (``m_next = -inf``)."""
  row_max = s.max(axis=1)
  m_next = jnp.maximum(m, row_max if scale is None else row_max * scale)
  if threshold:
    m_next = jnp.where(m_next > m + threshold, m_next, m)
  # While a row has seen no key, m = -inf: subtract 0 instead so that
  # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
  m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
  alpha = jnp.exp2(m - m_use)
  if threshold:  # exactly 1 where the reference stayed
    alpha = jnp.where(m_next == m, 1.0, alpha)
  m_b = lax.broadcast_in_dim(m_use, s.shape, [0])
  x = s - m_b if scale is None else s * scale - m_b
  return jnp.exp2(x), m_next, alpha


def fp8_key_order(vt):
  """V^T ``[..., n]`` (``n`` a multiple of 16) with its keys in the order
  that an e4m3 ``P`` made a register operand by :func:`_as_8bit_operand`
  takes them: that operand's column ``16 m + 4 q + 2 e + f`` holds
  ``P``'s column ``16 m + 8 e + 2 q + f`` (thread ``q`` of a quad holds
  columns ``2 q, 2 q + 1, 2 q + 8, 2 q + 9`` of each 16 in the wgmma
  layout of ``S`` and they are read as columns ``4 q .. 4 q + 3`` of the
  8-bit layout), so V's keys are permuted the same way: a swap of two
  axes, which XLA folds into V's transposition (FlashAttention-3
  shuffles ``P``'s bytes in registers instead)."""
  *lead, n = vt.shape
  return vt.reshape(*lead, n // 16, 2, 4, 2).swapaxes(-3, -2).reshape(
      *lead, n)


def _as_8bit_operand(p8):
  """An e4m3 ``P`` in the wgmma layout of ``S`` as an 8-bit wgmma A
  operand in registers (``WGMMA_8BIT``) at no cost: each thread's two
  2-element vectors of adjacent 8-column tiles become one 4-element
  vector, which permutes the columns within each 16 as
  :func:`fp8_key_order` says.  Mosaic GPU has no WGMMA -> WGMMA_8BIT
  relayout; the interpreter runs no inline Mosaic GPU code, so
  interpreted FP8 runs stage ``P`` in shared memory (``p_in_smem``)."""
  layout = plgpu.Layout.WGMMA_8BIT

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(p8.shape, p8.dtype,
                                                        layout=layout))
  def relabel(_, x):
    regs = x.registers
    out = np.empty(mgpu_fa.WGMMA_LAYOUT_8BIT.registers_shape(x.shape),
                   dtype=object)
    for i in np.ndindex(out.shape):
      out[i] = mgpu_utils.vector_concat(
          [regs[(i[0], 2 * i[1] + j, *i[2:])] for j in (0, 1)])
    return mgpu.FragmentedArray(_registers=out,
                                _layout=mgpu_fa.WGMMA_LAYOUT_8BIT,
                                _is_signed=None)
  return relabel(p8)


@dataclasses.dataclass(frozen=True)
class Problem:
  """Static description of a padded call: ``mask`` speaks of the unpadded
  lengths, the other sizes of the padded arrays."""

  mask: MaskSpec
  softmax_scale: float
  batch: int
  num_heads: int
  num_kv_heads: int
  q_pad: int
  kv_pad: int
  head_dim_padded: int
  logits_soft_cap: float | None = None
  # Segment ids or lengths (folded into the ids: padding positions are
  # PAD_SEGMENT_ID): every computed tile takes the element mask.
  has_segment_ids: bool = False
  # A FlashMask (shared by the heads): its columns flash [B, n, Sp] follow
  # the segment inputs; it masks only the tiles outside the run it leaves
  # fully visible (seg_range's rows 2 and 3).
  has_flash_mask: bool = False
  # ALiBi: [B, H, 2] float32 (slopes divided by softmax_scale: in the raw
  # logits' units; position shifts) after the mask inputs.
  has_alibi: bool = False
  # A dense bias [B | 1, H | 1, Tp, Sp] in the inputs' dtype (after ALiBi),
  # its tiles streamed in a ring beside V (bias_batched / bias_per_head:
  # whether its batch / head axis is full rather than shared), or with
  # bias_rows False one float32 row [B | 1, H | 1, 1, Sp] for every query
  # (a key padding bias), read from GMEM per key tile.
  has_bias: bool = False
  bias_batched: bool = False
  bias_per_head: bool = False
  bias_rows: bool = True

  # A dense boolean mask as int8 [B | 1, H | 1, Tp | 1, Sp] (nonzero:
  # visible; an axis of size 1 shared) after the bias, read from GMEM in
  # the tiles that take the element mask.  Its tile ranges ride in
  # seg_range (rows 0-1 the tiles with a visible key for some head, rows
  # 2-3 a run fully visible for every head), as a FlashMask's do.
  has_dense_mask: bool = False

  # Attention dropout (rate > 0): [B, H + 2] int32 after the dense mask, each
  # head's masks.dropout_head_key, then the first row and first key of
  # this call among the whole attention's; shared: one keep mask for
  # every head (the table's keys all head 0's).
  dropout_rate: float = 0.0
  dropout_shared: bool = False

  # FP8 (FlashAttention-3's low-precision forward, arXiv 2407.08608 §3.3):
  # q and k in float8_e4m3fn, V transposed to [B, K, Dp, Sp] (Mosaic GPU's
  # wgmma takes 8-bit operands K-major only, and P V contracts over the
  # keys), P rounded to e4m3 for P V as an 8-bit register operand, V^T's
  # keys in fp8_key_order (with p_in_smem, the interpreter's form, P goes
  # through shared memory); the dequantization table [H, 2] float32
  # (q_scale * k_scale and v_scale of each query head) comes last; the
  # output in ``out_dtype``.
  fp8: bool = False
  out_dtype: object = None

  @property
  def bias_ring(self) -> bool:
    """The bias's tiles go through shared memory (:attr:`bias_rows`)."""
    return self.has_bias and self.bias_rows

  @property
  def has_segments(self) -> bool:
    """The segment inputs ride along (ids, a FlashMask or a dense mask's
    tile ranges): q_seg [B, Tp], kv_seg [B, Sp] and seg_range [B, 2 | 6,
    n_groups] (the key tiles each query group visits, and a gap of hidden
    ones it skips:
    masks.overlap_range, flashmask.tile_ranges, flashmask.tile_runs)."""
    return (self.has_segment_ids or self.has_flash_mask
            or self.has_dense_mask)


@dataclasses.dataclass(frozen=True)
class RowCopies:
  """Which arrays the forward copies by TMA through row views of their
  buffers (:func:`pipeline.row_buffer`), at any row count: Q and O
  (``q``), K and V (``kv``)."""

  q: bool = False
  kv: bool = False


def row_copies(prob: Problem, cfg: MosaicConfig, q_len: int, kv_len: int,
               interpret: bool) -> RowCopies:
  """Where the forward takes ``q_len`` query / ``kv_len`` key rows as
  they are: with ``unpadded_q`` / ``unpadded_kv``, at a length that
  :data:`pipeline.TMA_ROW_TILE` does not divide (ViT's 577 tokens; at
  the others the tiled copies take the length already), 16-bit rows one
  swizzle wide (head_dim 64 or less: :func:`pipeline.one_swizzle_wide`;
  for K/V also V's tiles, ``block_kv`` a multiple of the head_dim),
  on the GPU.  Elsewhere those lengths are padded to a multiple of 8
  (an XLA copy of Q, K, V and a slice of O)."""
  dp = prob.head_dim_padded
  if interpret or prob.fp8 or not pipeline.one_swizzle_wide(dp):
    return RowCopies()
  tile = pipeline.TMA_ROW_TILE
  return RowCopies(
      q=cfg.unpadded_q and q_len % tile != 0,
      kv=cfg.unpadded_kv and kv_len % tile != 0 and cfg.block_kv % dp == 0)


# ---------------------------------------------------------------------------
# The kernel's operands and what every work item of a program shares.


@dataclasses.dataclass(frozen=True)
class _Refs:
  """The forward kernel's operands and scratch, by name (the order of
  :func:`forward`'s ``scratch`` list)."""

  q: object
  k: object
  v: object
  q_seg: object  # segment ids (None without them)
  kv_seg: object
  seg_range: object
  flash: object  # FlashMask columns (None without one)
  alibi: object  # ALiBi's slopes (None without them)
  bias: object  # the dense bias (None without one)
  dense_mask: object  # the dense boolean mask as int8 (None without one)
  dropout: object  # dropout_seeds (None without dropout)
  dequant: object  # FP8's dequantization table (None without FP8)
  o: object
  lse: object
  qo_smem2: object  # Q (and with the plain epilogue O), per Q buffer
  k_smem: object  # the K/V ring
  v_smem: object
  lse_smem2: object
  k_ready: object  # TMA completion per ring slot
  v_ready: object
  q_ready: object  # per Q buffer
  k_free: object  # "slot consumed" (pipeline.MBarriers or NamedBarriers)
  v_free: object
  bias_smem: object  # the dense bias's ring (one tile per K/V slot,
  bias_ready: object  # filled with V and freed with it: v_free)
  p_smem2: object  # P staged for P V (p_in_smem)
  o_smem2: object  # the output's own slots (MosaicConfig.out_slots)
  q_free: object  # "done with Q" (prefetch_q)
  schedule: object  # the ping-pong's mbarrier
  exit_barrier: object  # the producers' rendezvous (clusters)
  # The views the TMA copies of Q, K, V and O go through: the buffers
  # above, or their row views (RowCopies).
  q_rows2: object
  k_rows: object
  v_rows: object
  o_rows2: object

  @classmethod
  def unpack(cls, refs, prob: Problem, cfg: MosaicConfig, cluster: int,
             rows: RowCopies):
    flash = None
    if prob.has_segments:
      q, k, v, q_seg, kv_seg, seg_range, *refs = refs
      if prob.has_flash_mask:
        flash, *refs = refs
    else:
      q, k, v, *refs = refs
      q_seg = kv_seg = seg_range = None
    alibi = refs.pop(0) if prob.has_alibi else None
    bias = refs.pop(0) if prob.has_bias else None
    dense_mask = refs.pop(0) if prob.has_dense_mask else None
    dropout = refs.pop(0) if prob.dropout_rate else None
    dequant = refs.pop(0) if prob.fp8 else None
    o, lse, *refs = refs
    (qo_smem2, k_smem, v_smem, lse_smem2, k_ready, v_ready,
     q_ready, k_free, v_free, *extra) = refs
    qo_smem2, q_rows2 = pipeline.row_views(qo_smem2, rows.q)
    k_smem, k_rows = pipeline.row_views(k_smem, rows.kv)
    v_smem, v_rows = pipeline.row_views(v_smem, rows.kv)
    bias_smem = bias_ready = None
    if prob.bias_ring:
      bias_smem, bias_ready, *extra = extra
    p_smem2 = extra.pop(0) if cfg.p_in_smem else None
    o_smem2 = o_rows2 = None
    if cfg.out_slots:
      o_smem2, o_rows2 = pipeline.row_views(extra.pop(0), rows.q)
    q_free = extra.pop(0) if cfg.prefetches_q else None
    # kv_multicast: two CTAs per cluster (``cluster``, from
    # _cluster_size), one query group each, share the K/V ring; its
    # "free" signals are then cluster mbarriers.
    exit_barrier = extra.pop() if cluster > 1 else None
    # Named, the consumed signals take the ids after the schedule's two
    # (4 + 2 + [0, 2 * stages): config.MAX_NAMED_STAGES), above Mosaic
    # GPU's warpgroup barriers (1 + warpgroup index: at most 4, three
    # consumers).
    first = pipeline.FIRST_NAMED_BARRIER + 2
    named_rings = cfg.named_barriers and cluster == 1
    k_free = pipeline.ring_free(k_free, named_rings, cfg.compute_wgs, first)
    v_free = pipeline.ring_free(v_free, named_rings, cfg.compute_wgs,
                                first + cfg.stages)
    return cls(q, k, v, q_seg, kv_seg, seg_range, flash, alibi, bias,
               dense_mask, dropout, dequant, o, lse, qo_smem2, k_smem,
               v_smem, lse_smem2, k_ready, v_ready, q_ready, k_free,
               v_free, bias_smem, bias_ready, p_smem2, o_smem2,
               q_free,
               extra[-1] if _use_schedule(cfg) else None, exit_barrier,
               q_rows2, k_rows, v_rows, o_rows2)


class _Ctx:
  """What every work item of a program shares: the call, the config, the
  refs, this warpgroup (``wg``) and its ping-pong, and the forms the
  config selects for this call."""

  def __init__(self, prob: Problem, cfg: MosaicConfig, dtype, *,
               in_place: bool, refs: _Refs, wg, ping, persistent: bool,
               cluster: int):
    self.prob, self.cfg, self.dtype, self.in_place = prob, cfg, dtype, in_place
    # P V's operands: P rounded to V's format (FP8: e4m3), and the output.
    self.p_dtype = jnp.float8_e4m3fn if prob.fp8 else dtype
    self.out_dtype = prob.out_dtype if prob.fp8 else dtype
    self.r, self.wg, self.ping = refs, wg, ping
    self.persistent, self.cluster = persistent, cluster
    # prefetch_q: the producer loads each item's Q once both consumers
    # are done with the last ("q_free").
    self.prefetch = cfg.prefetches_q
    # early_q_release (which needs intra_wg_overlap): "done with Q" from
    # the overlapped loop, before the last P V turn, and Q loaded first.
    self.early_q_release = self.prefetch and cfg.early_q_release
    # q_double_buffer: two Q buffers per consumer, used by alternate
    # items (not with persistent_pairs, whose skipped items would break
    # the alternation).
    self.double_q = _double_q(cfg, prob)
    # item_overlap: the loop runs on across work items (_chains_items).
    self.chained = _chains_items(cfg, prob)

  def q_buffer(self, item, w):
    """Consumer ``w``'s Q buffer (and ``q_ready`` slot) for work item
    ``item``, and the ``q_free`` barrier of that buffer: buffer ``buf``
    of consumer ``w`` is ``qo_smem2[buf * compute_wgs + w]``."""
    if not self.double_q:
      return w, self.r.q_free
    buf = lax.rem(item, 2)
    return buf * self.cfg.compute_wgs + w, self.r.q_free.at[buf]


# ---------------------------------------------------------------------------
# The schedule: which work items a program runs.


class _Schedule:
  """Which work items a program runs, and in which order.

  A work item is one query group (``compute_wgs * block_q`` rows) of one
  (batch, head) with the key tiles it streams.  On the plain grid a
  program runs one item (Mosaic GPU launches batch fastest, then query
  groups, then heads: :func:`forward`'s grid).  On the persistent grid
  program ``sm`` runs work units ``sm, sm + n_programs, ...``, heads
  fastest, then query groups, then batch (:meth:`for_each_item`), or on
  causal calls longest first (:attr:`lpt`: :meth:`unit_coords`,
  :meth:`unit_of`).  On
  causal calls query groups count from the longest (:meth:`item_ranges`).
  With clusters (``kv_multicast``) the two CTAs of a program or unit take
  adjacent query groups; with ``persistent_pairs`` a unit is the ``p``-th
  longest and the ``p``-th shortest group of one (batch, head)."""

  def __init__(self, prob: Problem, cfg: MosaicConfig,
               n_programs: int | None, cluster: int, seg_range):
    self.prob, self.cfg = prob, cfg
    self.n_programs, self.cluster, self.seg_range = (n_programs, cluster,
                                                     seg_range)
    self.group_rows = cfg.compute_wgs * cfg.block_q
    self.n_groups = prob.q_pad // self.group_rows
    self.pairs = _paired(cfg, prob)
    self.units_per_bh = _units_per_bh(cfg, prob, self.n_groups)
    # Longest-processing-time-first order on causal calls (below): where
    # the config asks, or where the heads-first order would load one
    # program far above the mean (_heads_first_imbalance).
    self.lpt = (n_programs is not None and prob.mask.causal
                and not self.pairs
                and (cfg.causal_lpt or _heads_first_imbalance(
                    prob.batch * prob.num_heads, prob.num_heads,
                    self.units_per_bh, n_programs) > MAX_HEADS_FIRST_IMBALANCE))
    self.section = _lpt_section(prob) if self.lpt else None

  def item_ranges(self, b, group):
    """A work item's first query row, the key tiles it streams ``[u_lo,
    u_hi)`` (virtual tiles: :class:`pipeline.TileGap`) and the gap it
    skips (None: none)."""
    mask = self.prob.mask
    if mask.causal:
      # Causal work grows with the query index: run the longest query
      # groups first so the last wave is made of short ones (better balance
      # across the 132 SMs; tokamax and FlashAttention-3 do the same).
      group = self.n_groups - 1 - group
    group_start = group * self.group_rows
    # Key tiles any consumer of this program needs: the producer loads them.
    u_lo, _, _, u_hi = mask.kv_block_range(group_start, self.group_rows,
                                           self.cfg.block_kv)
    u_lo, u_hi = pipeline.narrow_to_segments(u_lo, u_hi, self.seg_range, b,
                                             group)
    u_hi, gap = pipeline.tile_gap(u_lo, u_hi, self.seg_range, b, group)
    return group_start, u_lo, u_hi, gap

  def cluster_group(self, unit):
    """The query group of this CTA in program (or work unit) ``unit``:
    with clusters, CTA ``c`` of unit ``p`` takes group ``2p + c``."""
    if self.cluster == 1:
      return unit
    return unit * self.cluster + lax.axis_index("cluster")

  def plain_item(self, b):
    """The plain grid's item of this program (batch ``b``):
    ``(group_start, u_lo, u_hi, gap)``."""
    return self.item_ranges(b, self.cluster_group(lax.axis_index("q_seq")))

  def unit_coords(self, w):
    """Work unit ``w``'s (batch, head, unit of its (batch, head)) in the
    persistent grid's order: heads fastest, then query groups, then
    batch; on causal calls (:attr:`lpt`) FlashAttention-3's
    longest-processing-time-first order instead: the (batch, head) pairs
    cut into sections whose K/V fit in L2 (:func:`_lpt_section`), and in
    each section query groups from the longest, the section's (batch,
    head) pairs fastest (heads first).  Each program's items then shrink
    together, where the first order could give a program the same group
    in every round (GPT-2 small on 132 SMs: 12 heads x 11 groups = 132,
    so one program ran the longest group of every batch and another the
    shortest)."""
    prob = self.prob
    if not self.lpt:
      h = lax.rem(w, prob.num_heads)
      rest = lax.div(w, prob.num_heads)
      return (lax.div(rest, self.units_per_bh), h,
              lax.rem(rest, self.units_per_bh))
    pairs_total = prob.batch * prob.num_heads
    per_section = self.section * self.units_per_bh
    s = lax.div(w, per_section)
    r = w - s * per_section
    size = jnp.minimum(self.section, pairs_total - s * self.section)
    bh = s * self.section + lax.rem(r, size)
    return (lax.div(bh, prob.num_heads), lax.rem(bh, prob.num_heads),
            lax.div(r, size))

  def unit_of(self, sm, i):
    """The work unit of program ``sm``'s ``i``-th round: ``sm + i *
    n_programs``, or with :attr:`lpt` dealt boustrophedon (odd rounds
    from the last program), so that the program that takes a round's
    longest unit takes the next round's shortest."""
    n = self.n_programs
    if not self.lpt:
      return sm + i * n
    return i * n + jnp.where(lax.rem(i, 2) == 0, sm, n - 1 - sm)

  def rounds(self, sm, units):
    """How many units program ``sm`` runs (:meth:`unit_of`'s order)."""
    n = self.n_programs
    if not self.lpt:
      return lax.div(units - sm + n - 1, n)
    full, rest = units // n, units % n
    last = sm if full % 2 == 0 else n - 1 - sm
    return full + jnp.where(last < rest, 1, 0)

  def for_each_item(self, run, extra=None):
    """Persistent grid: program ``sm`` takes work units ``sm, sm +
    n_programs, ...`` (:meth:`unit_coords`), the ring's step count running
    on across them: ``run(item, b, h, group_start, u_lo, u_hi,
    first_step, gap)``.  With ``persistent_pairs`` on a causal call a unit is a
    pair of query groups (the ``p``-th longest, then the ``p``-th
    shortest: equal work per unit); the second of a pair is skipped where
    it is the first (an odd group count's middle group).  Returns the
    total steps and the program's item count (loop iterations, skipped
    ones included).  With ``extra`` (not with pairs) ``run`` also takes
    ``extra=`` (its value from the item before, ``extra`` for the first)
    and ``n_items=``, and returns the next value."""
    prob, pairs = self.prob, self.pairs
    sm = lax.axis_index("sm")
    units = prob.num_heads * self.units_per_bh * prob.batch
    n_items = self.rounds(sm, units)
    if pairs:
      n_items = 2 * n_items

    if extra is not None and pairs:
      raise NotImplementedError("a carry across persistent pairs")

    def body(i, carry):
      first_step, value = carry if extra is not None else (carry, None)
      w = self.unit_of(sm, lax.div(i, 2) if pairs else i)
      b, h, u = self.unit_coords(w)
      if not pairs:
        group_start, u_lo, u_hi, gap = self.item_ranges(
            b, self.cluster_group(u))
        if extra is None:
          run(i, b, h, group_start, u_lo, u_hi, first_step, gap)
          return first_step + (u_hi - u_lo)
        value = run(i, b, h, group_start, u_lo, u_hi, first_step, gap,
                    extra=value, n_items=n_items)
        return first_step + (u_hi - u_lo), value
      # item_ranges counts causal groups from the longest: rank u, then
      # rank n_groups - 1 - u.
      second = lax.rem(i, 2) == 1
      rank = jnp.where(second, self.n_groups - 1 - u, u)
      live = jnp.logical_not(second) | (self.n_groups - 1 - u != u)
      group_start, u_lo, u_hi, gap = self.item_ranges(b, rank)
      pl.when(live)(
          lambda: run(i, b, h, group_start, u_lo, u_hi, first_step, gap))
      return first_step + jnp.where(live, u_hi - u_lo, 0)

    if extra is None:
      return lax.fori_loop(0, n_items, body, jnp.int32(0)), n_items
    total, _ = lax.fori_loop(0, n_items, body, (jnp.int32(0), extra))
    return total, n_items


# ---------------------------------------------------------------------------
# One work item on a consumer warpgroup: the tile steps and the epilogue.


class _Item:
  """One work item on a consumer warpgroup: its ``block_q`` query rows
  against the key tiles ``[u_lo, u_hi)``, ring steps ``first_step + [0,
  u_hi - u_lo)``.  :meth:`run` loads Q, runs one of the main loops
  (:func:`_plain_loop`, :func:`_overlapped_loop`, :func:`_chained_loop`)
  and the epilogue; the methods are the loops' parts: the scores
  (:meth:`scores`), the element mask (:meth:`apply_mask`), the online
  softmax (:meth:`probs`, :func:`softmax_step`), ``O += P V``
  (:meth:`add_pv`), and the output (:meth:`epilogue`).

  ``item``: the item's number in the program's loop (persistent grid).
  ``chain=(s_first, n_items)`` with ``item_overlap``: ``S`` of this
  item's first tile, issued and read back by the item before (valid from
  item 1), and the program's item count; :meth:`run` then returns ``S``
  of the next item's first tile (zeros after the last item)."""

  def __init__(self, ctx: _Ctx, b, h, group_start, u_lo, u_hi, first_step,
               gap=None, item=None, chain=None):
    self.ctx, self.r, self.cfg, self.prob = ctx, ctx.r, ctx.cfg, ctx.prob
    self.b, self.h, self.group_start = b, h, group_start
    self.u_lo, self.u_hi, self.first_step = u_lo, u_hi, first_step
    self.gap = gap
    self.item, self.chain = item, chain
    self.bq, self.bk, self.stages = (self.cfg.block_q, self.cfg.block_kv,
                                     self.cfg.stages)
    self.qk_scale = self.prob.softmax_scale * LOG2E
    # FP8: the logits of the quantized q, k times q_scale * k_scale are
    # the real ones, so that product joins the softmax scale (a run-time
    # scalar per head); v_scale joins 1 / l in the epilogue.
    self.qk_dequant = self.v_dequant = None
    if self.prob.fp8:
      self.qk_dequant = ctx.r.dequant[h, 0]
      self.v_dequant = ctx.r.dequant[h, 1]
      self.qk_scale = self.qk_dequant * self.qk_scale
    in_place = ctx.in_place
    self.rescale = functools.partial(
        rescale_rows,
        skip_unmoved=bool(self.cfg.rescale_threshold) and in_place)
    self.deferred_sum = self.cfg.deferred_row_sum and in_place
    self.rsum = functools.partial(row_sum, deferred=self.deferred_sum)

  def key_start(self, t):
    """The first key of (virtual) key tile ``t``."""
    return pipeline.key_start(self.gap, t, self.bk)

  def slot_of(self, t):
    """The ring slot of key tile ``t``."""
    return lax.rem(self.first_step + t - self.u_lo, self.stages)

  def step_of(self, t):
    """The ring step of key tile ``t``."""
    return self.first_step + t - self.u_lo

  def run(self):
    """Q in, the main loop over the item's key tiles, the epilogue."""
    ctx, r, cfg, bq, bk = self.ctx, self.r, self.cfg, self.bq, self.bk
    wg, ping = ctx.wg, ctx.ping
    self.q_slot, self.q_done = ctx.q_buffer(self.item, wg)
    self.qo_smem = r.qo_smem2.at[self.q_slot]
    self.qo_rows = r.q_rows2.at[self.q_slot]
    self.lse_smem = r.lse_smem2.at[wg]
    self.q_start = self.group_start + wg * bq
    if not ctx.prefetch:  # (with prefetch_q, the producer loads Q)
      plgpu.copy_gmem_to_smem(
          r.q.at[self.b, pl.ds(self.q_start, bq), self.h], self.qo_rows,
          r.q_ready.at[wg])
    if ctx.chained:  # from item 1 on, the item before waited for this Q
      pl.when(self.item == 0)(
          lambda: plgpu.barrier_wait(r.q_ready.at[self.q_slot]))
    else:
      plgpu.barrier_wait(r.q_ready.at[self.q_slot])
    row = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row)
    l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row)
    acc = plgpu.layout_cast(
        jnp.full((bq, self.prob.head_dim_padded), 0.0, jnp.float32),
        plgpu.Layout.WGMMA)
    if ctx.chained:  # one alternation over the program's items
      pl.when(self.item == 0)(ping.start)
      self.next_q_slot, _ = ctx.q_buffer(self.item + 1, wg)
    else:
      ping.start()  # offset the two consumers by a half step
    # everywhere: every computed tile takes the element mask (segment
    # ids or lengths), read by the loops.
    own, self.everywhere = pipeline.flash_full_range(
        self.prob.mask.kv_block_range(self.q_start, bq, bk), r.seg_range,
        self.b, lax.div(self.group_start, cfg.compute_wgs * bq),
        segment_ids=self.prob.has_segment_ids)
    own = pipeline.virtual_range(self.gap, own)  # (the walk's tiles)
    # A bias may hold -inf (a mask given as a bias) in any tile: every
    # computed tile takes the softmax's guard for rows with nothing seen.
    self.everywhere = self.everywhere or r.bias is not None
    if ctx.chained:  # the epilogue runs inside the loop's last turn
      loop = _overlapped_loop if cfg.intra_wg_overlap else _chained_loop
      return loop(self, own, (acc, m, l))
    if cfg.intra_wg_overlap:
      acc, m, l = _overlapped_loop(self, own, (acc, m, l))
    else:
      acc, m, l = _plain_loop(self, own, (acc, m, l))
    ping.finish()
    if ctx.prefetch and not ctx.early_q_release:
      # This consumer's last Q K^T completed: Q's buffer may be refilled.
      plgpu.barrier_arrive(self.q_done)
    self.epilogue(acc, m, l)

  def apply_mask(self, s, t):
    """The element mask on tile ``t``'s scores: -inf where a key is not
    visible to a query (causal, window, lengths, segment ids:
    :meth:`jaxflash.masks.MaskSpec.visible`)."""
    r, bq, bk, b = self.r, self.bq, self.bk, self.b
    q_idx = pipeline.index_tile(self.q_start, (bq, bk), 0)
    k_idx = pipeline.index_tile(self.key_start(t), (bq, bk), 1)
    seg = {}
    if r.q_seg is not None:
      # Straight from GMEM into the row / column layouts of S
      # (a non-"optimized" load: GMEM is not swizzled SMEM).
      q_seg = plgpu.load(r.q_seg.at[b, pl.ds(self.q_start, bq)],
                         layout=plgpu.Layout.WGMMA.reduce(1),
                         optimized=False)
      k_seg = plgpu.load(r.kv_seg.at[b, pl.ds(self.key_start(t), bk)],
                         layout=plgpu.Layout.WGMMA.reduce(0),
                         optimized=False)
      seg = dict(q_seg=lax.broadcast_in_dim(q_seg, (bq, bk), [0]),
                 k_seg=lax.broadcast_in_dim(k_seg, (bq, bk), [1]))
    visible = self.prob.mask.visible(q_idx, k_idx, **seg)
    if r.flash is not None:
      visible = visible & pipeline.flash_visible(
          r.flash, b, q_idx, self.key_start(t), bk, (bq, bk), key_axis=1)
    if r.dense_mask is not None:
      visible = visible & self.dense_visible(t)
    return jnp.where(visible, s, -jnp.inf)

  def dense_visible(self, t):
    """Tile ``t``'s dense boolean mask for this consumer's rows, in the
    wgmma layout of ``S``: straight from GMEM (a non-"optimized" load, as
    the segment ids), only in the tiles that take the element mask (the
    others are skipped or fully visible by the mask's tile ranges)."""
    return pipeline.dense_mask_tile(
        self.r.dense_mask, self.b, self.h, q_start=self.q_start, n_q=self.bq,
        k_start=self.key_start(t), n_k=self.bk, q_axis=0)

  def probs(self, s, t, m, *, masked: bool):
    """Tile ``t``'s online-softmax step from the raw ``S``: ``P`` (float32,
    base 2, against the new running max), the new max and the factor
    ``alpha`` that rescales what was accumulated before
    (:func:`softmax_step`); the element mask first where ``masked``."""
    prob = self.prob
    if prob.logits_soft_cap is None:
      # Raw logits; the base-2 scale is applied to the row max and
      # folded into exp2's argument (one FMA per element): on the H200
      # 608 TFLOP/s against 555 with a separate multiply (head_dim 128,
      # 4096 keys).
      scale = self.qk_scale
      if self.r.alibi is not None:
        s = s + self.alibi_bias(t)
      if self.r.bias is not None:
        s = s + self.bias_tile(t)
    else:  # cap * tanh(x / cap) on the scaled logits (Gemma 2)
      cap = prob.logits_soft_cap
      scaled = prob.softmax_scale / cap
      if self.qk_dequant is not None:
        scaled = self.qk_dequant * scaled
      s = jnp.tanh(s * scaled) * (cap * LOG2E)
      scale = None
    if masked:
      s = self.apply_mask(s, t)
    return softmax_step(s, m, scale=scale,
                        threshold=self.cfg.rescale_threshold, masked=masked)

  def alibi_bias(self, t):
    """ALiBi on tile ``t`` in the raw logits' units: ``-slope * |i + offset
    - j| / softmax_scale`` (FlashAttention-2's convention,
    :func:`jaxflash.masks.alibi_bias`; the slope comes divided)."""
    return pipeline.alibi_tile(
        self.r.alibi, self.b, self.h, self.prob.mask.offset,
        q_start=self.q_start, n_q=self.bq, k_start=self.key_start(t),
        n_k=self.bk, q_axis=0)

  def bias_tile(self, t):
    """Tile ``t``'s dense bias for this consumer's rows in the raw logits'
    units (divided by ``softmax_scale``, as ALiBi's slopes), float32 in
    the wgmma layout (its slot is freed with V's, after this tile's P V)."""
    r, prob, inv_scale = self.r, self.prob, 1.0 / self.prob.softmax_scale
    if not prob.bias_rows:  # one row for every query, from GMEM
      return pipeline.key_row(r.bias, self.b, self.h, k_start=self.key_start(t),
                              n_k=self.bk, n_q=self.bq, q_axis=0) * inv_scale
    slot = self.slot_of(t)
    plgpu.barrier_wait(r.bias_ready.at[slot])
    tile = plgpu.load(r.bias_smem.at[slot, pl.ds(self.ctx.wg * self.bq,
                                                 self.bq)],
                      layout=plgpu.Layout.WGMMA)
    return tile.astype(jnp.float32) * inv_scale

  def dropped(self, p, t):
    """Tile ``t``'s ``P`` as ``P V`` takes it: under attention dropout
    (FlashAttention-2's) the kept probabilities scaled by ``1 / (1 -
    rate)`` and the others 0, the row sums left whole; the keep mask is
    :func:`jaxflash.masks.dropout_keep`'s hash, which the Triton backward
    regenerates."""
    prob, r = self.prob, self.r
    if not prob.dropout_rate:
      return p
    keep = pipeline.dropout_keep_tile(
        r.dropout, self.b, self.h, prob.num_heads, prob.dropout_rate,
        q_start=self.q_start, n_q=self.bq, k_start=self.key_start(t),
        n_k=self.bk, q_axis=0)
    return pipeline.dropped(p, keep, prob.dropout_rate)

  def probs_where_visible(self, s, t, m, full_lo, full_hi):
    """:meth:`probs` for a tile whose masking is known only at run time:
    without the element mask where ``t`` lies in the fully visible
    ``[full_lo, full_hi)``, as :func:`_masked_ranges` runs the tiles of a
    loop (a ``lax.cond``).  The start value ``m = -inf`` needs no guard
    there: a visible tile's row max is finite, so ``alpha = exp2(-inf) =
    0``."""
    if self.everywhere:
      return self.probs(s, t, m, masked=True)
    return lax.cond((full_lo <= t) & (t < full_hi),
                    lambda: self.probs(s, t, m, masked=False),
                    lambda: self.probs(s, t, m, masked=True))

  def scores(self, slot):
    """``S = Q K^T`` with tile ``slot``'s K (waited for, then
    released)."""
    r, ping = self.r, self.ctx.ping
    plgpu.barrier_wait(r.k_ready.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, self.qo_smem, r.k_smem.at[slot].T)
      ping.issued()  # let the other consumer's matmul go next
      return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((self.bq, self.bk), jnp.float32))
    r.k_free.arrive(slot)
    return s

  def p_operand(self, p16):
    """``P`` as the ``P V`` wgmma's A operand (registers, or SMEM)."""
    if self.r.p_smem2 is None:
      return _as_8bit_operand(p16) if self.prob.fp8 else p16
    p_src = self.r.p_smem2.at[self.ctx.wg]
    p_src[...] = p16
    plgpu.commit_smem()
    return p_src

  def stash(self, p):
    """``P`` (float32) made the next ``P V``'s A operand in the overlapped
    loop: 16-bit registers carried to the next step or, with
    ``p_in_smem``, stored now into this consumer's ``P`` buffer (the
    ``P V`` that read it last has completed) and nothing carried but a
    placeholder, as FlashAttention-3 stores ``P`` after its
    ``warpgroup_wait<0>`` when its ``P V`` reads shared memory (its
    head_dim 64 form)."""
    p16 = p.astype(self.ctx.p_dtype)
    if self.r.p_smem2 is None:
      return _as_8bit_operand(p16) if self.prob.fp8 else p16
    self.r.p_smem2.at[self.ctx.wg][...] = p16
    plgpu.commit_smem()
    return jnp.int32(0)

  def stashed(self, carried):
    """The A operand :meth:`stash` left: ``carried``, or the P buffer."""
    return carried if self.r.p_smem2 is None else self.r.p_smem2.at[
        self.ctx.wg]

  def v_operand(self, slot):
    """Tile ``slot``'s V as ``P V``'s B operand: ``[block_kv, Dp]``, with
    FP8 the transposed view of its ``[Dp, block_kv]`` tile (K-major)."""
    v = self.r.v_smem.at[slot]
    return v.T if self.prob.fp8 else v

  def add_pv(self, acc, p16, slot, p_src=None):
    """``O += P V`` with tile ``slot``'s V (waits for the wgmma).
    ``p_src``: ``P`` already in place (then ``p16`` is not used)."""
    p_src = self.p_operand(p16) if p_src is None else p_src

    def issue(acc_ref):
      plgpu.wgmma(acc_ref, p_src, self.v_operand(slot))

    if self.ctx.in_place:
      # O += P V accumulated in the wgmma registers themselves
      # (FlashAttention-3); the interpreter rejects this idiom.  A fresh
      # accumulator instead spills at head_dim 256 (measured on the H200:
      # 221 against 593 TFLOP/s at 4096 keys).
      return pl.run_state(issue)(plgpu.ACC.init(acc))

    # Interpretable form: a fresh scoped accumulator, added in registers.
    def pv(acc_ref):
      issue(acc_ref)
      return acc_ref[...]
    return acc + pl.run_scoped(
        pv, plgpu.ACC((self.bq, self.prob.head_dim_padded), jnp.float32))

  def softmax_turn(self, s, t, carry, slot, *, masked):
    """Tile ``t``'s online-softmax step from its ``S``, up to this
    consumer's turn on the tensor cores (V waited for); ``masked`` a
    bool, or ``(full_lo, full_hi)``: the element mask where ``t`` lies
    outside those fully visible tiles (a ``lax.cond``):
    ``(acc, m, l, P16)``."""
    ping, in_place = self.ctx.ping, self.ctx.in_place
    acc, m, l = carry
    if isinstance(masked, tuple):  # (full_lo, full_hi): at run time
      p, m_next, alpha = self.probs_where_visible(s, t, m, *masked)
    else:
      p, m_next, alpha = self.probs(s, t, m, masked=masked)
    l = l * alpha
    p16 = self.dropped(p, t).astype(self.ctx.p_dtype)
    if in_place:  # (the interpretable form rescales after the barrier)
      acc = self.rescale(acc, alpha)
    # As JAX's attention_mgpu: at head_dim <= 128, finishing the row sum
    # and pinning the softmax results before the barriers lets the
    # compiler schedule them ahead of the wait (measured faster there).
    early_sum = self.prob.head_dim_padded <= 128
    if early_sum:
      l = l + self.rsum(p)
      if self.prob.fp8:  # (Mosaic GPU pins no 8-bit register vectors)
        acc, l, m_next = lax.optimization_barrier((acc, l, m_next))
      else:
        acc, l, m_next, p16 = lax.optimization_barrier(
            (acc, l, m_next, p16))
    ping.softmax_done()
    plgpu.barrier_wait(self.r.v_ready.at[slot])
    ping.before_pv()  # tensor cores free
    if not early_sum:
      l = l + self.rsum(p)
    if not in_place:
      acc = self.rescale(acc, alpha)
    return acc, m_next, l, p16

  def compute(self, step, t, carry, *, masked: bool):
    """The plain loop's step on tile ``t``: ``S = Q K^T``, the softmax,
    then in this consumer's turn ``O += P V``."""
    slot = lax.rem(step, self.stages)
    acc, m_next, l, p16 = self.softmax_turn(self.scores(slot), t, carry,
                                            slot, masked=masked)
    acc = self.add_pv(acc, p16, slot)
    self.r.v_free.arrive(slot)
    return acc, m_next, l

  def skip(self, step, carry):
    """A tile only the other consumer needs: observe and release it (the
    ping-pong's hooks as in :meth:`compute`)."""
    r, ping = self.r, self.ctx.ping
    slot = lax.rem(step, self.stages)
    plgpu.barrier_wait(r.k_ready.at[slot])
    r.k_free.arrive(slot)
    if r.bias_smem is not None:  # (its phase observed; freed with V)
      plgpu.barrier_wait(r.bias_ready.at[slot])
    ping.issued()
    plgpu.barrier_wait(r.v_ready.at[slot])
    r.v_free.arrive(slot)
    ping.softmax_done()
    ping.before_pv()
    return carry

  def next_item_turn(self, acc, m, l, p_src, slot, *, turn_start: bool):
    """``item_overlap``, an item with a next one: its last ``P V`` (tile
    ``slot``'s V, ``P`` from ``p_src``) and the next item's first ``S``
    in one turn, this item's epilogue while that ``S`` is computed (``P
    V`` waited for alone).  ``turn_start``: the turn (and the wait for V)
    starts here, as in the overlapped loop; the plain loop's
    :meth:`softmax_turn` has started it already.  Returns ``S``; its K
    slot released."""
    r, ping, bq, bk = self.r, self.ctx.ping, self.bq, self.bk
    double_q = self.ctx.double_q
    nxt = lax.rem(self.first_step + (self.u_hi - self.u_lo), self.stages)
    q_next = r.qo_smem2.at[self.next_q_slot]
    if turn_start:
      plgpu.barrier_wait(r.v_ready.at[slot])

    def issue(o_acc, s_acc):
      if turn_start:
        ping.turn_start()
      # The next item's Q and first K are waited for in this turn: with
      # one Q buffer that Q loads after both consumers' "done with Q",
      # which the other consumer signals after its own turn ends (in the
      # interpreter's mbarrier form that end is a rendezvous with this
      # turn's start: a wait before it would never end).  With one
      # buffer the last P V goes first, so the tensor cores are not idle
      # while Q lands (ptxas then fences the second wgmma after the
      # waits: its C7519 note); with two, Q landed an item ago and both
      # are issued back to back.
      last_pv = lambda: plgpu.wgmma(o_acc, p_src, self.v_operand(slot))
      if not double_q:
        last_pv()
      plgpu.barrier_wait(r.q_ready.at[self.next_q_slot])
      plgpu.barrier_wait(r.k_ready.at[nxt])
      if double_q:
        last_pv()
      plgpu.wgmma(s_acc, q_next, r.k_smem.at[nxt].T)  # next item's S
      ping.issued()

    if self.ctx.in_place:
      def body(refs):
        o_acc, s_ref = refs

        def with_s(s_acc):  # a fresh accumulator: nothing to load
          issue(o_acc, s_acc)
          o = plgpu.wgmma_accumulator_load(o_acc, wait_n=1)
          r.v_free.arrive(slot)
          self.epilogue(o, m, l)  # the next S still in flight
          return s_acc[...]
        s_ref[...] = pl.run_scoped(
            with_s, plgpu.ACC((bq, bk), jnp.float32))

      zeros_s = plgpu.layout_cast(jnp.full((bq, bk), 0.0, jnp.float32),
                                  plgpu.Layout.WGMMA)
      _, s_next = pl.run_state(body)((plgpu.ACC.init(acc), zeros_s))
    else:  # interpretable form: fresh accumulators
      def both(o_acc, s_acc):
        issue(o_acc, s_acc)
        o = acc + o_acc[...]
        r.v_free.arrive(slot)
        self.epilogue(o, m, l)
        return s_acc[...]

      s_next = pl.run_scoped(
          both, plgpu.ACC((bq, self.prob.head_dim_padded), jnp.float32),
          plgpu.ACC((bq, bk), jnp.float32))
    r.k_free.arrive(nxt)
    return s_next

  def epilogue(self, acc, m, l):
    """Normalise this consumer's rows of the item and store them and
    their LSE."""
    cfg, r, bq = self.cfg, self.r, self.bq
    l = finish_row_sum(l, deferred=self.deferred_sum)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    if self.v_dequant is not None:  # FP8: v_scale / l per row
      acc = acc * lax.broadcast_in_dim(self.v_dequant / l_safe, acc.shape,
                                       [0])
    elif cfg.lean_epilogue:
      # One reciprocal per row (2 per thread) and a multiply per
      # element, as tokamax, against a divide per element (128 per
      # thread at head_dim 256); both round within an ulp of float32,
      # far below the output's bf16/fp16 rounding.
      acc = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
    else:
      acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    out = acc.astype(self.ctx.out_dtype)
    # Natural-log LSE, -inf for rows that see no key (traced where it
    # is stored).
    lse = lambda: jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
    self.store(out, r.o.at[self.b, pl.ds(self.q_start, bq), self.h], lse,
               r.lse.at[self.b, self.h, pl.ds(self.q_start, bq)])
    # Persistent: the next item may rewrite these buffers (Q/O's, or
    # with prefetch_q the output slots and the LSE) once the stores
    # have read them (their GMEM writes finish in the background; the
    # kernel's last wait is a full one unless lean_epilogue).
    # lean_epilogue: only the shared-memory reads are waited for (as
    # tokamax and JAX's Hopper matmul end their kernels); the grid's
    # completion publishes the writes.
    plgpu.wait_smem_to_gmem(
        0, wait_read_only=self.ctx.persistent or cfg.lean_epilogue)

  def store(self, out, o_dst, lse, lse_dst):
    """The epilogue's copies of ``out`` (this consumer's rows in the
    input dtype) to ``o_dst`` and of ``lse()`` to ``lse_dst``."""
    r, wg = self.r, self.ctx.wg
    if r.o_smem2 is not None:
      # Column chunks (64 wide, or the swizzle's width) through
      # alternating slots: a slot is rewritten once the copy that last
      # read it has (at most slots - 1 copies of this consumer still
      # reading).
      w, n_chunks, slots = self.cfg.out_chunks(self.prob.head_dim_padded)
      for c in range(n_chunks):
        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
        r.o_smem2[wg, c % slots] = out[:, c * w:(c + 1) * w]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(r.o_rows2.at[wg, c % slots],
                                o_dst.at[:, pl.ds(c * w, w)])
    else:
      self.qo_smem[...] = out
    self.lse_smem[...] = lse()
    plgpu.commit_smem()
    if r.o_smem2 is None:
      plgpu.copy_smem_to_gmem(self.qo_rows, o_dst)
    plgpu.copy_smem_to_gmem(self.lse_smem, lse_dst)


# ---------------------------------------------------------------------------
# The main loops over an item's key tiles.


def _plain_loop(it: _Item, own, carry):
  """The default loop: per key tile ``Q K^T``, the softmax, then in this
  consumer's turn on the tensor cores ``O += P V``
  (:meth:`_Item.compute`); with two consumers their turns alternate
  (FlashAttention-3's ping-pong, arXiv 2407.08608 §3.1), so one's softmax
  runs under the other's matmuls.  Tiles that only the other consumer of
  the program needs are acknowledged (:meth:`_Item.skip`); the tiles
  outside this consumer's fully visible range take the element mask
  (:func:`pipeline.tile_loop`).  Returns ``(acc, m, l)``."""
  return pipeline.tile_loop(
      it.u_lo, it.u_hi, own, first_step=it.first_step,
      compute=it.compute, skip=it.skip,
      element_mask_everywhere=it.everywhere, carry=carry)


def _chained_loop(it: _Item, own, carry):
  """``item_overlap`` without ``intra_wg_overlap``: the default loop
  (:meth:`_Item.compute`'s steps) run on across the program's work
  items.  An item's last turn issues its last ``P V`` and the next
  item's first ``Q K^T`` (:meth:`_Item.next_item_turn`), and its
  epilogue runs while they compute, so the other consumer's last ``P V``
  (which waits for that ``Q K^T``) and this epilogue overlap; the next
  item starts from that ``S``.  Every consumer computes every tile of
  every item, ``[u_lo, u_hi)``, with no skip steps: this relies on
  :func:`_chains_items` (a consumer skipping tiles here would hang the
  ring, not fail), and each consumer takes the same steps as in one long
  item: the alternation's counts are those of one item (``ping.start``
  before the program's first, ``ping.finish`` after its last).  "Done
  with Q" comes once the item's last ``S`` is read back, before that
  turn, and the producer loads the next Q before the next item's K/V.
  The first and last tiles take the element mask where they are not
  fully visible (a ``lax.cond``; the middle ones as
  :func:`pipeline.tile_loop` runs them).  Returns the next item's first
  ``S`` (zeros after the last item)."""
  u_lo, u_hi, item, chain = it.u_lo, it.u_hi, it.item, it.chain
  _, full_lo, full_hi, _ = pipeline.computed_tiles(
      u_lo, u_hi, own, it.everywhere)
  auto = (full_lo, full_hi)
  slot_of = it.slot_of

  # "Done with Q" once the item's last S is read back, before this
  # consumer's turn starts: with one Q buffer the other consumer's last
  # turn waits (for this consumer's next Q K^T) behind the load of the
  # next Q, which waits for it.
  done_with_q = lambda: plgpu.barrier_arrive(it.q_done)
  # From item 1 on, the first S was issued in the item before's turn.
  s0 = lax.cond(item > 0, lambda: chain[0],
                lambda: it.scores(slot_of(u_lo)))
  pl.when(u_hi - u_lo == 1)(done_with_q)
  acc, m, l, p16 = it.softmax_turn(s0, u_lo, carry, slot_of(u_lo),
                                   masked=auto)

  def more(acc, m, l, p16):
    """Tile u_lo's P V, the middle tiles, the last one's softmax."""
    acc = it.add_pv(acc, p16, slot_of(u_lo))
    it.r.v_free.arrive(slot_of(u_lo))
    last = u_hi - 1
    acc, m, l = _masked_ranges(
        u_lo + 1, last, full_lo, full_hi,
        lambda t, c, masked: it.compute(it.step_of(t), t, c, masked=masked),
        (acc, m, l))
    s = it.scores(slot_of(last))
    done_with_q()
    return it.softmax_turn(s, last, (acc, m, l), slot_of(last), masked=auto)

  acc, m, l, p16 = lax.cond(u_hi - u_lo > 1, more, lambda *c: c,
                            acc, m, l, p16)
  slot = slot_of(u_hi - 1)

  def final(acc, m, l, p16):
    """The program's last item: the plain last P V, the end of the
    alternation, the epilogue."""
    acc = it.add_pv(acc, p16, slot)
    it.r.v_free.arrive(slot)
    it.ctx.ping.finish()
    it.epilogue(acc, m, l)
    return plgpu.layout_cast(jnp.full((it.bq, it.bk), 0.0, jnp.float32),
                             plgpu.Layout.WGMMA)

  return lax.cond(
      item + 1 < chain[1],
      lambda *c: it.next_item_turn(*c[:3], it.p_operand(c[3]), slot,
                                   turn_start=False),
      final, acc, m, l, p16)


def _overlapped_loop(it: _Item, own, carry):
  """``intra_wg_overlap`` (FlashAttention-3 §3.2, arXiv 2407.08608,
  hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp): in its turn on the tensor
  cores a consumer issues ``S_t = Q K_t^T`` and ``O += P_{t-1} V_{t-1}``
  back to back, hands the turn to the other consumer, and runs tile
  ``t``'s softmax while its ``P V`` is still in flight
  (:func:`_overlapped_step`).  The tensor cores then always hold the next
  turn's two matmuls queued behind the current ones: no consumer waits
  for its ``P V`` before the other may issue (the default loop's turn is
  ``P V`` and then, after waiting for it, the next ``Q K^T``).  A
  prologue computes ``P`` of the first own tile (its ``Q K^T`` turn
  alone), an epilogue adds the last ``P V`` (a turn of ``P V`` alone);
  both run only when this consumer has tiles (``lax.cond``).  The turns
  are the ping-pong's ``turn_start`` / ``issued`` hooks, in the same
  alternation as :class:`_PingPong`'s other users, so the skip steps
  around the own tiles interleave as in :func:`pipeline.tile_loop`.

  ``item_overlap`` (``chained``): the loop runs on across the program's
  work items.  The last turn of an item issues its last ``P V`` and the
  next item's first ``Q K^T`` back to back (that ``Q`` and ``K`` waited
  for first), the item's epilogue runs while that ``S`` is computed, and
  the next item starts from it: the turns keep one alternation from the
  program's first item to its last (``ping.start`` before the first,
  ``ping.finish`` after the last).  Every consumer then computes every
  tile of every item (:func:`_chains_items`).  Returns that next ``S``
  (the epilogue already run) instead of ``(acc, m, l)``.  The counts:
  with ``S`` a turn's start (``turn_start``: a sync on this consumer's
  barrier) and ``A`` its end (``issued``: an arrival on the other's), a
  middle item of N key tiles is ``(S A)^N`` for either consumer (its
  first ``Q K^T`` lies in the item before); the program's first item has
  one ``A`` more (its first ``Q K^T``, a turn of its own: with ``start``,
  consumer 1's extra ``S``) and its last item one ``A`` less (the last
  ``P V`` alone: ``finish``, consumer 0's extra arrival), so the two
  barriers' arrivals match as in the per-item form."""
  ctx, r, ping = it.ctx, it.r, it.ctx.ping
  u_lo, u_hi, first_step = it.u_lo, it.u_hi, it.first_step
  acc, m, l = carry
  lo, full_lo, full_hi, hi = pipeline.computed_tiles(
      u_lo, u_hi, own, it.everywhere)
  slot_of = it.slot_of
  run = lambda a, z, fn, c: lax.fori_loop(a, z, fn, c)
  run(u_lo, lo, lambda t, c: it.skip(first_step + t - u_lo, c), ())
  wgmma_layout = plgpu.Layout.WGMMA
  zeros_s = plgpu.layout_cast(jnp.full((it.bq, it.bk), 0.0, jnp.float32),
                              wgmma_layout)

  def first(_):
    # scores(): the turn is this Q K^T alone (ends with ping.issued).
    if ctx.chained:  # from item 1 on, issued in the item before's turn
      s0 = lax.cond(it.item > 0, lambda: it.chain[0],
                    lambda: it.scores(slot_of(lo)))
    else:
      s0 = it.scores(slot_of(lo))
    p, m1, alpha = it.probs(s0, lo, m, masked=True)
    l1 = l * alpha + it.rsum(p)
    return it.stash(it.dropped(p, lo)), m1, l1

  def nothing(_):
    if r.p_smem2 is not None:
      return jnp.int32(0), m, l
    layout = plgpu.Layout.WGMMA_8BIT if it.prob.fp8 else wgmma_layout
    return (plgpu.layout_cast(jnp.full((it.bq, it.bk), 0.0, ctx.p_dtype),
                              layout), m, l)

  p16, m, l = lax.cond(lo < hi, first, nothing, None)
  # Steps lo + 1 .. hi - 1.
  acc, m, l, p16 = _masked_ranges(
      jnp.minimum(lo + 1, hi), hi, full_lo, full_hi,
      functools.partial(_overlapped_step, it, zeros_s), (acc, m, l, p16))

  def last(acc):
    slot = slot_of(hi - 1)
    plgpu.barrier_wait(r.v_ready.at[slot])
    ping.turn_start()  # a turn of the last P V alone
    acc = it.add_pv(acc, p16, slot, p_src=it.stashed(p16))
    r.v_free.arrive(slot)
    return acc

  def final_last(acc, m, l):
    """``chained``, the program's last item: the plain last turn, the end
    of the alternation, the epilogue."""
    acc = last(acc)
    ping.finish()
    it.epilogue(acc, m, l)
    return zeros_s

  def chained_last(acc, m, l):
    """``chained``, an item with a next one: the last ``P V`` and the
    next item's first ``S`` in one turn (:meth:`_Item.next_item_turn`).
    Returns ``S``."""
    return it.next_item_turn(acc, m, l, it.stashed(p16), slot_of(hi - 1),
                             turn_start=True)

  if ctx.early_q_release or ctx.chained:
    # Every own S (the last one included) has been read back: Q is not
    # read again in this item, so its buffer may be refilled while the
    # last P V runs.
    plgpu.barrier_arrive(it.q_done)
  if ctx.chained:
    return lax.cond(it.item + 1 < it.chain[1], chained_last, final_last,
                    acc, m, l)
  acc = lax.cond(lo < hi, last, lambda acc: acc, acc)
  run(hi, u_hi, lambda t, c: it.skip(first_step + t - u_lo, c), ())
  return acc, m, l


def _overlapped_step(it: _Item, zeros_s, t, carry, *, masked: bool):
  """:func:`_overlapped_loop`'s step on tile ``t``: one turn issuing
  ``S_t`` and ``P_{t-1} V_{t-1}``, then tile ``t``'s softmax under the
  ``P V``.  ``carry = (acc, m, l, P_{t-1})``."""
  ctx, r, ping = it.ctx, it.r, it.ctx.ping
  acc, m, l, p_prev = carry
  slot, prev = it.slot_of(t), it.slot_of(t - 1)
  # Both operands' tiles are in before the turn starts, so that the turn
  # is the two issues alone (V of t - 1 lands before K of t).
  plgpu.barrier_wait(r.v_ready.at[prev])
  plgpu.barrier_wait(r.k_ready.at[slot])

  def issue(s_acc, o_acc):
    ping.turn_start()
    plgpu.wgmma(s_acc, it.qo_smem, r.k_smem.at[slot].T)  # S_t
    plgpu.wgmma(o_acc, it.stashed(p_prev), it.v_operand(prev))  # P V
    ping.issued()  # the other consumer's turn

  def softmax(s_t, m, l):
    r.k_free.arrive(slot)
    p, m_next, alpha = it.probs(s_t, t, m, masked=masked)
    l = l * alpha + it.rsum(p)
    return p, m_next, l, alpha

  if ctx.in_place:
    def body(refs):
      o_acc, s_acc, m_ref, l_ref, p_ref, a_ref = refs
      issue(s_acc, o_acc)
      # S_t done, P V still in flight: the softmax overlaps it.
      s_t = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
      p_ref[...], m_ref[...], l_ref[...], a_ref[...] = softmax(
          s_t, m_ref[...], l_ref[...])

    o, _, m, l, p, alpha = pl.run_state(body)((
        plgpu.ACC.init(acc), plgpu.ACC.init(zeros_s), m, l, zeros_s, m))
  else:  # interpretable form: a fresh P V accumulator
    def body(s_acc, o_acc):
      issue(s_acc, o_acc)
      return (*softmax(s_acc[...], m, l), o_acc[...])

    p, m, l, alpha, pv = pl.run_scoped(
        body, plgpu.ACC((it.bq, it.bk), jnp.float32),
        plgpu.ACC((it.bq, it.prob.head_dim_padded), jnp.float32))
    o = acc + pv
  r.v_free.arrive(prev)
  # P of this tile is rounded to 16 bits only now, after the wait for
  # P_{t-1} V_{t-1} (as FlashAttention-3 converts after its
  # warpgroup_wait<0>): that wgmma reads P_{t-1} from registers while it
  # runs, and a conversion issued before the wait may be written into
  # those same registers (the compiler sees P_{t-1} dead once the wgmma
  # is issued).  ptxas then serialises the wgmmas (its C7513 note).
  acc = it.rescale(o, alpha)
  return acc, m, l, it.stash(it.dropped(p, t))


# ---------------------------------------------------------------------------
# The producer: one work item's K/V tiles (and Q) into shared memory.


def _produce(ctx: _Ctx, b, h, u_lo, n_steps, first_step, group_start=None,
             item=None, gap=None):
  """One work item on the producer: its K/V tiles into the ring (and
  with ``prefetch_q`` its consumers' Q, item number ``item``), the tiles
  of ``gap`` skipped."""
  prob, cfg, r = ctx.prob, ctx.cfg, ctx.r
  bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
  kv_head = lax.div(h, jnp.asarray(prob.num_heads // prob.num_kv_heads,
                                   h.dtype))

  def key_start(step):  # the first key of the step's tile
    return pipeline.key_start(gap, u_lo + step, bk)

  def rows(step):
    return (b, pl.ds(key_start(step), bk), kv_head)

  def copy(ref, smem, ready, src, slot):
    # kv_multicast: each CTA of the cluster issues half of the tile into
    # both CTAs' slot; each CTA's ready barrier expects the whole tile.
    plgpu.copy_gmem_to_smem(
        ref.at[src], smem.at[slot], ready.at[slot],
        collective_axes="cluster" if ctx.cluster > 1 else None)

  def load_bias(step, slot):
    # The item's rows (both consumers') of key tile u_lo + step.
    plgpu.copy_gmem_to_smem(
        r.bias.at[b if prob.bias_batched else 0,
                  h if prob.bias_per_head else 0,
                  pl.ds(group_start, cfg.compute_wgs * bq),
                  pl.ds(key_start(step), bk)],
        r.bias_smem.at[slot], r.bias_ready.at[slot])

  load_k = lambda step, slot: copy(r.k, r.k_rows, r.k_ready, rows(step), slot)

  def load_v(step, slot):  # (with a bias, its tile beside V)
    if prob.fp8:  # V^T's columns of key tile u_lo + step
      src = (b, kv_head, slice(None), pl.ds(key_start(step), bk))
    else:
      src = rows(step)
    copy(r.v, r.v_rows, r.v_ready, src, slot)
    if r.bias_smem is not None:
      load_bias(step, slot)

  def load(step, slot):  # K and V together
    load_k(step, slot)
    load_v(step, slot)

  if cfg.intra_wg_overlap:
    # K and V of a slot refilled apart, each once its own consumers
    # released it (tokamax's order): V of step t is released a step
    # later than K (its P V matmul runs in step t + 1); with one wait
    # per slot for both, K of step s would wait for V of step s -
    # stages, released at the end of step s - 1: no lead.
    loads = [([r.k_free], load_k), ([r.v_free], load_v)]
  else:
    loads = [([r.k_free, r.v_free], load)]
  if ctx.prefetch:
    # The first item's Q goes first.  A later item's Q waits until both
    # consumers are done with the previous one: first the K/V tiles
    # whose slots free up before that (they are freed during the
    # previous item's last steps), then Q, then the rest.
    # early_q_release: "done with Q" comes once the last S is read back,
    # before the last P V frees the last V slot, so Q goes first (with
    # the previous order its load would still wait for that slot).
    # q_double_buffer: the buffer this item's Q goes to was read by the
    # item before last, long done, so Q goes first and waits for nothing
    # in practice; the first K/V tiles follow as their slots free up.
    head = (0 if ctx.early_q_release or ctx.double_q or ctx.chained else
            jnp.where(item == 0, 0, jnp.minimum(n_steps, stages)))
    pipeline.produce_continuing(first_step, head, stages, loads)
    # The buffer was last read by the item before (two before with
    # q_double_buffer).
    _, q_done = ctx.q_buffer(item, 0)
    pl.when(item > (1 if ctx.double_q else 0))(
        lambda: plgpu.barrier_wait(q_done))
    for w in range(cfg.compute_wgs):
      q_slot, _ = ctx.q_buffer(item, w)
      plgpu.copy_gmem_to_smem(
          r.q.at[b, pl.ds(group_start + w * bq, bq), h],
          r.q_rows2.at[q_slot], r.q_ready.at[q_slot])
    pipeline.produce_continuing(first_step, n_steps, stages, loads,
                                start=head)
  elif ctx.persistent:
    pipeline.produce_continuing(first_step, n_steps, stages, loads)
  else:
    pipeline.produce_split(n_steps, stages, loads)


# ---------------------------------------------------------------------------
# The kernel.


def _kernel(*refs, prob: Problem, cfg: MosaicConfig, dtype, in_place: bool,
            n_programs: int | None, cluster: int, rows: RowCopies):
  """The forward kernel (one program): the producer warpgroup streams
  each work item's K/V tiles (:func:`_produce`), each consumer warpgroup
  computes its rows of the item (:class:`_Item`); :class:`_Schedule`
  says which items the program runs."""
  r = _Refs.unpack(refs, prob, cfg, cluster, rows)
  persistent = n_programs is not None
  sched = _Schedule(prob, cfg, n_programs, cluster, r.seg_range)
  stages = cfg.stages
  if not persistent:  # one program per (head, query group, batch)
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  ping = _PingPong(r.schedule, wg, named=cfg.named_barriers,
                   persistent=persistent)
  if not persistent:
    group_start, u_lo, u_hi, gap = sched.plain_item(b)
    n_steps = u_hi - u_lo
  ctx = _Ctx(prob, cfg, dtype, in_place=in_place, refs=r, wg=wg, ping=ping,
             persistent=persistent, cluster=cluster)

  @pl.when(wg < cfg.compute_wgs)
  def _consumer():
    pipeline.split_registers(False, cfg.compute_wgs, cfg.consumer_registers)
    if persistent:
      if ctx.chained:  # S of each next item's first tile runs on
        zeros_s = plgpu.layout_cast(
            jnp.full((cfg.block_q, cfg.block_kv), 0.0, jnp.float32),
            plgpu.Layout.WGMMA)
        sched.for_each_item(
            lambda item, *args, extra, n_items: _Item(
                ctx, *args, item=item, chain=(extra, n_items)).run(),
            extra=zeros_s)
      else:
        sched.for_each_item(
            lambda item, *args: _Item(ctx, *args, item=item).run())
      plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.lean_epilogue)
    else:
      _Item(ctx, b, h, group_start, u_lo, u_hi, 0, gap).run()

  @pl.when(wg == cfg.compute_wgs)
  def _producer():
    pipeline.split_registers(True, cfg.compute_wgs, cfg.consumer_registers)
    if persistent:
      total_steps, n_items = sched.for_each_item(
          lambda item, b, h, group_start, u_lo, u_hi, first, gap: _produce(
              ctx, b, h, u_lo, u_hi - u_lo, first, group_start, item, gap))
      pipeline.drain(total_steps, stages, [r.k_free, r.v_free])
      if ctx.double_q:  # the last two items' "done with Q"
        for back in (1, 2):
          pl.when(n_items >= back)(lambda back=back: plgpu.barrier_wait(
              ctx.q_buffer(n_items - back, 0)[1]))
      elif ctx.prefetch:  # the last item's "done with Q"
        pl.when(n_items > 0)(lambda: plgpu.barrier_wait(r.q_free))
    else:
      _produce(ctx, b, h, u_lo, n_steps, 0, group_start, gap=gap)
    if r.exit_barrier is not None:
      # Neither CTA of a cluster exits before the other's producer has
      # drained its ring.  A guard, not a necessity: each drain already
      # observes every arrival on its own CTA's barriers, and every copy
      # into a CTA was waited for by its consumers (CUTLASS's producer
      # tail does the same).  One barrier per CTA; the form the GPU
      # tests ran.
      plgpu.barrier_arrive(r.exit_barrier)
      plgpu.barrier_wait(r.exit_barrier)


# ---------------------------------------------------------------------------
# The forms a config takes on a call, the ping-pong, the launch.


def _paired(cfg: MosaicConfig, prob: Problem) -> bool:
  """Whether the persistent grid deals out pairs of query groups
  (:attr:`MosaicConfig.persistent_pairs`, causal calls only)."""
  return cfg.persistent and cfg.persistent_pairs and prob.mask.causal


def _double_q(cfg: MosaicConfig, prob: Problem) -> bool:
  """Whether the forward keeps two Q buffers per consumer
  (:attr:`MosaicConfig.q_double_buffer`; not with persistent pairs)."""
  return (cfg.prefetches_q and cfg.q_double_buffer
          and not _paired(cfg, prob))


def _chains_items(cfg: MosaicConfig, prob: Problem) -> bool:
  """Whether the forward's loop runs on across work items
  (:attr:`MosaicConfig.item_overlap`, on the persistent grid with the Q
  prefetch).  Every consumer must then compute every key tile of every
  item: calls without a causal mask, window or segment ids, on which no
  consumer's query rows are all padding.  The overlapped loop
  (``intra_wg_overlap``) also needs the two consumers' ping-pong and the
  next Q loadable before the item's last turn (``early_q_release`` or
  ``q_double_buffer``); the plain one (:func:`_chained_loop`) signals
  "done with Q" before that turn itself."""
  mask = prob.mask
  uniform = (not mask.causal and mask.window_left is None
             and mask.window_right is None and not prob.has_segments
             and mask.q_len > prob.q_pad - cfg.block_q)
  if not (cfg.item_overlap and cfg.prefetches_q and uniform):
    return False
  if cfg.intra_wg_overlap:
    return bool(_use_schedule(cfg)
                and (cfg.early_q_release or _double_q(cfg, prob)))
  return True


def _cluster_size(cfg: MosaicConfig, prob: Problem, n_groups: int) -> int:
  """CTAs per cluster: 2 with :attr:`MosaicConfig.kv_multicast` where
  both query groups of a cluster stream the same key tiles (no causal
  mask, window or segment ids: every group's key range is the whole
  sequence; no dense bias, whose tiles are each group's own) and the
  groups pair up; 1 otherwise.

  Also 1 with two or three consumers and no ping-pong schedule.  A
  cluster barrier takes one arrival per warpgroup, from its first warp
  (Mosaic GPU's collective arrive), where a CTA-local mbarrier takes
  every thread's.  So a consumer that only acknowledges a step (no
  warpgroup-wide wgmma keeps its warps together) could release the slot
  before its other warps have waited for it.  With the ping-pong every
  step passes a two-warpgroup barrier; one consumer never skips."""
  mask = prob.mask
  uniform = (not mask.causal and mask.window_left is None
             and mask.window_right is None and not prob.has_segments
             and not prob.has_bias)
  in_step = cfg.compute_wgs == 1 or _use_schedule(cfg)
  return (2 if cfg.kv_multicast and uniform and in_step
          and n_groups % 2 == 0 else 1)


# K/V bytes a section of the causal persistent order keeps in L2
# (FlashAttention-3's LPT scheduler takes 32 MiB of the H100's 50).
LPT_L2_BYTES = 32 * 1024 * 1024


# Above this ratio of the busiest program's causal work to the mean the
# heads-first order gives way to the LPT order whatever the config says
# (1.83 for GPT-2 small's 12 heads x 11 groups on 132 programs, which ran
# 1.47x slower than LPT on the H100; 1.11-1.28 where the two measured
# level or heads-first ahead:
# docs/benchmarks/h100-2026-12-07-cb6ac25-causal-order.md).
MAX_HEADS_FIRST_IMBALANCE = 1.5


def _heads_first_imbalance(pairs: int, heads: int, units: int,
                           n_programs: int) -> float:
  """The busiest program's share of causal work over the mean in the
  heads-first persistent order (unit ``w`` to program ``w % n_programs``,
  its query group ``(w // heads) % units`` counted from the longest, a
  group's work taken as its key tiles: ``units - group``)."""
  w = np.arange(pairs * units)
  cost = units - (w // heads) % units
  per_program = np.bincount(w % min(n_programs, w.size), weights=cost)
  return float(per_program.max() / per_program.mean())


def _lpt_section(prob: Problem) -> int:
  """(batch, head) pairs per section of the causal persistent order
  (:meth:`_Schedule.unit_coords`): as many whole key/value heads' query
  heads as fit :data:`LPT_L2_BYTES` of K and V (at least one)."""
  group = prob.num_heads // prob.num_kv_heads
  per_kv_head = 2 * prob.kv_pad * prob.head_dim_padded * 2  # K, V; bf16
  kv_heads = max(1, LPT_L2_BYTES // per_kv_head)
  return kv_heads * group


def _units_per_bh(cfg: MosaicConfig, prob: Problem, n_groups: int) -> int:
  """Work units per (batch, head) on the persistent grid: its query
  groups, or with :func:`_paired` pairs of them (an odd count's middle
  group alone), or with :func:`_cluster_size` 2 pairs of adjacent ones
  (one per CTA of a cluster)."""
  if _paired(cfg, prob):
    return (n_groups + 1) // 2
  return n_groups // _cluster_size(cfg, prob, n_groups)


# The persistent grid's program count in the interpreter.
INTERPRET_PROGRAMS = 2


class _PingPong:
  """The two consumers' alternation (FlashAttention-3's ping-pong,
  arXiv 2407.08608 §3.1): a consumer's ``P V`` waits until the other has
  issued its ``Q K^T``, so one's softmax runs while the other's matmuls
  hold the tensor cores.  Consumer 1 starts half a step behind.

  * mbarrier form (interpretable): one barrier of two arrivals used as a
    rendezvous after each ``Q K^T`` and around the wait for V.
  * ``named_barriers``: tokamax's sm90 form, two hardware named barriers
    (ids ``FIRST_NAMED_BARRIER + {0, 1}``, 256 threads): after issuing
    ``Q K^T`` a consumer arrives at the other's barrier, before ``P V``
    it syncs on its own.

  With no schedule barrier (``barrier`` None: one consumer, or
  ``schedule_barrier=False``) every hook is a no-op.
  """

  def __init__(self, barrier, wg, *, named: bool, persistent: bool):
    self.barrier, self.wg, self.named = barrier, wg, named
    self.persistent = persistent
    self.base = pipeline.FIRST_NAMED_BARRIER

    def rendezvous():
      plgpu.barrier_arrive(barrier)
      plgpu.barrier_wait(barrier)
    # One function object for every use, so that its traced body is shared.
    self._rendezvous = rendezvous

  def turn_start(self):
    """Before this consumer's turn on the tensor cores that is not the
    default loop's ``P V`` (``intra_wg_overlap``'s loop): the same
    barrier operations as the default step's ``softmax_done`` and
    ``before_pv``, so both loops keep one alternation."""
    self.softmax_done()
    self.before_pv()

  def issued(self):
    """After this consumer issued its ``Q K^T``."""
    if self.barrier is None:
      return
    if self.named:
      pipeline.named_barrier("arrive", self.base + 1 - self.wg, 256)
    else:
      self._rendezvous()

  def softmax_done(self):
    if self.barrier is not None and not self.named:
      plgpu.barrier_arrive(self.barrier)

  def before_pv(self):
    """Before this consumer issues its ``P V``: the tensor cores' turn."""
    if self.barrier is None:
      return
    if self.named:
      pipeline.named_barrier("sync", self.base + self.wg, 256)
    else:
      plgpu.barrier_wait(self.barrier)

  def start(self):
    """Consumer 1 waits for consumer 0's first ``Q K^T``."""
    if self.barrier is None:
      return
    if self.named:
      pl.when(self.wg == 1)(
          lambda: pipeline.named_barrier("sync", self.base + 1, 256))
    else:
      pl.when(self.wg == 1)(self._rendezvous)

  def finish(self):
    """Consumer 0 balances consumer 1's extra wait from :meth:`start`.

    Named form, persistent grid: consumer 0 syncs (not just arrives) on
    consumer 1's barrier, as tokamax does.  A bare arrive would let it run
    into the next work item and arrive there again before consumer 1's
    last sync of this item: 256 arrivals from consumer 0 alone would
    complete the barrier's generation, and both consumers would then wait
    forever.  With one item per program nothing follows, and an arrive
    suffices."""
    if self.barrier is None:
      return
    if self.named:
      op = "sync" if self.persistent else "arrive"
      pl.when(self.wg == 0)(
          lambda: pipeline.named_barrier(op, self.base + 1, 256))
    else:
      pl.when(self.wg == 0)(self._rendezvous)


def _masked_ranges(start, stop, full_lo, full_hi, step, carry):
  """``step(t, carry, masked=...)`` for ``t`` in ``[start, stop)``, with
  the element mask outside the fully visible tiles ``[full_lo,
  full_hi)`` (three ``fori_loop``s)."""
  a = jnp.clip(full_lo, start, stop)
  z = jnp.clip(full_hi, a, stop)
  for r0, r1, masked in ((start, a, True), (a, z, False), (z, stop, True)):
    carry = lax.fori_loop(r0, r1, functools.partial(
        lambda masked, t, c: step(t, c, masked=masked), masked), carry)
  return carry


def _use_schedule(cfg: MosaicConfig) -> bool:
  return cfg.schedule_barrier and cfg.compute_wgs == 2


def forward(q, k, v, segments=None, alibi=None, bias=None,
            dense_mask=None, dropout_seeds=None, dequant=None, *,
            prob: Problem, cfg: MosaicConfig, interpret=None):
  """Padded ``q [B, T, H, Dp]``, ``k, v [B, S, K, Dp]`` (bf16/fp16) ->
  ``(out [B, T, H, Dp], lse [B, H, prob.q_pad] float32)``.  T and S are
  ``prob.q_pad`` and ``prob.kv_pad``, or with ``unpadded_q`` /
  ``unpadded_kv`` any multiple of 8 up to them (the TMA copies zero-fill
  the rows past the arrays and the store of O drops them), or where
  :func:`row_copies` says so the lengths themselves.

  ``segments``: ``(q_seg, kv_seg, seg_range)`` when ``prob.has_segments``,
  and the FlashMask columns ``[B, n, Sp]`` after them with
  ``prob.has_flash_mask``.  ``alibi``: ALiBi's ``[B, H, 2]`` float32
  (the slopes divided by the softmax scale, the position shifts of
  :func:`jaxflash.masks.alibi_bias`), with ``prob.has_alibi``.
  ``bias``: the dense bias ``[B | 1, H | 1, Tp, Sp]`` in q's dtype (or
  one float32 row ``[B | 1, H | 1, 1, Sp]``: ``prob.bias_rows`` False),
  with ``prob.has_bias``.  ``dense_mask``: int8 ``[B | 1, H | 1, Tp | 1,
  Sp]``, with ``prob.has_dense_mask``.  ``dropout_seeds``: ``[B, H +
  2]`` int32, with ``prob.dropout_rate`` (:attr:`Problem.dropout_rate`).
  ``dequant``: with ``prob.fp8`` (q, k float8_e4m3fn, ``v`` transposed
  ``[B, K, Dp, S]``), the ``[H, 2]`` float32 dequantization table.
  """
  dtype = q.dtype
  itemsize = jnp.dtype(dtype).itemsize
  out_dtype = prob.out_dtype if prob.fp8 else dtype
  dp = prob.head_dim_padded
  bq, bk = cfg.block_q, cfg.block_kv
  # Q K^T contracts over the head_dim: the widest swizzle that divides it
  # (128 bytes at multiples of 64 (FP8: 128), narrower at the forward's
  # own 80, 96).
  tiled = pipeline.tiled_over(dp, itemsize)
  rows = row_copies(prob, cfg, q.shape[1], k.shape[1], interpret)
  tile = pipeline.TMA_ROW_TILE
  for name, x, whole, by_rows in (("q", q, prob.q_pad, rows.q),
                                  ("k", k, prob.kv_pad, rows.kv)):
    n = x.shape[1]
    if n > whole or not (by_rows or n % tile == 0):
      raise ValueError(f"forward: {name} has {n} rows; the kernel takes a"
                       f" multiple of {tile} up to {whole}, or with row"
                       f" copies (row_copies) any length up to it")
  if prob.fp8:
    # V^T's tiles [Dp, block_kv] and P [block_q, block_kv] in e4m3: P V
    # contracts over the keys, both K-major, in one swizzle.
    pv_tiled = pipeline.tiled_over(bk, 1)
    v_smem = plgpu.SMEM((cfg.stages, dp, bk), v.dtype, **pv_tiled)
    p_smem = plgpu.SMEM((cfg.compute_wgs, bq, bk), jnp.float8_e4m3fn,
                        **pv_tiled)
  else:
    # V: P V contracts over its bk rows, and its tiling runs along the
    # head_dim: a swizzle that divides both (narrower where bk or the
    # head_dim is not a multiple of 64).  P, V's partner in P V: wgmma
    # takes both in one swizzle.
    pv_tiled = pipeline.tiled_over(math.gcd(bk, dp))
    v_smem = pipeline.operand_buffer((cfg.stages, bk, dp), dtype, pv_tiled,
                                     rows.kv)
    p_smem = plgpu.SMEM((cfg.compute_wgs, bq, bk), dtype, **pv_tiled)
  n_groups = prob.q_pad // (cfg.compute_wgs * bq)
  cluster = _cluster_size(cfg, prob, n_groups)
  # kv_multicast: a slot is free once the consumers of both CTAs of the
  # cluster released it (each arrival lands in both CTAs' barrier).
  free_barrier = (plgpu.Barrier if cluster == 1 else functools.partial(
      plgpu.ClusterBarrier, collective_axes=("cluster",)))
  q_bufs = 2 if _double_q(cfg, prob) else 1
  scratch = [
      pipeline.operand_buffer((q_bufs * cfg.compute_wgs, bq, dp), dtype,
                              tiled, rows.q),
      pipeline.operand_buffer((cfg.stages, bk, dp), k.dtype, tiled, rows.kv),
      v_smem,
      plgpu.SMEM((cfg.compute_wgs, bq), jnp.float32),
      plgpu.Barrier(num_barriers=cfg.stages),             # k_ready (TMA)
      plgpu.Barrier(num_barriers=cfg.stages),             # v_ready (TMA)
      plgpu.Barrier(num_barriers=q_bufs * cfg.compute_wgs),  # q_ready
      free_barrier(num_arrivals=cfg.compute_wgs,
                   num_barriers=cfg.stages),              # k_free
      free_barrier(num_arrivals=cfg.compute_wgs,
                   num_barriers=cfg.stages),              # v_free
  ]
  if prob.bias_ring:
    # The bias tiles of both consumers' rows, a ring beside the K/V slots
    # (tokamax's layout), read back in the wgmma layout of S.  A slot's
    # tile is read in the softmax, before its P V, so V's release frees
    # it too: no barrier of its own for that.
    scratch += [
        plgpu.SMEM((cfg.stages, cfg.compute_wgs * bq, bk), dtype,
                   **pipeline.tiled_over(bk)),
        plgpu.Barrier(num_barriers=cfg.stages),           # bias_ready
    ]
  if cfg.p_in_smem:
    scratch.append(p_smem)
  if cfg.out_slots:
    width, _, slots = cfg.out_chunks(dp)
    scratch.append(pipeline.operand_buffer(                  # O
        (cfg.compute_wgs, slots, bq, width), out_dtype,
        pipeline.tiled_over(width), rows.q))
  if cfg.prefetches_q:
    # q_free (one barrier per Q buffer; a single one is a scalar barrier)
    scratch.append(plgpu.Barrier(num_arrivals=cfg.compute_wgs,
                                 **({"num_barriers": 2} if q_bufs == 2
                                    else {})))
  if _use_schedule(cfg):
    scratch.append(plgpu.Barrier(num_arrivals=cfg.compute_wgs))
  if cluster > 1:  # the producers' rendezvous before the cluster exits
    scratch.append(plgpu.ClusterBarrier(collective_axes=("cluster",)))
  out_type = [out_struct(q.shape, out_dtype, q, k, v),
              out_struct((prob.batch, prob.num_heads, prob.q_pad),
                         jnp.float32, q, k, v)]
  n_programs = None
  # Mosaic GPU launches the last grid axis fastest (blockIdx.x; Pallas
  # reverses the grid for CUDA): batch, then query groups (the longest
  # causal group first), then heads.  kv_multicast: the grid counts
  # clusters, whose two CTAs take adjacent query groups ("q_seq" program
  # p: groups 2p and 2p + 1).
  grid = (prob.num_heads, n_groups // cluster, prob.batch)
  grid_names = ("heads", "q_seq", "batch")
  if cfg.persistent:
    # One program per SM (per cluster of SMs); interpreted runs use
    # INTERPRET_PROGRAMS so that each program loops over several work
    # items.
    units = prob.num_heads * prob.batch * _units_per_bh(cfg, prob, n_groups)
    n_sm = INTERPRET_PROGRAMS if interpret else sm_count() // cluster
    n_programs = min(n_sm, units)
    grid, grid_names = (n_programs,), ("sm",)
  kernel = functools.partial(_kernel, prob=prob, cfg=cfg, dtype=dtype,
                             in_place=not interpret, n_programs=n_programs,
                             cluster=cluster, rows=rows)
  return pipeline.launch(
      kernel, out_type=out_type, scratch=scratch, grid=grid,
      grid_names=grid_names, consumers=cfg.compute_wgs,
      interpret=interpret,
      reduction_scratch_bytes=cfg.fwd_reduction_scratch(
          dp, bias=prob.bias_ring),
      cluster=cluster,
  )(q, k, v, *(segments or ()),
    *(x for x in (alibi, bias, dense_mask, dropout_seeds, dequant)
      if x is not None))
