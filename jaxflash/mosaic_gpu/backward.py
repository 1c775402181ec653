"""Hopper backward kernels in Pallas Mosaic GPU.

FlashAttention-2's backward (arXiv 2307.08691, Algorithm 2) with the
Hopper structure of the forward kernel (arXiv 2407.08608): a producer
warpgroup streams tiles with TMA into a ``bwd_stages``-deep shared-memory
ring, ``bwd_compute_wgs`` consumer warpgroups run ``wgmma`` with float32
accumulators in registers.  Two kernels and no atomics, so gradients are
bitwise reproducible (the default except at head_dim 64 on the H200, and
always with ``deterministic=True``):

* dK/dV: each consumer holds ``bwd_block_kv`` rows of K and V and streams
  the query tiles (``bwd_dkv_block_q`` rows of Q, dO, log-sum-exp and
  delta) of every query head of its key/value head's group, so GQA's
  group sum happens on chip::

      S^T = K Q^T            P^T  = exp2(S^T * scale * log2(e) - lse2)
      dP^T = V dO^T          dS^T = P^T * (dP^T - delta)
      dV += P^T dO           dK  += dS^T Q          (dK *= scale at the end)

* dQ: each consumer holds ``bwd_block_q`` rows of Q and dO and streams K/V
  tiles: ``S = Q K^T``, ``dP = dO V^T``, ``dS = P * (dP - delta)``,
  ``dQ += dS K``.

``P`` is recomputed from the forward's base-2 log-sum-exp (``lse2 = +inf``
for rows that saw no key, so ``P = 0`` there rather than NaN); ``delta =
rowsum(dO * O) - dlse`` is one XLA pass before the kernels.  With
``MosaicConfig.bwd_stats_in_acc`` (the d128 default) the dK/dV kernel
starts the ``S^T`` and ``dP^T`` accumulators at ``-lse2 / (scale
log2(e))`` and ``-delta`` instead of zero, so the wgmmas subtract them:
``P^T = exp2(acc * scale * log2(e))``, ``dS^T = P^T * acc``
(:func:`_stats_init`).  With a soft
cap, ``dS`` is multiplied by ``1 - tanh^2`` (the derivative of ``cap *
tanh(x / cap)``).  Tiles follow the forward's rule: fully masked tiles are
skipped, fully visible ones take no per-element mask
(:meth:`jaxflash.masks.MaskSpec.q_block_range` / ``kv_block_range``).

With ``MosaicConfig.bwd_atomic_dq`` the dQ kernel is not run: the dK/dV
kernel also computes each tile pair's ``dQ_t = dS K`` (``dS^T`` staged in
shared memory is the transposed A operand) and adds it into a zeroed
float32 buffer in global memory with a TMA reduce-add, as FlashAttention-3
does (5 matmuls per tile pair instead of 7; not bitwise reproducible;
the buffer is a ``pl.run_state`` ref, see ``backend.backward``).

Paired forms (head_dim 256, where two consumers of either kernel do not
fit in shared memory): ``bwd_paired_dkv`` splits dK/dV over two
consumers of one key tile, ``bwd_paired_dq`` dQ over two consumers of one
query tile; in both, consumer 0 computes ``P`` and hands it to consumer
1 in shared memory (:func:`_paired_dkv_kernel`, :func:`_paired_dq_kernel`).

``dV``, ``dK`` and ``dQ`` accumulate in long-lived ``plgpu.ACC`` registers
across the loop; ``P`` and ``dS`` feed the second matmuls from registers on
the GPU, or through shared memory with ``p_in_smem`` (the form the Mosaic
GPU interpreter runs).
"""

from __future__ import annotations

import functools
import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxflash._util import out_struct
from jaxflash.mosaic_gpu import pipeline
from jaxflash.mosaic_gpu.config import (
  MosaicConfig,
  vec_slot_rows,
)
from jaxflash.mosaic_gpu.forward import Problem

LOG2E = math.log2(math.e)


def tiled_f32(columns: int) -> dict:
  """A float32 tile's layout (dQ's reduce-add tile, dK/dV partials): 32
  elements a 128-byte swizzled row, or 16 in 64 bytes where 32 does not
  divide the head_dim (80)."""
  cols = 32 if columns % 32 == 0 else 16
  return dict(transforms=(plgpu.TilingTransform((8, cols)),
                          plgpu.SwizzleTransform(4 * cols)))


def _operands_tiled(*contractions: int) -> dict:
  """The one layout of a kernel's 16-bit wgmma operands in shared memory
  (wgmma takes both of a product in one swizzle): the widest swizzle
  that divides every contraction it runs (the head_dim and the tiles'
  rows), since each operand's tiling runs along its head_dim or tile
  columns."""
  return pipeline.tiled_over(math.gcd(*contractions))


def row_copies(prob: Problem, cfg: MosaicConfig, q_len: int, kv_len: int,
               interpret: bool) -> bool:
  """Whether the unpaired backward kernels (:func:`dkv`, :func:`dq`)
  take Q and dO (``q_len`` rows), K and V (``kv_len``) as they are and
  write dQ, dK, dV so, their TMA copies going through row views of the
  buffers (:func:`pipeline.row_buffer`): with ``unpadded_q`` and
  ``unpadded_kv``, at lengths that are not whole tiles, a 16-bit
  head_dim one swizzle wide (64 or less) that divides every tile's
  rows, on the GPU.  dQ's float32 buffer (``bwd_atomic_dq``), the head
  splits' float32 partials and the row vectors stay whole tiles long.
  Elsewhere the operands are padded to whole tiles (an XLA copy of each
  and a slice of each gradient)."""
  dp = prob.head_dim_padded
  return (not interpret and cfg.unpadded_q and cfg.unpadded_kv
          and not (cfg.bwd_paired_dkv or cfg.bwd_paired_dq)
          and pipeline.one_swizzle_wide(dp)
          and all(rows % dp == 0 for rows in (
              cfg.dkv_block_q, cfg.bwd_block_q, cfg.bwd_block_kv))
          and (q_len, kv_len) != (prob.q_pad, prob.kv_pad))


def _check_rows(q, k, prob: Problem, cfg: MosaicConfig, interpret) -> bool:
  """:func:`row_copies` for a kernel's operands ``q``, ``k``, which must
  be whole tiles long (``prob.q_pad``, ``prob.kv_pad``) where it says
  no."""
  rows = row_copies(prob, cfg, q.shape[1], k.shape[1], bool(interpret))
  if not rows and (q.shape[1], k.shape[1]) != (prob.q_pad, prob.kv_pad):
    raise ValueError(
        f"backward: q has {q.shape[1]} rows and k {k.shape[1]}; without"
        f" row copies (row_copies) the kernels take {prob.q_pad} and"
        f" {prob.kv_pad}")
  return rows


ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def _probs(s, lse2, visible, *, prob: Problem, row_axis: int, bias=None):
  """The softmax recompute of one tile, ``P = exp2(S scale log2(e) -
  lse2)`` (FlashAttention-2's ``P = exp(S - L)``, Algorithm 2 of arXiv
  2307.08691, in base 2), float32, from the raw ``q . k`` products ``s``
  and the forward's base-2 log-sum-exp; and ``tanh`` of the soft cap
  (None without one): ``dS`` takes ``1 - th^2``, the derivative of ``cap
  * tanh(x / cap)``.  ``lse2`` is per query; ``row_axis`` says which axis
  of the tile is the query axis (0 in the dQ kernel, 1 in the transposed
  dK/dV kernels).  ``lse2=None``: ``s`` already holds ``q . k - lse2 /
  (scale log2 e)`` (:func:`_stats_init`), so ``P = exp2(s scale log2
  e)``.  ``bias``: the dense bias's tile (float32, in the layout of ``s``),
  added to the scaled logits as the forward added it (the dense bias's
  and ALiBi's;
  no soft cap with it)."""
  if prob.logits_soft_cap is None:
    th = None
    logits2 = s * (prob.softmax_scale * LOG2E)
    if bias is not None:
      logits2 = logits2 + bias * LOG2E
  else:
    cap = prob.logits_soft_cap
    th = jnp.tanh(s * (prob.softmax_scale / cap))
    logits2 = th * (cap * LOG2E)
  if visible is not None:
    logits2 = jnp.where(visible, logits2, -jnp.inf)
  if lse2 is None:
    if th is not None:  # the LSE cannot be folded under tanh
      raise ValueError("a folded LSE (lse2=None) with a soft cap: "
                       f"logits_soft_cap={prob.logits_soft_cap}")
    return jnp.exp2(logits2), th
  p = jnp.exp2(logits2 - lax.broadcast_in_dim(lse2, s.shape, [row_axis]))
  return p, th


def _dscores(p, th, dp, delta, *, row_axis: int, keep=None,
             rate: float = 0.0):
  """``dS = P (dP - delta)`` of one tile (Algorithm 2 of arXiv 2307.08691;
  float32; times ``1 - th^2`` under a soft cap, ``th`` from
  :func:`_probs`), the gradient w.r.t. the scaled logits; ``delta`` is
  per query (None: ``dp`` already holds ``dP - delta``,
  :func:`_stats_init`).  Under attention dropout (``keep``, the tile's
  keep mask, and its ``rate``) ``dP`` is the gradient of the dropped
  probabilities, ``dO V^T`` kept and scaled by ``1 / (1 - rate)``
  (FlashAttention-2's dropout backward; ``delta = rowsum(dO O)`` holds
  as it is)."""
  if keep is not None:
    dp = pipeline.dropped(dp, keep, rate)
  ds = p * (dp if delta is None
            else dp - lax.broadcast_in_dim(delta, p.shape, [row_axis]))
  if th is not None:
    ds = ds * (1.0 - th * th)
  return ds


def _stats_init(prob: Problem, lse_ref, delta_ref, shape, row_axis: int):
  """``bwd_stats_in_acc``: the starting values of one tile's ``S`` and
  ``dP`` accumulators (``(s0, dp0)``, float32, or None where not folded).
  The wgmmas then accumulate ``q . k - lse2 / (scale log2 e)`` and ``dP -
  delta``, the per-query statistics subtracted by the tensor cores'
  float32 additions, so that the per-query vectors are dead before the
  softmax (in the transposed dK/dV tile each is 16 registers per thread,
  one per column a thread holds).  ``lse2 = +inf`` (a query that sees no
  key) starts ``S`` at ``-inf``, so ``P = 0`` as before.  Under a soft
  cap ``P`` takes ``tanh`` of the raw product, so only ``delta`` is
  folded there."""
  def start(ref, scale):
    vec = plgpu.load(ref, layout=COL if row_axis == 1 else ROW)
    return lax.broadcast_in_dim(vec * scale, shape, [row_axis])

  s0 = None
  if prob.logits_soft_cap is None:
    s0 = start(lse_ref, -1.0 / (prob.softmax_scale * LOG2E))
  dp0 = None if delta_ref is None else start(delta_ref, -1.0)
  return s0, dp0


def _scores(s_acc, dp_acc, *, s_operands, dp_operands, s0=None, dp0=None,
            softmax=None, early=None):
  """``S = A B^T`` and ``dP`` (each a wgmma of its two shared-memory
  operands) of one tile pair, in the accumulators ``pl.run_scoped`` gives:
  ``(S, dP)`` (float32).  ``s0`` / ``dp0``: the accumulators' starting
  values (``bwd_stats_in_acc``, :func:`_stats_init`), else zero.

  ``softmax`` (``bwd_softmax_overlap``, FlashAttention-3's order,
  hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp): wait for ``S``'s wgmma alone
  and return ``softmax(S)`` instead of ``S``, computed while ``dP``'s
  wgmma runs; ``early(p)`` (``bwd_early_dv``) then issues a wgmma of
  ``P`` queued behind ``dP``'s before the wait for ``dP``.
  """
  if s0 is not None:
    s_acc[...] = s0
  plgpu.wgmma(s_acc, *s_operands)
  if dp0 is not None:
    dp_acc[...] = dp0
  plgpu.wgmma(dp_acc, *dp_operands)
  if softmax is None:
    return s_acc[...], dp_acc[...]
  p_th = softmax(plgpu.wgmma_accumulator_load(s_acc, wait_n=1))
  if early is None:
    return p_th, dp_acc[...]
  early(p_th[0])
  return p_th, plgpu.wgmma_accumulator_load(dp_acc, wait_n=1)


def _segment_kwargs(q_seg_ref, kv_seg_ref, b, q_start, n_q, k_start, n_k,
                    q_axis: int):
  """Segment ids of the tile's queries and keys, broadcast to the tile."""
  if q_seg_ref is None:
    return {}
  kv_seg_ref = kv_seg_ref[0]  # (ids, FlashMask columns or None)
  k_axis = 1 - q_axis
  shape = (n_q, n_k) if q_axis == 0 else (n_k, n_q)
  layout = lambda axis: ROW if axis == 0 else COL
  q_seg = plgpu.load(q_seg_ref.at[b, pl.ds(q_start, n_q)],
                     layout=layout(q_axis), optimized=False)
  k_seg = plgpu.load(kv_seg_ref.at[b, pl.ds(k_start, n_k)],
                     layout=layout(k_axis), optimized=False)
  return dict(q_seg=lax.broadcast_in_dim(q_seg, shape, [q_axis]),
              k_seg=lax.broadcast_in_dim(k_seg, shape, [k_axis]))


def _tile_mask(masked: bool, mask, seg_refs, b, *, q_start, n_q, k_start,
               n_k, q_axis: int, held=None, h=None):
  """The element mask of one tile of a backward kernel (queries from
  ``q_start`` along ``q_axis``, keys from ``k_start`` along the other), or
  None where ``masked`` is False.  The index tiles are built here, in the
  masked steps alone: one built before the loop stays live through it
  (32 registers per thread in a 64 x 64 tile; the causal d128 dK/dV
  kernel spilled 196 / 332 bytes with it, 128 / 184 without).  ``held``:
  the held side's index tile, built before the loop (the paired kernels,
  as measured on the H200; not re-timed without it).  The others are
  row / column vectors (:func:`pipeline.index_tile`).  ``h``: the query
  head (a dense mask's, :func:`pipeline.dense_mask_tile`)."""
  if not masked:
    return None
  shape = (n_q, n_k) if q_axis == 0 else (n_k, n_q)
  idx = lambda start, axis: pipeline.index_tile(start, shape, axis)
  q_idx = held if held is not None and q_axis == 0 else idx(q_start, q_axis)
  k_idx = held if held is not None and q_axis == 1 else idx(k_start,
                                                              1 - q_axis)
  visible = mask.visible(q_idx, k_idx,
                         **_segment_kwargs(*seg_refs, b, q_start, n_q,
                                           k_start, n_k, q_axis=q_axis))
  flash, dense = (seg_refs[1][1:] if seg_refs[0] is not None
                  else (None, None))
  if flash is not None:
    visible = visible & pipeline.flash_visible(
        flash, b, q_idx, k_start, n_k, shape, key_axis=1 - q_axis)
  if dense is not None:
    visible = visible & pipeline.dense_mask_tile(
        dense, b, h, q_start=q_start, n_q=n_q, k_start=k_start, n_k=n_k,
        q_axis=q_axis)
  return visible


def _terms_bias(ring_tile, bias_ref, alibi_ref, b, h, prob: Problem, *,
                q_start, n_q: int, k_start, n_k: int, q_axis: int):
  """The additive terms of one tile in the layout of ``S`` (``q_axis``
  0) or ``S^T`` (1), float32, in the scaled logits' units: the dense
  bias (``ring_tile``, its tile as loaded from the ring, or one row of
  keys for every query from ``bias_ref``) plus ALiBi's (``alibi_ref``);
  None where the call has neither."""
  kw = dict(k_start=k_start, n_k=n_k, q_axis=q_axis)
  dense = (ring_tile.astype(jnp.float32) if ring_tile is not None else
           None if bias_ref is None else
           pipeline.key_row(bias_ref, b, h, n_q=n_q, **kw))
  if alibi_ref is None:
    return dense
  alibi = pipeline.alibi_tile(alibi_ref, b, h, prob.mask.offset,
                              q_start=q_start, n_q=n_q, **kw)
  return alibi if dense is None else dense + alibi


def _bias_source(bias_ref, b, h, prob: Problem, rows, cols):
  """The GMEM tile of the dense bias (``[B | 1, H | 1, rows, keys]``) that
  a ring slot takes for batch row ``b`` and query head ``h``."""
  return bias_ref.at[b if prob.bias_batched else 0,
                     h if prob.bias_per_head else 0, rows, cols]


def _store_ds(ds, ds_smem, dst) -> None:
  """The dense bias's gradient of one tile (``dS``, the gradient of the
  logits the bias adds to) through ``ds_smem`` to ``dst`` in GMEM by TMA;
  the previous tile's copy must have read the buffer first."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  ds_smem[...] = ds.astype(ds_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ds_smem, dst)


def _split_inputs(refs, prob: Problem):
  """Both backward kernels' operands: ``(q, k, v, do, lse2, delta)``, the
  segment refs ``(q_seg, (kv_seg, flash, dense), group_range)`` (Nones
  without segment inputs; ``flash`` the FlashMask columns, ``dense`` the
  dense mask (:func:`pipeline.dense_mask_tile`), each or None) and the remaining
  refs, as a list."""
  refs = list(refs)
  tensors, refs = refs[:6], refs[6:]
  if not prob.has_segments:
    return tuple(tensors), (None, None, None), refs
  q_seg, kv_seg, group_range, *refs = refs
  flash = refs.pop(0) if prob.has_flash_mask else None
  dense = refs.pop(0) if prob.has_dense_mask else None
  return tuple(tensors), (q_seg, (kv_seg, flash, dense), group_range), refs


def _product_t(a_smem, b_smem, shape):
  """``a b^T`` (both in shared memory) into a fresh float32 accumulator of
  ``shape``: one wgmma, waited for."""
  def run(acc):
    plgpu.wgmma(acc, a_smem, b_smem.T)
    return acc[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _a_operand(value, a_smem, dtype):
  """A wgmma A operand: the registers themselves, or staged through SMEM."""
  value = value.astype(dtype)
  if a_smem is None:
    return value
  a_smem[...] = value
  plgpu.commit_smem()
  return a_smem


def _dk_and_atomic_dq(ds, ds_smem, dq_smem, q_t, dk_acc, k_smem, dq_dst, *,
                      dtype, prob: Problem):
  """``dK += dS^T Q`` and ``dQ[tile] += dS K`` (bwd_atomic_dq).

  ``ds`` is ``dS^T`` (key rows x query columns) in registers; staged in
  shared memory it is the A operand of both matmuls, transposed for dQ.
  The float32 ``dS K`` goes through ``dq_smem`` to a TMA reduce-add into
  ``dq_dst``; before ``dq_smem`` is rewritten, the previous tile's
  reduction must have finished reading it.
  """
  ds_smem[...] = ds.astype(dtype)
  plgpu.commit_smem()
  plgpu.wgmma(dk_acc, ds_smem, q_t)  # dK += dS^T Q
  rows = ds_smem.shape[1]

  def dq_tile(acc):
    plgpu.wgmma(acc, ds_smem.T, k_smem)  # dS K
    return acc[...]

  dq_t = pl.run_scoped(dq_tile, plgpu.ACC(
      (rows, prob.head_dim_padded), jnp.float32))
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  dq_smem[...] = dq_t
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(dq_smem, dq_dst, reduction_op="add")


# -- dK / dV ------------------------------------------------------------------
# FlashAttention-2's backward loop order (arXiv 2307.08691, Algorithm 2):
# outer over key tiles, each held by a consumer with its dK and dV
# accumulators, inner over the query tiles streamed past it
# (FlashAttention-3: hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp).

def vec_ring(stages: int, rows: int):
  """A float32 ring (log-sum-exp or delta) of ``rows`` per slot, in
  128-byte slots (``config.vec_slot_rows``: TMA's destination alignment);
  :func:`vec_slot` reads a slot's first ``rows``."""
  return plgpu.SMEM((stages, vec_slot_rows(rows)), jnp.float32)


def vec_slot(ring, slot, rows: int):
  """The first ``rows`` entries of slot ``slot`` of a float32 ring."""
  if ring.shape[-1] == rows:
    return ring.at[slot]
  return ring.at[slot, pl.ds(0, rows)]


def _query_tile_loader(srcs, rings, ready, *, b, h0, n_tiles, u_lo, bq,
                       prob: Problem | None = None, bias=None):
  """The producer's ``load(step, slot)`` of both dK/dV kernels.

  Step ``step`` walks query head ``h0 + step // n_tiles`` (``h0``: the
  first query head of the program's part of its key/value head's group)
  and its query tile ``u_lo + step % n_tiles``: Q, dO, the log-sum-exp and
  delta land in ring slot ``slot`` and complete on ``ready[slot]``;
  ``bias = (bias_ref, bias_ring, k_start, width)``: also the dense bias's
  tile of those rows and keys ``[k_start, k_start + width)``.
  """
  q_ref, do_ref, lse2_ref, delta_ref = srcs
  q_ring, do_ring, lse_ring, delta_ring = rings

  def load(step, slot):
    g = lax.div(step, jnp.maximum(n_tiles, 1))
    t = u_lo + step - g * n_tiles
    h = h0 + g
    rows = pl.ds(t * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_ring.at[slot],
                            ready.at[slot])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_ring.at[slot],
                            ready.at[slot])
    plgpu.copy_gmem_to_smem(lse2_ref.at[b, h, rows],
                            vec_slot(lse_ring, slot, bq), ready.at[slot])
    plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows],
                            vec_slot(delta_ring, slot, bq), ready.at[slot])
    if bias is not None:
      bias_ref, bias_ring, k_start, width = bias
      plgpu.copy_gmem_to_smem(
          _bias_source(bias_ref, b, h, prob, rows, pl.ds(k_start, width)),
          bias_ring.at[slot], ready.at[slot])

  return load


def _dkv_step(step, t, carry, *, masked: bool, g, dk_acc, dv_acc,
              prob: Problem, cfg: MosaicConfig, dtype, ring, held, a_smem,
              tile_mask, atomic, bias_of=None, keep_of=None):
  """One step of the dK/dV loop: query tile ``t`` of query head ``g``
  against the consumer's key tile, in transposed form (keys are the rows):

      S^T = K Q^T,  P^T = exp2(S^T scale log2(e) - lse2),  dV += P^T dO,
      dP^T = V dO^T,  dS^T = P^T (dP^T - delta),  dK += dS^T Q

  (FlashAttention-2's inner loop, Algorithm 2 of arXiv 2307.08691; with
  ``atomic = (ds_smem, dq_smem, dq_dst)`` also its ``dQ += dS K``, by TMA
  reduce-add into ``dq_dst(t, g)``).  ``ring``: the query ring (Q, dO,
  lse2, delta slots, ready barriers, free signals); ``held``: this
  consumer's K and V; ``a_smem``: the staged A operand (``p_in_smem``);
  ``tile_mask(masked, t, g)``: the tile's element mask; ``bias_of(slot,
  t, g)``: the dense bias's tile (None without one); ``keep_of(t, g)``:
  attention dropout's keep mask (None without dropout: ``dV += P_drop^T
  dO`` and ``dS`` from the kept ``dP``, :func:`_dscores`).
  """
  q_ring, do_ring, lse_ring, delta_ring, ready, free = ring
  k_smem, v_smem = held
  bq, bk = cfg.dkv_block_q, cfg.bwd_block_kv
  slot = lax.rem(step, cfg.bwd_stages)
  plgpu.barrier_wait(ready.at[slot])
  q_t, do_t = q_ring.at[slot], do_ring.at[slot]

  # bwd_stats_in_acc: the accumulators start at -lse2 / (scale log2 e)
  # and -delta (None: that statistic is subtracted below).
  lse_t = vec_slot(lse_ring, slot, bq)
  delta_t = vec_slot(delta_ring, slot, bq)
  # (Under dropout delta is subtracted from the kept dP: not folded.)
  s0, dp0 = (_stats_init(prob, lse_t, None if keep_of else delta_t,
                         (bk, bq), row_axis=1)
             if cfg.bwd_stats_in_acc else (None, None))
  lse2_of = lambda: (None if s0 is not None
                     else plgpu.load(lse_t, layout=COL))
  # The keep mask before the wgmmas (the overlapped order's dV update
  # runs inside the scope of their accumulators).
  keep = None if keep_of is None else keep_of(t, g)
  delta_of = lambda: (None if dp0 is not None
                      else plgpu.load(delta_t, layout=COL))
  softmax = lambda s, lse2: _probs(
      s, lse2, tile_mask(masked, t, g), prob=prob, row_axis=1,
      bias=None if bias_of is None else bias_of(slot, t, g))

  def dv_update(p):  # dV += P^T dO (P dropped under dropout)
    if keep is not None:
      p = pipeline.dropped(p, keep, prob.dropout_rate)
    plgpu.wgmma(dv_acc, _a_operand(p, a_smem, dtype), do_t)

  overlap = cfg.bwd_softmax_overlap
  early_dv = cfg.bwd_early_dv and overlap
  scores = functools.partial(
      _scores, s_operands=(k_smem, q_t.T), dp_operands=(v_smem, do_t.T),
      s0=s0, dp0=dp0,
      softmax=(lambda s: softmax(s, lse2_of())) if overlap else None,
      early=dv_update if early_dv else None)
  acc = plgpu.ACC((bk, bq), jnp.float32)
  if overlap:
    # FlashAttention-3's order: P^T under dP^T's wgmma, dS^T under dV's.
    (p, th), dp = pl.run_scoped(scores, acc, acc)
    delta = delta_of()
    ds = None
  else:
    s, dp = pl.run_scoped(scores, acc, acc)
    lse2 = lse2_of()
    delta = delta_of()
    p, th = softmax(s, lse2)
    ds = _dscores(p, th, dp, delta, row_axis=1, keep=keep,
                  rate=prob.dropout_rate)
  if not early_dv:  # (with early_dv, issued under dP^T's wgmma)
    dv_update(p)
  if a_smem is not None:
    plgpu.wgmma_wait(0)  # the staging buffer is reused for dS^T
  if ds is None:  # (overlap) while dV's wgmma runs
    ds = _dscores(p, th, dp, delta, row_axis=1, keep=keep,
                  rate=prob.dropout_rate)
  if atomic is not None:  # (with p_in_smem, the wait above freed P's buffer)
    ds_smem, dq_smem, dq_dst = atomic
    _dk_and_atomic_dq(ds, ds_smem, dq_smem, q_t, dk_acc, k_smem,
                      dq_dst(t, g), dtype=dtype, prob=prob)
  else:  # dK += dS^T Q
    plgpu.wgmma(dk_acc, _a_operand(ds, a_smem, dtype), q_t)
  plgpu.wgmma_wait(0)
  free.arrive(slot)
  return carry


def _dkv_loop(step, *, u_lo, u_hi, own, group_size, n_tiles, skip,
              acc_shape, element_mask_everywhere: bool):
  """The dK/dV loop over every query head ``g`` of the key/value head's
  group and its query tiles ``[u_lo, u_hi)`` (the ring's steps ``g *
  n_tiles + t - u_lo``; ``own``: this consumer's tiles, the others
  ``skip``ped), ``step`` (:func:`_dkv_step`) on each: ``(dK, dV)``
  accumulated in float32 registers of ``acc_shape``."""
  def accumulate(dk_acc, dv_acc):
    @pl.loop(0, group_size)
    def _(g):
      pipeline.tile_loop(
          u_lo, u_hi, own, first_step=g * n_tiles,
          compute=functools.partial(step, g=g, dk_acc=dk_acc, dv_acc=dv_acc),
          skip=skip, element_mask_everywhere=element_mask_everywhere)
    return dk_acc[...], dv_acc[...]

  acc = plgpu.ACC(acc_shape, jnp.float32)
  return pl.run_scoped(accumulate, acc, acc)


def _dkv_kernel(*refs, prob: Problem, cfg: MosaicConfig, dtype,
                atomic_dq: bool, head_splits: int, rows: bool):
  """The dK/dV kernel (FlashAttention-2's backward with its outer loop over
  key tiles, as FlashAttention-3's dK/dV mainloop): program (key/value
  head, key group, batch); consumer ``wg`` holds key tile ``wg`` of the
  group (K and V) and runs :func:`_dkv_loop`, the producer streams the
  query tiles any consumer needs, of every query head of the group.

  ``head_splits`` > 1: the programs' head axis runs over (key/value head,
  part), each part one ``1 / head_splits`` of the group's query heads,
  and each program writes its float32 partial dK and dV
  (:func:`dkv_head_splits` says when: MQA and few key tiles)."""
  ((q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref),
   (qseg_ref, kvseg_ref, range_ref), refs) = _split_inputs(refs, prob)
  alibi_ref = refs.pop(0) if prob.has_alibi else None
  bias_ref = refs.pop(0) if prob.has_bias else None
  drop_ref = refs.pop(0) if prob.dropout_rate else None
  dq_acc_ref = refs.pop(0) if atomic_dq else None  # float32, zeroed
  (dk_ref, dv_ref, k_smem2, v_smem2, q_ring, do_ring, lse_ring, delta_ring,
   kv_ready, ready, free, *extra) = refs
  # The copies of K, V, Q, dO, dK and dV go through the second views.
  (k_smem2, k_rows2), (v_smem2, v_rows2), (q_ring, q_rows), (
      do_ring, do_rows) = (pipeline.row_views(x, rows) for x in (
          k_smem2, v_smem2, q_ring, do_ring))
  free = pipeline.MBarriers(free)
  a_smem2 = extra.pop(0) if cfg.p_in_smem else None
  if atomic_dq:  # dS^T staged (in P's buffer with p_in_smem), dS K
    ds_smem2 = a_smem2 if a_smem2 is not None else extra.pop(0)
    dq_smem2 = extra.pop(0)
  partial2 = extra.pop(0) if head_splits > 1 else None  # float32 staging
  bias_ring = extra.pop(0) if prob.bias_ring else None
  n, stages = cfg.bwd_compute_wgs, cfg.bwd_stages
  bq, bk = cfg.dkv_block_q, cfg.bwd_block_kv
  group_rows = n * bk
  # Query heads per program: the group, or its part (head_splits).
  group_size = prob.num_heads // prob.num_kv_heads // head_splits
  b = lax.axis_index("batch")
  out_head = lax.axis_index("heads")  # (key/value head, part of its group)
  kh = out_head if head_splits == 1 else lax.div(out_head, head_splits)
  h0 = out_head * group_size  # the part's first query head
  wg = lax.axis_index("wg")
  grp = lax.axis_index("kv_seq")
  mask = prob.mask
  group_start = grp * group_rows
  # Query tiles any consumer of this program needs (per query head).
  u_lo, _, _, u_hi = mask.q_block_range(group_start, group_rows, bq)
  u_lo, u_hi = pipeline.narrow_to_segments(u_lo, u_hi, range_ref, b, grp)
  n_tiles = u_hi - u_lo
  n_steps = group_size * n_tiles  # every query head of the group

  @pl.when(wg < n)
  def _consumer():
    pipeline.split_registers(False, n, cfg.bwd_consumer_registers)
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    a_smem = None if a_smem2 is None else a_smem2.at[wg]
    if atomic_dq:
      ds_smem, dq_smem = ds_smem2.at[wg], dq_smem2.at[wg]
    k_start = group_start + wg * bk
    kv_rows = (b, pl.ds(k_start, bk), kh)
    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_rows2.at[wg],
                            kv_ready.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_rows2.at[wg],
                            kv_ready.at[wg])
    plgpu.barrier_wait(kv_ready.at[wg])

    def tile_mask(masked, t, g):
      return _tile_mask(masked, mask, (qseg_ref, kvseg_ref), b,
                        q_start=t * bq, n_q=bq, k_start=k_start, n_k=bk,
                        q_axis=1, h=h0 + g)

    def dq_dst(t, g):  # the query tile's rows of dQ (float32, padded)
      return dq_acc_ref.at[b, pl.ds(t * bq, bq), h0 + g]

    def bias_of(slot, t, g):
      # The slot holds the bias^T of every consumer's keys: this one's
      # rows of it, transposed on the way into the layout of S^T.
      ring_tile = None if bias_ring is None else plgpu.layout_cast(
          plgpu.load(bias_ring.at[slot].T.at[pl.ds(wg * bk, bk)],
                     layout=plgpu.Layout.WGMMA_TRANSPOSED),
          plgpu.Layout.WGMMA)
      return _terms_bias(ring_tile, bias_ref, alibi_ref, b, h0 + g, prob,
                         q_start=t * bq, n_q=bq, k_start=k_start, n_k=bk,
                         q_axis=1)

    step = functools.partial(
        _dkv_step, prob=prob, cfg=cfg, dtype=dtype,
        ring=(q_ring, do_ring, lse_ring, delta_ring, ready, free),
        held=(k_smem, v_smem), a_smem=a_smem, tile_mask=tile_mask,
        atomic=(ds_smem, dq_smem, dq_dst) if atomic_dq else None,
        bias_of=bias_of if prob.has_bias or prob.has_alibi else None,
        keep_of=None if drop_ref is None else (
            lambda t, g: pipeline.dropout_keep_tile(
                drop_ref, b, h0 + g, prob.num_heads, prob.dropout_rate,
                q_start=t * bq, n_q=bq, k_start=k_start, n_k=bk, q_axis=1)))
    own, everywhere = pipeline.flash_full_range(
        mask.q_block_range(k_start, bk, bq), range_ref, b, grp,
        segment_ids=prob.has_segment_ids)
    dk, dv = _dkv_loop(
        step, u_lo=u_lo, u_hi=u_hi, own=own,
        group_size=group_size, n_tiles=n_tiles,
        skip=pipeline.acknowledge(ready, free, stages),
        acc_shape=(bk, prob.head_dim_padded),
        element_mask_everywhere=everywhere)
    # dS is w.r.t. the scaled logits: d(scale * q.k)/dk = scale * q.
    dk = dk * prob.softmax_scale
    if partial2 is not None:
      # A part of the group: its float32 partials, one after the other
      # through one staging tile, summed over the parts by the caller.
      out_rows = (b, pl.ds(k_start, bk), out_head)
      for acc, ref in ((dk, dk_ref), (dv, dv_ref)):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        partial2.at[wg][...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(partial2.at[wg], ref.at[out_rows])
      plgpu.wait_smem_to_gmem(0)
      return
    # K's and V's buffers are free now: stage the results there.
    k_smem[...] = dk.astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_rows2.at[wg], dk_ref.at[kv_rows])
    plgpu.copy_smem_to_gmem(v_rows2.at[wg], dv_ref.at[kv_rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == n)
  def _producer():
    pipeline.split_registers(True, n, cfg.bwd_consumer_registers)
    load = _query_tile_loader(
        (q_ref, do_ref, lse2_ref, delta_ref),
        (q_rows, do_rows, lse_ring, delta_ring), ready, b=b, h0=h0,
        n_tiles=n_tiles, u_lo=u_lo, bq=bq, prob=prob,
        bias=(None if bias_ring is None
              else (bias_ref, bias_ring, group_start, group_rows)))
    pipeline.produce(n_steps, stages, load, [free])


def dkv(q, k, v, do, lse2, delta, segments, *, prob: Problem,
        cfg: MosaicConfig, dq_acc=None, interpret=None, head_splits: int = 1,
        bias=None, alibi=None, dropout=None):
  """``(dk, dv)``, padded like ``k``; q/do ``[B, Tp, H, Dp]``,
  lse2/delta ``[B, H, Tp]`` float32, ``segments = (q_seg, kv_seg,
  kv_group_range)``.  ``dq_acc``: a zeroed float32 ref shaped like ``q``,
  into which the kernel adds ``dS K`` (unscaled; ``bwd_atomic_dq``).
  ``head_splits`` > 1: float32 partials ``[B, Sp, K * head_splits, Dp]``
  (key/value head ``kh``'s part ``p`` at head ``kh * head_splits + p``),
  each over ``1 / head_splits`` of the group's query heads.  ``bias``
  (with ``prob.has_bias``): the dense bias, ``[B | 1, H | 1, rows, Sp]``
  in q's dtype with its rows padded to whole ``dkv_block_q`` steps, or
  one float32 row ``[B | 1, H | 1, 1, Sp]`` (``prob.bias_rows`` False).
  ``alibi`` (with ``prob.has_alibi``): ``[B, H, 2]`` float32, each head's
  ALiBi slope and shift (:func:`pipeline.alibi_tile`).  ``dropout`` (with
  ``prob.dropout_rate``): the forward's table ``[B, H + 2]`` int32
  (:func:`pipeline.dropout_keep_tile`)."""
  atomic_dq = dq_acc is not None
  dtype = q.dtype
  dp = prob.head_dim_padded
  bq, bk, n = cfg.dkv_block_q, cfg.bwd_block_kv, cfg.bwd_compute_wgs
  rows = _check_rows(q, k, prob, cfg, interpret)
  # Q and dO are also the B operands of dK += dS^T Q and dV += P^T dO,
  # whose contraction runs over their bq rows (bwd_dkv_block_q): the
  # widest swizzle that divides bq (32 bytes at FlashAttention-3's 80)
  # and the head_dim they are tiled along (64 bytes at 96).
  # K and V take it too: Mosaic GPU's wgmma needs both shared-memory
  # operands in one swizzle (S^T = K Q^T, dP^T = V dO^T).
  over_q = _operands_tiled(bq, dp)
  held, ring = (n, bk, dp), (cfg.bwd_stages, bq, dp)
  scratch = [
      pipeline.operand_buffer(held, dtype, over_q, rows),  # K per consumer
      pipeline.operand_buffer(held, dtype, over_q, rows),  # V per consumer
      pipeline.operand_buffer(ring, dtype, over_q, rows),  # Q ring
      pipeline.operand_buffer(ring, dtype, over_q, rows),  # dO ring
      vec_ring(cfg.bwd_stages, bq),                          # lse2 ring
      vec_ring(cfg.bwd_stages, bq),                          # delta ring
      plgpu.Barrier(num_arrivals=2, num_barriers=n),         # K, V loaded
      plgpu.Barrier(num_arrivals=4 + prob.bias_ring,
                    num_barriers=cfg.bwd_stages),            # slot full
      plgpu.Barrier(num_arrivals=n, num_barriers=cfg.bwd_stages),  # slot free
  ]
  if cfg.p_in_smem or atomic_dq:  # P (and dS^T) staged
    scratch.append(plgpu.SMEM((n, bk, bq), dtype, **over_q))
  if atomic_dq:  # one float32 dS K tile per consumer
    scratch.append(plgpu.SMEM((n, bq, dp), jnp.float32, **tiled_f32(dp)))
  out_shape, out_dtype = k.shape, dtype
  if head_splits > 1:  # one float32 partial tile per consumer, staged
    scratch.append(plgpu.SMEM((n, bk, dp), jnp.float32, **tiled_f32(dp)))
    B, _, K, _ = k.shape
    out_shape = (B, prob.kv_pad, K * head_splits, dp)
    out_dtype = jnp.float32
  if prob.bias_ring:
    # The bias tiles of a query step and every consumer's keys, a ring
    # beside Q's; each consumer reads its keys' rows of the transpose.
    scratch.append(plgpu.SMEM((cfg.bwd_stages, bq, n * bk), dtype,
                              **pipeline.tiled_over(n * bk)))
  out_type = [out_struct(out_shape, out_dtype, q, k, v) for _ in range(2)]
  return pipeline.launch(
      functools.partial(_dkv_kernel, prob=prob, cfg=cfg, dtype=dtype,
                        atomic_dq=atomic_dq, head_splits=head_splits,
                        rows=rows),
      out_type=out_type, scratch=scratch,
      grid=(prob.num_kv_heads * head_splits, prob.kv_pad // (n * bk),
            prob.batch),
      grid_names=("heads", "kv_seq", "batch"), consumers=n,
      interpret=interpret,
  )(q, k, v, do, lse2, delta, *(segments or ()),
    *((alibi,) if prob.has_alibi else ()),
    *((bias,) if prob.has_bias else ()),
    *((dropout,) if prob.dropout_rate else ()),
    *((dq_acc,) if atomic_dq else ()))


# -- dK / dV, paired consumers -------------------------------------------------

def _check_paired(prob: Problem) -> None:
  """The paired kernels take none of the dense terms or dropout (the
  Triton backward serves those calls: backend._backward_config)."""
  if (prob.has_bias or prob.has_dense_mask or prob.has_alibi
      or prob.dropout_rate):
    raise NotImplementedError(
        "the paired backward kernels take no dense bias or mask, ALiBi or"
        " dropout (the Triton backward serves them)")


def _paired_scratch(held, streamed, dp, stages, dtype, *, ready_arrivals,
                    ring_extras=()):
  """Shared memory of both paired kernels: the two tiles the consumers
  hold (``held`` rows each: K and V, or Q and dO), the ring of the two
  streamed operands (``streamed`` rows, then ``ring_extras``), barriers
  for the held tiles, the slots' ready (``ready_arrivals`` copies) and
  free (both consumers) signals, and consumer 0's hand-over (``P`` or
  ``P^T``, the tile of ``held x streamed`` or its transpose) with its
  barrier, one per slot."""
  tiled = _operands_tiled(held, streamed, dp)
  return [
      plgpu.SMEM((held, dp), dtype, **tiled),                # consumer 0's
      plgpu.SMEM((held, dp), dtype, **tiled),                # consumer 1's
      plgpu.SMEM((stages, streamed, dp), dtype, **tiled),    # ring
      plgpu.SMEM((stages, streamed, dp), dtype, **tiled),    # ring
      *ring_extras,
      plgpu.Barrier(num_arrivals=1, num_barriers=2),         # held loaded
      plgpu.Barrier(num_arrivals=ready_arrivals, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),    # slot free
      plgpu.SMEM((stages, held, streamed), dtype, **tiled),  # hand-over
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),    # hand-over in
  ]


def _paired_dkv_kernel(*refs, prob: Problem, cfg: MosaicConfig, dtype):
  """dK and dV of one key tile by two consumers (``bwd_paired_dkv``).

  Consumer 0 holds K and accumulates ``dV += P^T dO`` from ``S^T = K
  Q^T``; consumer 1 holds V and accumulates ``dK += dS^T Q`` from ``dP^T =
  V dO^T``.  Consumer 0 hands ``P^T`` (times ``1 - th^2`` with a soft cap)
  to consumer 1 in shared memory, one buffer per ring slot, so consumer 1
  never recomputes ``S^T``: 4 matmuls per tile pair, two accumulators in
  two warpgroups' registers, and the two consumers' matmuls and
  elementwise work interleave on the tensor cores.  The hand-over is
  rounded to the input dtype, as both ``P`` and ``dS`` already are for
  their second matmuls; it lands in ``dS`` with the same relative error
  as that rounding.

  A hand-over buffer is rewritten ``bwd_stages`` steps later; by then
  consumer 1 has read it, since consumer 0 starts that step only once the
  ring slot was refilled, which needed consumer 1's release of the slot
  after its read.
  """
  ((q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref),
   (qseg_ref, kvseg_ref, range_ref), refs) = _split_inputs(refs, prob)
  (dk_ref, dv_ref, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring,
   kv_ready, ready, free, hand, hand_ready, *extra) = refs
  # p_in_smem: each consumer's A operand staged (P^T under a soft cap, dS^T).
  a_smem2 = extra[0] if cfg.p_in_smem else None
  free = pipeline.MBarriers(free)
  bq, bk, stages = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_stages
  group_size = prob.num_heads // prob.num_kv_heads
  b = lax.axis_index("batch")
  kh = lax.axis_index("heads")  # the key/value head
  wg = lax.axis_index("wg")
  k_start = lax.axis_index("kv_seq") * bk
  rows = (b, pl.ds(k_start, bk), kh)
  mask = prob.mask
  u_lo, _, _, u_hi = mask.q_block_range(k_start, bk, bq)
  u_lo, u_hi = pipeline.narrow_to_segments(u_lo, u_hi, range_ref, b,
                                           lax.axis_index("kv_seq"))
  n_tiles = u_hi - u_lo
  own, everywhere = pipeline.flash_full_range(
      mask.q_block_range(k_start, bk, bq), range_ref, b,
      lax.axis_index("kv_seq"), segment_ids=prob.has_segment_ids)
  acknowledge = pipeline.acknowledge(ready, free, stages)

  def loop(compute, acc_ref):
    """``compute`` over every query tile of every query head of the
    group, as the dK/dV kernel's loop."""
    @pl.loop(0, group_size)
    def _(g):
      pipeline.tile_loop(
          u_lo, u_hi, own, first_step=g * n_tiles,
          compute=functools.partial(compute, acc=acc_ref),
          skip=acknowledge, element_mask_everywhere=everywhere)
    return acc_ref[...]

  def a_smem(c):
    return None if a_smem2 is None else a_smem2.at[c]

  def write(grad, staging, out_ref):
    staging[...] = grad.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(staging, out_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  acc = plgpu.ACC((bk, prob.head_dim_padded), jnp.float32)

  @pl.when(wg == 0)
  def _dv_consumer():
    pipeline.split_registers(False, 2, cfg.bwd_consumer_registers)
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_ready.at[0])
    plgpu.barrier_wait(kv_ready.at[0])
    k_idx = pipeline.index_tile(k_start, (bk, bq), 0, vectors=False)

    def compute(step, t, carry, *, masked, acc):
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(ready.at[slot])

      s = _product_t(k_smem, q_ring.at[slot], (bk, bq))  # S^T = K Q^T
      visible = _tile_mask(masked, mask, (qseg_ref, kvseg_ref), b,
                           q_start=t * bq, n_q=bq, k_start=k_start, n_k=bk,
                           q_axis=1, held=k_idx)
      p, th = _probs(s, plgpu.load(vec_slot(lse_ring, slot, bq),
                                   layout=COL), visible,
                     prob=prob, row_axis=1)
      hand.at[slot][...] = (p if th is None
                            else p * (1.0 - th * th)).astype(dtype)
      plgpu.commit_smem()
      plgpu.barrier_arrive(hand_ready.at[slot])
      # (Staged, P^T without a soft cap is the hand-over itself.)
      a = (hand.at[slot] if cfg.p_in_smem and th is None
           else _a_operand(p, a_smem(0), dtype))
      plgpu.wgmma(acc, a, do_ring.at[slot])  # dV += P^T dO
      plgpu.wgmma_wait(0)
      free.arrive(slot)
      return carry

    dv = pl.run_scoped(functools.partial(loop, compute), acc)
    write(dv, k_smem, dv_ref)  # K's buffer is free now

  @pl.when(wg == 1)
  def _dk_consumer():
    pipeline.split_registers(False, 2, cfg.bwd_consumer_registers)
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_ready.at[1])
    plgpu.barrier_wait(kv_ready.at[1])

    def compute(step, t, carry, *, masked, acc):
      del t, masked  # the hand-over is masked already
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(ready.at[slot])

      dp = _product_t(v_smem, do_ring.at[slot], (bk, bq))  # dP^T = V dO^T
      delta = plgpu.load(vec_slot(delta_ring, slot, bq), layout=COL)
      plgpu.barrier_wait(hand_ready.at[slot])
      p = plgpu.load(hand.at[slot], layout=plgpu.Layout.WGMMA)
      ds = p.astype(jnp.float32) * (
          dp - lax.broadcast_in_dim(delta, dp.shape, [1]))
      plgpu.wgmma(acc, _a_operand(ds, a_smem(1), dtype),
                  q_ring.at[slot])  # dK += dS^T Q
      plgpu.wgmma_wait(0)
      free.arrive(slot)
      return carry

    dk = pl.run_scoped(functools.partial(loop, compute), acc)
    # dS is w.r.t. the scaled logits: d(scale * q.k)/dk = scale * q.
    write(dk * prob.softmax_scale, v_smem, dk_ref)  # V's buffer is free

  @pl.when(wg == 2)
  def _producer():
    pipeline.split_registers(True, 2, cfg.bwd_consumer_registers)

    load = _query_tile_loader(
        (q_ref, do_ref, lse2_ref, delta_ref),
        (q_ring, do_ring, lse_ring, delta_ring), ready, b=b,
        h0=kh * group_size, n_tiles=n_tiles, u_lo=u_lo, bq=bq)
    pipeline.produce(group_size * n_tiles, stages, load, [free])


def paired_dkv(q, k, v, do, lse2, delta, segments, *, prob: Problem,
               cfg: MosaicConfig, interpret=None):
  """``(dk, dv)`` padded like ``k`` by :func:`_paired_dkv_kernel`
  (``bwd_paired_dkv``); operands as :func:`dkv`, with ``segments =
  (q_seg, kv_seg, kv_group_range)`` grouped by ``bwd_block_kv`` keys."""
  _check_paired(prob)
  dtype = q.dtype
  dp = prob.head_dim_padded
  bq, bk, stages = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_stages
  # K and V held, Q and dO streamed with lse2 and delta (4 copies a slot).
  scratch = _paired_scratch(
      bk, bq, dp, stages, dtype, ready_arrivals=4,
      ring_extras=[vec_ring(stages, bq)] * 2)
  if cfg.p_in_smem:  # each consumer's A operand staged
    scratch.append(plgpu.SMEM((2, bk, bq), dtype,
                              **_operands_tiled(bk, bq, dp)))
  return pipeline.launch(
      functools.partial(_paired_dkv_kernel, prob=prob, cfg=cfg, dtype=dtype),
      out_type=[out_struct(k.shape, dtype, q, k, v) for _ in range(2)],
      scratch=scratch,
      grid=(prob.num_kv_heads, prob.kv_pad // bk, prob.batch),
      grid_names=("heads", "kv_seq", "batch"), consumers=2,
      interpret=interpret,
  )(q, k, v, do, lse2, delta, *(segments or ()))


# -- dQ -----------------------------------------------------------------------

def _query_group(prob: Problem, range_ref, group_rows: int, bk: int):
  """A dQ program's work item and warpgroup: ``(batch, query head,
  warpgroup, first query row, (u_lo, u_hi), tiles, group, gap)``: the key
  tiles ``[u_lo, u_hi)`` its ``group_rows`` queries stream (narrowed to
  segments; virtual tiles less ``gap``, the hidden run they skip:
  :class:`pipeline.TileGap`, None where there is none), ``tiles`` their
  :meth:`MaskSpec.kv_block_range` (not narrowed) and the group's index.
  Causal groups run longest first, as in the forward."""
  b = lax.axis_index("batch")
  h = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  grp = lax.axis_index("q_seq")
  if prob.mask.causal:
    grp = prob.q_pad // group_rows - 1 - grp
  start = grp * group_rows
  tiles = prob.mask.kv_block_range(start, group_rows, bk)
  u_lo, u_hi = pipeline.narrow_to_segments(tiles[0], tiles[3], range_ref,
                                           b, grp)
  u_hi, gap = pipeline.tile_gap(u_lo, u_hi, range_ref, b, grp)
  return b, h, wg, start, (u_lo, u_hi), tiles, grp, gap


def _key_tile_loader(srcs, rings, ready, *, b, h, prob: Problem, u_lo, bk,
                     gap=None):
  """The producer's ``load(step, slot)`` of both dQ kernels: K and V of
  (virtual) key tile ``u_lo + step`` of query head ``h``'s key/value head
  land in ring slot ``slot`` and complete on ``ready[slot]``."""
  kv_head = lax.div(h, jnp.asarray(prob.num_heads // prob.num_kv_heads,
                                   h.dtype))

  def load(step, slot):
    src = (b, pl.ds(pipeline.key_start(gap, u_lo + step, bk), bk), kv_head)
    for ref, ring in zip(srcs, rings):
      plgpu.copy_gmem_to_smem(ref.at[src], ring.at[slot], ready.at[slot])

  return load


def _dq_step(step, t, carry, *, masked: bool, dq_acc, prob: Problem,
             cfg: MosaicConfig, dtype, ring, held, vecs, a_smem, tile_mask,
             bias_of=None, ds_out=None, keep_of=None):
  """One step of the dQ loop: key tile ``t`` against the consumer's query
  tile,

      S = Q K^T,  P = exp2(S scale log2(e) - lse2),  dP = dO V^T,
      dS = P (dP - delta),  dQ += dS K

  (FlashAttention-2's Algorithm 2, arXiv 2307.08691, with the loops
  exchanged: the key tiles stream past the held query tile, so dQ needs
  no atomics).  ``ring``: the K/V ring (K, V slots, ready barriers, free
  signals); ``held``: this consumer's Q and dO; ``vecs``: its rows' lse2
  and delta (registers); ``a_smem``: the staged A operand
  (``p_in_smem``); ``tile_mask(masked, t)``: the tile's element mask;
  ``bias_of(slot, t)``: the dense bias's tile; ``ds_out(t) = (ds_smem,
  dst)``: where the tile's ``dS`` goes (the bias's gradient), or None;
  ``keep_of(t)``: attention dropout's keep mask (None without dropout).
  """
  k_ring, v_ring, ready, free = ring
  q_smem, do_smem = held
  lse2, delta = vecs
  slot = lax.rem(step, cfg.bwd_stages)
  plgpu.barrier_wait(ready.at[slot])
  k_t, v_t = k_ring.at[slot], v_ring.at[slot]
  softmax = lambda s: _probs(
      s, lse2, tile_mask(masked, t), prob=prob, row_axis=0,
      bias=None if bias_of is None else bias_of(slot, t))
  overlap = cfg.bwd_softmax_overlap
  scores = functools.partial(
      _scores, s_operands=(q_smem, k_t.T), dp_operands=(do_smem, v_t.T),
      softmax=softmax if overlap else None)
  acc = plgpu.ACC((cfg.bwd_block_q, cfg.bwd_block_kv), jnp.float32)
  if overlap:  # P under dP's wgmma (FlashAttention-3's order)
    (p, th), dp = pl.run_scoped(scores, acc, acc)
  else:
    s, dp = pl.run_scoped(scores, acc, acc)
    p, th = softmax(s)
  ds = _dscores(p, th, dp, delta, row_axis=0,
                keep=None if keep_of is None else keep_of(t),
                rate=prob.dropout_rate)
  plgpu.wgmma(dq_acc, _a_operand(ds, a_smem, dtype), k_t)  # dQ += dS K
  if ds_out is not None:  # (while dQ's wgmma runs)
    _store_ds(ds, *ds_out(t))
  plgpu.wgmma_wait(0)
  free.arrive(slot)
  return carry


def _dq_kernel(*refs, prob: Problem, cfg: MosaicConfig, dtype,
               ds_out: bool, rows: bool):
  """The dQ kernel: program (query head, query group, batch); consumer
  ``wg`` holds query tile ``wg`` of the group (Q, dO and their rows' lse2
  and delta) and accumulates dQ over the key tiles (:func:`_dq_step`),
  which the producer streams (with a dense bias, its tiles beside them).
  ``ds_out``: each computed tile's ``dS`` also goes to a zeroed
  ``[B, H, Tp, Sp]`` ref (the dense bias's gradient before its broadcast
  axes are summed; tiles never computed are hidden, and stay zero)."""
  ((q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref),
   (qseg_ref, kvseg_ref, range_ref), refs) = _split_inputs(refs, prob)
  alibi_ref = refs.pop(0) if prob.has_alibi else None
  bias_ref = refs.pop(0) if prob.has_bias else None
  drop_ref = refs.pop(0) if prob.dropout_rate else None
  ds_ref = refs.pop(0) if ds_out else None
  (dq_ref, q_smem2, do_smem2, k_ring, v_ring, qdo_ready, ready, free,
   *extra) = refs
  # The copies of Q, dO, K, V and dQ go through the second views.
  (q_smem2, q_rows2), (do_smem2, do_rows2), (k_ring, k_rows), (
      v_ring, v_rows) = (pipeline.row_views(x, rows) for x in (
          q_smem2, do_smem2, k_ring, v_ring))
  a_smem2 = extra.pop(0) if cfg.p_in_smem else None
  bias_ring = extra.pop(0) if prob.bias_ring else None
  ds_smem2 = extra.pop(0) if ds_out else None
  n, stages = cfg.bwd_compute_wgs, cfg.bwd_stages
  bq, bk = cfg.bwd_block_q, cfg.bwd_block_kv
  free = pipeline.MBarriers(free)
  mask = prob.mask
  b, h, wg, group_start, (u_lo, u_hi), _, grp, gap = _query_group(
      prob, range_ref, n * bq, bk)
  key_start = functools.partial(pipeline.key_start, gap, block=bk)

  @pl.when(wg < n)
  def _consumer():
    pipeline.split_registers(False, n, cfg.bwd_consumer_registers)
    q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
    a_smem = None if a_smem2 is None else a_smem2.at[wg]
    q_start = group_start + wg * bq
    q_rows = (b, pl.ds(q_start, bq), h)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_rows2.at[wg],
                            qdo_ready.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_rows2.at[wg],
                            qdo_ready.at[wg])
    lse2 = plgpu.load(lse2_ref.at[b, h, pl.ds(q_start, bq)], layout=ROW,
                      optimized=False)
    delta = plgpu.load(delta_ref.at[b, h, pl.ds(q_start, bq)], layout=ROW,
                       optimized=False)
    plgpu.barrier_wait(qdo_ready.at[wg])

    def tile_mask(masked, t):
      return _tile_mask(masked, mask, (qseg_ref, kvseg_ref), b,
                        q_start=q_start, n_q=bq, k_start=key_start(t), n_k=bk,
                        q_axis=0, h=h)

    def bias_of(slot, t):
      # The slot holds every consumer's rows.
      ring_tile = None if bias_ring is None else plgpu.load(
          bias_ring.at[slot, pl.ds(wg * bq, bq)], layout=plgpu.Layout.WGMMA)
      return _terms_bias(ring_tile, bias_ref, alibi_ref, b, h, prob,
                         q_start=q_start, n_q=bq, k_start=key_start(t), n_k=bk,
                         q_axis=0)

    def ds_dst(t):
      return ds_smem2.at[wg], ds_ref.at[b, h, pl.ds(q_start, bq),
                                        pl.ds(key_start(t), bk)]

    step = functools.partial(
        _dq_step, prob=prob, cfg=cfg, dtype=dtype,
        ring=(k_ring, v_ring, ready, free), held=(q_smem, do_smem),
        vecs=(lse2, delta), a_smem=a_smem, tile_mask=tile_mask,
        bias_of=bias_of if prob.has_bias or prob.has_alibi else None,
        ds_out=ds_dst if ds_out else None,
        keep_of=None if drop_ref is None else (
            lambda t: pipeline.dropout_keep_tile(
                drop_ref, b, h, prob.num_heads, prob.dropout_rate,
                q_start=q_start, n_q=bq, k_start=key_start(t), n_k=bk,
                q_axis=0)))
    own, everywhere = pipeline.flash_full_range(
        mask.kv_block_range(q_start, bq, bk), range_ref, b, grp,
        segment_ids=prob.has_segment_ids)
    own = pipeline.virtual_range(gap, own)

    def accumulate(dq_acc):  # the dQ loop over the streamed key tiles
      pipeline.tile_loop(
          u_lo, u_hi, own, first_step=0,
          compute=functools.partial(step, dq_acc=dq_acc),
          skip=pipeline.acknowledge(ready, free, stages),
          element_mask_everywhere=everywhere)
      return dq_acc[...]

    dq = pl.run_scoped(accumulate,
                       plgpu.ACC((bq, prob.head_dim_padded), jnp.float32))
    # dS is w.r.t. the scaled logits: d(scale * q.k)/dq = scale * k.
    q_smem[...] = (dq * prob.softmax_scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_rows2.at[wg], dq_ref.at[q_rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == n)
  def _producer():
    pipeline.split_registers(True, n, cfg.bwd_consumer_registers)
    load_kv = _key_tile_loader((k_ref, v_ref), (k_rows, v_rows), ready, b=b,
                               h=h, prob=prob, u_lo=u_lo, bk=bk, gap=gap)

    def load(step, slot):
      load_kv(step, slot)
      if bias_ring is not None:  # the group's rows of the key tile
        plgpu.copy_gmem_to_smem(
            _bias_source(bias_ref, b, h, prob, pl.ds(group_start, n * bq),
                         pl.ds(key_start(u_lo + step), bk)),
            bias_ring.at[slot], ready.at[slot])
    pipeline.produce(u_hi - u_lo, stages, load, [free])


def dq(q, k, v, do, lse2, delta, segments, *, prob: Problem,
       cfg: MosaicConfig, interpret=None, bias=None, ds_acc=None,
       alibi=None, dropout=None):
  """``dq`` padded like ``q``; ``segments = (q_seg, kv_seg, q_group_range)``.
  ``bias`` (with ``prob.has_bias``): the dense bias, ``[B | 1, H | 1, Tp,
  Sp]`` in q's dtype, or one float32 row ``[B | 1, H | 1, 1, Sp]``
  (``prob.bias_rows`` False).  ``ds_acc``: a zeroed ``[B, H, Tp, Sp]``
  ref (bfloat16 or float32) into which the kernel writes ``dS``.  ``alibi``,
  ``dropout``: as :func:`dkv`'s."""
  dtype = q.dtype
  dp = prob.head_dim_padded
  bq, bk, n = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_compute_wgs
  rows = _check_rows(q, k, prob, cfg, interpret)
  tiled = _operands_tiled(bk, dp)  # dQ += dS K contracts over bk keys
  held, ring = (n, bq, dp), (cfg.bwd_stages, bk, dp)
  scratch = [
      pipeline.operand_buffer(held, dtype, tiled, rows),  # Q per consumer
      pipeline.operand_buffer(held, dtype, tiled, rows),  # dO per consumer
      pipeline.operand_buffer(ring, dtype, tiled, rows),  # K ring
      pipeline.operand_buffer(ring, dtype, tiled, rows),  # V ring
      plgpu.Barrier(num_arrivals=2, num_barriers=n),         # Q, dO loaded
      plgpu.Barrier(num_arrivals=2 + prob.bias_ring,
                    num_barriers=cfg.bwd_stages),            # slot full
      plgpu.Barrier(num_arrivals=n, num_barriers=cfg.bwd_stages),  # slot free
  ]
  if cfg.p_in_smem:
    scratch.append(plgpu.SMEM((n, bq, bk), dtype, **tiled))
  if prob.bias_ring:  # the group's rows of each key tile, beside K and V
    scratch.append(plgpu.SMEM((cfg.bwd_stages, n * bq, bk), dtype,
                              **pipeline.tiled_over(bk)))
  if ds_acc is not None:  # one dS tile per consumer, staged for its copy
    f32 = jnp.dtype(ds_acc.dtype) == jnp.float32
    scratch.append(plgpu.SMEM((n, bq, bk), ds_acc.dtype,
                              **(tiled_f32(bk) if f32
                                 else pipeline.tiled_over(bk))))
  return pipeline.launch(
      functools.partial(_dq_kernel, prob=prob, cfg=cfg, dtype=dtype,
                        ds_out=ds_acc is not None, rows=rows),
      out_type=out_struct(q.shape, dtype, q, k, v), scratch=scratch,
      grid=(prob.num_heads, prob.q_pad // (n * bq), prob.batch),
      grid_names=("heads", "q_seq", "batch"), consumers=n,
      interpret=interpret,
  )(q, k, v, do, lse2, delta, *(segments or ()),
    *((alibi,) if prob.has_alibi else ()),
    *((bias,) if prob.has_bias else ()),
    *((dropout,) if prob.dropout_rate else ()),
    *((ds_acc,) if ds_acc is not None else ()))


# -- dQ, paired consumers ------------------------------------------------------

def _paired_dq_kernel(*refs, prob: Problem, cfg: MosaicConfig, dtype):
  """dQ of one query tile by two consumers (``bwd_paired_dq``).

  Consumer 0 holds Q: ``S = Q K^T`` and ``P`` (masked; times ``1 - th^2``
  under a soft cap), handed to consumer 1 in shared memory, one buffer
  per ring slot.  Consumer 1 holds dO: ``dP = dO V^T``, ``dS = P (dP -
  delta)`` from the hand-over and ``dQ += dS K``.  The same 3 matmuls per
  tile pair as the dQ kernel, for ``bwd_block_q`` query rows per program
  with Q and dO held once each (at head_dim 256 two consumers of the dQ
  kernel do not fit in shared memory), and consumer 0's ``Q K^T`` and
  exponentials of one tile run while consumer 1 is on the tensor cores
  with the other matmuls of the tile before.  As in
  :func:`_paired_dkv_kernel`, the hand-over is rounded to the input dtype
  (``dS``'s own rounding for its matmul is the same relative error), and
  a hand-over buffer is rewritten ``bwd_stages`` steps later, after the
  producer refilled its slot, which needed consumer 1's release of the
  slot after its read.
  """
  ((q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref),
   (qseg_ref, kvseg_ref, range_ref), refs) = _split_inputs(refs, prob)
  (dq_ref, q_smem, do_smem, k_ring, v_ring, qdo_ready, ready, free, hand,
   hand_ready, *extra) = refs
  a_smem = extra[0] if cfg.p_in_smem else None  # dS staged (consumer 1)
  free = pipeline.MBarriers(free)
  bq, bk, stages = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_stages
  mask = prob.mask
  b, h, wg, q_start, (u_lo, u_hi), own, grp, gap = _query_group(
      prob, range_ref, bq, bk)
  rows = (b, pl.ds(q_start, bq), h)
  own, everywhere = pipeline.flash_full_range(
      own, range_ref, b, grp, segment_ids=prob.has_segment_ids)
  own = pipeline.virtual_range(gap, own)

  def loop(compute, acc_ref=None):
    pipeline.tile_loop(
        u_lo, u_hi, own, first_step=0,
        compute=functools.partial(compute, acc=acc_ref),
        skip=pipeline.acknowledge(ready, free, stages),
        element_mask_everywhere=everywhere)
    return None if acc_ref is None else acc_ref[...]

  def hold(src_ref, smem, c, vec_ref):
    """Consumer ``c``'s start: its registers, its held tile of
    ``src_ref`` loaded into ``smem`` and its rows of ``vec_ref`` (lse2 or
    delta) in registers."""
    pipeline.split_registers(False, 2, cfg.bwd_consumer_registers)
    plgpu.copy_gmem_to_smem(src_ref.at[rows], smem, qdo_ready.at[c])
    vec = plgpu.load(vec_ref.at[b, h, pl.ds(q_start, bq)], layout=ROW,
                     optimized=False)
    plgpu.barrier_wait(qdo_ready.at[c])
    return vec

  @pl.when(wg == 0)
  def _probs_consumer():
    lse2 = hold(q_ref, q_smem, 0, lse2_ref)
    q_idx = pipeline.index_tile(q_start, (bq, bk), 0, vectors=False)

    def compute(step, t, carry, *, masked, acc):
      del acc
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(ready.at[slot])

      s = _product_t(q_smem, k_ring.at[slot], (bq, bk))  # S = Q K^T
      free.arrive(slot)  # K read; consumer 1 still holds the slot
      visible = _tile_mask(masked, mask, (qseg_ref, kvseg_ref), b,
                           q_start=q_start, n_q=bq,
                           k_start=pipeline.key_start(gap, t, bk), n_k=bk,
                           q_axis=0, held=q_idx)
      p, th = _probs(s, lse2, visible, prob=prob, row_axis=0)
      hand.at[slot][...] = (p if th is None
                            else p * (1.0 - th * th)).astype(dtype)
      plgpu.commit_smem()
      plgpu.barrier_arrive(hand_ready.at[slot])
      return carry

    loop(compute)

  @pl.when(wg == 1)
  def _dq_consumer():
    delta = hold(do_ref, do_smem, 1, delta_ref)

    def compute(step, t, carry, *, masked, acc):
      del t, masked  # the hand-over is masked already
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(ready.at[slot])

      dp = _product_t(do_smem, v_ring.at[slot], (bq, bk))  # dP = dO V^T
      plgpu.barrier_wait(hand_ready.at[slot])
      p = plgpu.load(hand.at[slot], layout=plgpu.Layout.WGMMA)
      ds = p.astype(jnp.float32) * (
          dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
      plgpu.wgmma(acc, _a_operand(ds, a_smem, dtype),
                  k_ring.at[slot])  # dQ += dS K
      plgpu.wgmma_wait(0)
      free.arrive(slot)
      return carry

    dq = pl.run_scoped(functools.partial(loop, compute),
                       plgpu.ACC((bq, prob.head_dim_padded), jnp.float32))
    # dS is w.r.t. the scaled logits: d(scale * q.k)/dq = scale * k.  dO's
    # buffer is free now (every dP wgmma has finished).
    do_smem[...] = (dq * prob.softmax_scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(do_smem, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    pipeline.split_registers(True, 2, cfg.bwd_consumer_registers)
    load = _key_tile_loader((k_ref, v_ref), (k_ring, v_ring), ready, b=b,
                            h=h, prob=prob, u_lo=u_lo, bk=bk, gap=gap)
    pipeline.produce(u_hi - u_lo, stages, load, [free])


def paired_dq(q, k, v, do, lse2, delta, segments, *, prob: Problem,
              cfg: MosaicConfig, interpret=None):
  """``dq`` padded like ``q`` by :func:`_paired_dq_kernel`
  (``bwd_paired_dq``); ``segments = (q_seg, kv_seg, q_group_range)``
  grouped by ``bwd_block_q`` queries."""
  _check_paired(prob)
  dtype = q.dtype
  dp = prob.head_dim_padded
  bq, bk, stages = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_stages
  # Q and dO held, K and V streamed (2 copies a slot).
  scratch = _paired_scratch(bq, bk, dp, stages, dtype, ready_arrivals=2)
  if cfg.p_in_smem:  # consumer 1's dS staged
    scratch.append(plgpu.SMEM((bq, bk), dtype,
                              **_operands_tiled(bq, bk, dp)))
  return pipeline.launch(
      functools.partial(_paired_dq_kernel, prob=prob, cfg=cfg, dtype=dtype),
      out_type=out_struct(q.shape, dtype, q, k, v), scratch=scratch,
      grid=(prob.num_heads, prob.q_pad // bq, prob.batch),
      grid_names=("heads", "q_seq", "batch"), consumers=2,
      interpret=interpret,
  )(q, k, v, do, lse2, delta, *(segments or ()))
