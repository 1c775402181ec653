"""Dense bias and boolean mask inputs of the Triton kernels (``jax.nn``'s
``bias`` and ``mask``) and FlashMask's column ranges: their BlockSpecs,
and the tile reads inside the kernels.

Each array is ``[B|1, H|1, T_pad|1, S_pad]`` (an axis of size 1
broadcasts; only the key axis is always full) and is read tile by tile
with the Q/K tiles, never copied whole: the forward and dQ kernels hold
the rows of one query tile and slice key tiles from them; the dK/dV
kernel holds one key tile's columns for the query heads of its group and
slices query tiles.  The mask travels as int8 with a per-tile summary
(:func:`jaxflash.masks.dense_tile_summary`) that lets the tile loop skip
a tile with no visible pair and drop the element mask where all are
visible.  A FlashMask (:mod:`jaxflash.flashmask`) travels as its four
column vectors ``[B|1, H|1, 4, S_pad]`` (hidden rows ``[lt_start,
lt_end)`` and ``[ut_start, ut_end)`` of each key), with a summary of the
same form from :func:`jaxflash.flashmask.tile_class`: O(N) memory where the
dense mask is O(N^2).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxflash import flashmask, masks
from jaxflash._util import LOG2E
from jaxflash.triton.common import Problem


class DenseInputs(NamedTuple):
  """Padded dense arrays of one call (a pytree): ``bias`` in its dtype,
  ``mask`` int8, or None."""

  bias: jax.Array | None = None
  mask: jax.Array | None = None
  flash: jax.Array | None = None  # FlashMask columns [B|1, H|1, 4, S_pad]
  alibi: jax.Array | None = None  # ALiBi slopes [B|1, H, 1, 2]


NO_DENSE = DenseInputs()


def _row_index(axes, held_q: bool):
  """Index map of one dense array for a kernel whose grid is ``(tile, b,
  head)``: the batch and head blocks where those axes are full."""
  full_b, full_h, full_t = axes

  def index(tile, b, h):
    return ((b if full_b else 0), (h if full_h else 0),
            (tile if (held_q and full_t) else 0), (0 if held_q else tile))
  return index


def _with_range(summary, stream_full: bool):
  """A summary ``[b, h, n_held, n_stream]`` with two columns appended: per
  held tile, the first and one-past-last streamed tile that is not hidden
  (the tile loop visits no tile outside; an empty range ``[0, 0)`` when
  all are hidden).  Where the streamed axis is broadcast (size 1, a mask
  shared by every query row in the dK/dV tiling) the range is every tile
  or none."""
  n = summary.shape[-1]
  live = summary != masks.DENSE_HIDDEN
  idx = jnp.arange(n, dtype=jnp.int32)
  first = jnp.min(jnp.where(live, idx, n), axis=-1)
  last = jnp.max(jnp.where(live, idx + 1, 0), axis=-1)
  if not stream_full:
    first, last = jnp.zeros_like(first), jnp.where(last > 0, 2**30, 0)
  first = jnp.minimum(first, last)
  return jnp.concatenate([summary, first[..., None], last[..., None]],
                         axis=-1).astype(jnp.int32)


def _summary_spec(summary, axes, prob: Problem, held_q: bool):
  full_b, full_h, full_t = axes
  if held_q:
    return pl.BlockSpec(
        (None, None, None, summary.shape[-1]),
        lambda i, b, h: ((b if full_b else 0), (h if full_h else 0),
                         (i if full_t else 0), 0))
  return pl.BlockSpec(
      (None, prob.group if full_h else 1, None, summary.shape[-1]),
      lambda j, b, h: ((b if full_b else 0), (h if full_h else 0), j, 0))


def flash_summary(cols, q_pad: int, block_q: int, block_k: int, *,
                  transpose: bool = False):
  """The FlashMask columns' tile classes in the dense mask's encoding
  (:func:`jaxflash.masks.dense_tile_summary`), ``[b, h, n_q, n_k]`` (or
  transposed) for the tiling ``(block_q, block_k)``."""
  cls = flashmask.column_tile_classes(cols, q_pad, block_q, block_k)
  cls = jnp.where(cls == flashmask.TILE_VISIBLE, masks.DENSE_FULL,
                  jnp.where(cls == flashmask.TILE_HIDDEN, masks.DENSE_HIDDEN,
                            masks.DENSE_PARTIAL)).astype(jnp.int32)
  return jnp.swapaxes(cls, 2, 3) if transpose else cls


def specs_and_args(dense: DenseInputs, prob: Problem, *, held_q: bool,
                   block_q: int, block_k: int):
  """BlockSpecs and arrays of the dense inputs of one kernel, in the order
  :func:`split_refs` unpacks them: bias, mask, the mask's tile summary,
  FlashMask columns, their tile summary.

  ``held_q``: the forward / dQ tiling (a query tile's rows, all keys);
  otherwise the dK/dV tiling (a key tile's columns, all query rows of the
  group's heads, ``prob.group`` of them where heads are full)."""
  specs, args = [], []
  for x, axes in ((dense.bias, prob.bias_axes), (dense.mask,
                                                 prob.mask_axes)):
    if x is None:
      continue
    full_t = axes[2]
    if held_q:
      block = (None, None, block_q if full_t else 1, prob.kv_pad)
    else:
      block = (None, prob.group if axes[1] else 1,
               prob.q_pad if full_t else 1, block_k)
    specs.append(pl.BlockSpec(block, _row_index(axes, held_q)))
    args.append(x)
  if dense.mask is not None:
    summary = _with_range(
        masks.dense_tile_summary(dense.mask, block_q, block_k,
                                 transpose=not held_q),
        stream_full=held_q or prob.mask_axes[2])
    specs.append(_summary_spec(summary, prob.mask_axes, prob, held_q))
    args.append(summary)
  if dense.flash is not None:
    full_b, full_h = prob.flash_axes
    if held_q:
      specs.append(pl.BlockSpec(
          (None, None, 4, prob.kv_pad),
          lambda i, b, h: ((b if full_b else 0), (h if full_h else 0), 0,
                           0)))
    else:
      specs.append(pl.BlockSpec(
          (None, prob.group if full_h else 1, 4, block_k),
          lambda j, b, h: ((b if full_b else 0), (h if full_h else 0), 0,
                           j)))
    summary = _with_range(flash_summary(dense.flash, prob.q_pad, block_q,
                                        block_k, transpose=not held_q),
                          stream_full=True)
    specs.append(_summary_spec(summary, (full_b, full_h, True), prob,
                               held_q))
    args += [dense.flash, summary]
  if dense.alibi is not None:
    full_b = prob.alibi_batch
    if held_q:
      specs.append(pl.BlockSpec(
          (None, None, None, 2),
          lambda i, b, h: ((b if full_b else 0), h, 0, 0)))
    else:
      specs.append(pl.BlockSpec(
          (None, prob.group, None, 2),
          lambda j, b, h: ((b if full_b else 0), h, 0, 0)))
    args.append(dense.alibi)
  return specs, args


class DenseRefs(NamedTuple):
  """A kernel's refs of the dense inputs (None where absent)."""

  bias: object = None
  mask: object = None
  mask_summary: object = None
  flash: object = None
  flash_summary: object = None
  alibi: object = None


def split_refs(prob: Problem, refs):
  """``(DenseRefs, remaining refs)``, the inverse of
  :func:`specs_and_args`."""
  refs = list(refs)
  bias = mask = summary = flash = flash_summary_ref = alibi = None
  if prob.bias_axes is not None:
    bias, refs = refs[0], refs[1:]
  if prob.mask_axes is not None:
    mask, summary, refs = refs[0], refs[1], refs[2:]
  if prob.flash_axes is not None:
    flash, flash_summary_ref, refs = refs[0], refs[1], refs[2:]
  if prob.alibi_batch is not None:
    alibi, refs = refs[0], refs[1:]
  return DenseRefs(bias, mask, summary, flash, flash_summary_ref,
                   alibi), refs


def _tile(ref, axes, *, held_q: bool, t, g, block: int):
  """One ``[block_q | 1, block_k]`` tile of a dense array's block."""
  if held_q:  # ref [T_tile | 1, S_pad]: slice key tile t
    return ref[:, pl.ds(pl.multiple_of(t * block, block), block)]
  rows = (pl.ds(pl.multiple_of(t * block, block), block) if axes[2]
          else pl.ds(0, 1))
  return ref[g if axes[1] else 0, rows, :]  # ref [G|1, T_pad|1, bk]


def add_bias(s2, refs: DenseRefs, prob: Problem, *, held_q: bool, t,
             g=None, block: int, q_idx, k_idx):
  """Base-2 logits plus the dense bias's tile and ALiBi's (converted to
  base 2 like them); ``q_idx``, ``k_idx``: the tile's positions."""
  if refs.bias is not None:
    b = _tile(refs.bias, prob.bias_axes, held_q=held_q, t=t, g=g,
              block=block)
    s2 = s2 + b.astype(jnp.float32) * LOG2E
  if refs.alibi is not None:
    slope, shift = ((refs.alibi[0], refs.alibi[1]) if held_q
                    else (refs.alibi[g, 0], refs.alibi[g, 1]))
    s2 = s2 + masks.alibi_bias(slope, q_idx, k_idx, prob.mask.offset,
                               shift) * LOG2E
  return s2


def has_bias(prob: Problem) -> bool:
  return prob.bias_axes is not None or prob.alibi_batch is not None


def visible_tile(refs: DenseRefs, prob: Problem, *, held_q: bool, t, g=None,
                 block: int, q_idx):
  """The dense mask's and the FlashMask's element mask of one tile (bool,
  broadcastable to it), or None when neither is given.  ``q_idx``: the
  tile's query rows ``[block_q, block_k]``."""
  vis = None
  if refs.mask is not None:
    vis = _tile(refs.mask, prob.mask_axes, held_q=held_q, t=t, g=g,
                block=block) != 0
  if refs.flash is not None:
    if held_q:  # [4, S_pad]: key tile t
      keys = pl.ds(pl.multiple_of(t * block, block), block)
      c = lambda r: refs.flash[r, keys][None, :]
    else:       # [G|1, 4, bk]: this key tile, head g
      head = g if prob.flash_axes[1] else 0
      c = lambda r: refs.flash[head, r, :][None, :]
    # FlashMask: key j is hidden from rows [lt_start, lt_end) and
    # [ut_start, ut_end) (arXiv 2410.01359).
    hidden = (((c(0) <= q_idx) & (q_idx < c(1)))
              | ((c(2) <= q_idx) & (q_idx < c(3))))
    vis = ~hidden if vis is None else vis & ~hidden
  return vis


def tile_class(refs: DenseRefs, prob: Problem, *, held_q: bool, g=None):
  """``t -> class`` of streamed tile ``t`` for the tile loop (or None):
  the dense mask's and the FlashMask's classes combined (the encoding
  makes ``&`` their conjunction: hidden 0, partial 1, full 3)."""
  classes = []
  if refs.mask_summary is not None:
    classes.append(_summary_class(refs.mask_summary, prob.mask_axes,
                                  held_q=held_q, g=g))
  if refs.flash_summary is not None:
    classes.append(_summary_class(refs.flash_summary,
                                  (*prob.flash_axes, True), held_q=held_q,
                                  g=g))
  if not classes:
    return None
  if len(classes) == 1:
    return classes[0]
  return lambda t: classes[0](t) & classes[1](t)


def stream_range(refs: DenseRefs, prob: Problem, *, held_q: bool, g=None):
  """``(lo, hi)``: the streamed tiles the dense mask and the FlashMask
  leave (the intersection of their summaries' ranges), or None."""
  out = None
  for ref, axes in ((refs.mask_summary, prob.mask_axes),
                    (refs.flash_summary, (*(prob.flash_axes or ()), True))):
    if ref is None:
      continue
    n = ref.shape[-1] - 2
    if held_q:
      lo, hi = ref[n], ref[n + 1]
    else:
      head = g if axes[1] else 0
      lo, hi = ref[head, n], ref[head, n + 1]
    out = (lo, hi) if out is None else (jnp.maximum(out[0], lo),
                                        jnp.minimum(out[1], hi))
  return out


def _summary_class(ref, axes, *, held_q: bool, g):
  if held_q:
    return lambda t: ref[t]
  head = g if axes[1] else 0
  return lambda t: ref[head, t if axes[2] else 0]
