"""Dense bias and boolean mask inputs of the Triton kernels (``jax.nn``'s
``bias`` and ``mask``): their BlockSpecs, and the tile reads inside the
kernels.

Each array is ``[B|1, H|1, T_pad|1, S_pad]`` (an axis of size 1
broadcasts; only the key axis is always full) and is read tile by tile
with the Q/K tiles, never copied whole: the forward and dQ kernels hold
the rows of one query tile and slice key tiles from them; the dK/dV
kernel holds one key tile's columns for the query heads of its group and
slices query tiles.  The mask travels as int8 with a per-tile summary
(:func:`jaxflash.masks.dense_tile_summary`) that lets the tile loop skip
a tile with no visible pair and drop the element mask where all are
visible.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxflash import masks
from jaxflash._util import LOG2E
from jaxflash.triton.common import Problem


class DenseInputs(NamedTuple):
  """Padded dense arrays of one call (a pytree): ``bias`` in its dtype,
  ``mask`` int8, or None."""

  bias: jax.Array | None = None
  mask: jax.Array | None = None


NO_DENSE = DenseInputs()


def _row_index(axes, held_q: bool):
  """Index map of one dense array for a kernel whose grid is ``(tile, b,
  head)``: the batch and head blocks where those axes are full."""
  full_b, full_h, full_t = axes

  def index(tile, b, h):
    return ((b if full_b else 0), (h if full_h else 0),
            (tile if (held_q and full_t) else 0), (0 if held_q else tile))
  return index


def specs_and_args(dense: DenseInputs, prob: Problem, *, held_q: bool,
                   block_q: int, block_k: int):
  """BlockSpecs and arrays of the dense inputs of one kernel, in the order
  :func:`split_refs` unpacks them: bias, mask, the mask's tile summary.

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
    full_b, full_h, full_t = prob.mask_axes
    summary = masks.dense_tile_summary(dense.mask, block_q, block_k,
                                       transpose=not held_q)
    if held_q:
      block = (None, None, None, summary.shape[-1])
      index = lambda i, b, h: ((b if full_b else 0), (h if full_h else 0),
                               (i if full_t else 0), 0)
    else:
      block = (None, prob.group if full_h else 1, None, summary.shape[-1])
      index = lambda j, b, h: ((b if full_b else 0), (h if full_h else 0),
                               j, 0)
    specs.append(pl.BlockSpec(block, index))
    args.append(summary)
  return specs, args


def split_refs(prob: Problem, refs):
  """``(bias_ref, mask_ref, summary_ref, remaining refs)`` (None where
  absent), the inverse of :func:`specs_and_args`."""
  refs = list(refs)
  bias = mask = summary = None
  if prob.bias_axes is not None:
    bias, refs = refs[0], refs[1:]
  if prob.mask_axes is not None:
    mask, summary, refs = refs[0], refs[1], refs[2:]
  return bias, mask, summary, refs


def _tile(ref, axes, *, held_q: bool, t, g, block: int):
  """One ``[block_q | 1, block_k]`` tile of a dense array's block."""
  if held_q:  # ref [T_tile | 1, S_pad]: slice key tile t
    return ref[:, pl.ds(pl.multiple_of(t * block, block), block)]
  rows = (pl.ds(pl.multiple_of(t * block, block), block) if axes[2]
          else pl.ds(0, 1))
  return ref[g if axes[1] else 0, rows, :]  # ref [G|1, T_pad|1, bk]


def add_bias(s2, bias_ref, prob: Problem, *, held_q: bool, t, g=None,
             block: int):
  """Base-2 logits plus the bias tile (converted to base 2 like them)."""
  b = _tile(bias_ref, prob.bias_axes, held_q=held_q, t=t, g=g, block=block)
  return s2 + b.astype(jnp.float32) * LOG2E


def mask_tile(mask_ref, prob: Problem, *, held_q: bool, t, g=None,
              block: int):
  """The dense mask's tile as a bool array (broadcastable to the tile)."""
  return _tile(mask_ref, prob.mask_axes, held_q=held_q, t=t, g=g,
               block=block) != 0


def tile_class(summary_ref, prob: Problem, *, held_q: bool, g=None):
  """``t -> class`` of streamed tile ``t`` for the tile loop (or None)."""
  if summary_ref is None:
    return None
  if held_q:
    return lambda t: summary_ref[t]
  full_t = prob.mask_axes[2]
  head = g if prob.mask_axes[1] else 0
  return lambda t: summary_ref[head, t if full_t else 0]

