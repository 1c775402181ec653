"""The tile loop shared by the three kernels, and the mask inputs it reads.

Every kernel holds one tile ("held": a query tile for the forward and dQ
kernels, a key tile for dK/dV) and streams the tiles of the other sequence.
:func:`tile_loop` decides which streamed tiles to visit and whether each
needs the per-element mask, from

* the static :class:`~jaxflash.masks.MaskSpec` (causal, window, offset);
* per batch row, the valid lengths (``q_seq_lengths``/``kv_seq_lengths``);
* per tile, segment-id summaries (:func:`jaxflash.masks.tile_summary`):
  a streamed tile whose id range misses the held tile's is skipped, a pair
  of tiles of one shared id is fully visible.

The dynamic inputs travel as two small int32 arrays per kernel:
``held_info [B, 8, n_held]`` (rows: segment summary 0-2, overlapping
streamed-tile range 3-4, q_valid 5, kv_valid 6) and
``stream_info [B, 8, n_streamed]`` (rows 0-2: segment summary).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash import masks

INFO_ROWS = 8
ROW_RANGE_LO, ROW_RANGE_HI, ROW_Q_VALID, ROW_KV_VALID = 3, 4, 5, 6


class MaskInputs(NamedTuple):
  """Dynamic mask arrays of one call (a pytree), padded to whole tiles.

  ``q_seg``/``kv_seg``: ``[B, T_pad]``/``[B, S_pad]`` int32 (padding -1) or
  None; ``lengths``: ``[B, 2]`` int32 (q_valid, kv_valid) or None.
  """

  q_seg: jax.Array | None = None
  kv_seg: jax.Array | None = None
  lengths: jax.Array | None = None

  @property
  def has_segments(self) -> bool:
    return self.q_seg is not None

  @property
  def dynamic(self) -> bool:
    return self.q_seg is not None or self.lengths is not None


def info_arrays(m: MaskInputs, *, held_q: bool, held_block: int,
                stream_block: int, batch: int, held_len: int,
                stream_len: int):
  """``(held_info, stream_info)`` for one kernel's tiling (or Nones).

  Built by concatenation (no scatter), so the arrays inherit the batch
  sharding of their inputs under explicit-sharding meshes.
  """
  if not m.dynamic:
    return None, None
  n_held = held_len // held_block
  zeros = lambda n: jnp.zeros((batch, n, n_held), jnp.int32)
  rows = [zeros(3), zeros(2)]
  stream = None
  if m.has_segments:
    held_seg, stream_seg = (m.q_seg, m.kv_seg) if held_q else (m.kv_seg,
                                                               m.q_seg)
    hs = masks.tile_summary(held_seg, held_block)
    ss = masks.tile_summary(stream_seg, stream_block)
    rows = [hs, masks.overlap_range(hs, ss)]
    stream = jnp.concatenate(
        [ss, jnp.zeros((batch, INFO_ROWS - 3, ss.shape[-1]), jnp.int32)],
        axis=1)
  if m.lengths is not None:
    rows.append(jnp.broadcast_to(m.lengths[:, :, None], (batch, 2, n_held)))
  else:
    rows.append(zeros(2))
  rows.append(zeros(INFO_ROWS - 7))
  return jnp.concatenate(rows, axis=1), stream


def tile_loop(spec: masks.MaskSpec, *, held_q: bool, held_start,
              held_block: int, stream_block: int, held_info_ref,
              stream_info_ref, has_lengths: bool, body, carry,
              count_tiles: bool = False, dense_class=None,
              dense_range=None):
  """Runs ``body(t, carry, masked=...)`` over the live streamed tiles.

  ``held_info_ref``: this program's column of ``held_info`` (shape
  ``[8]``), or None; ``stream_info_ref``: this batch row's
  ``stream_info`` (``[8, n_streamed]``), or None.  ``dense_class(t)``:
  the dense mask's class of the tile pair (``masks.DENSE_HIDDEN``,
  ``DENSE_PARTIAL`` or ``DENSE_FULL``, a traced int32), or None.  Returns
  the carry, and with ``count_tiles`` also the number of tiles visited (a
  debug output).  ``dense_range``: ``(lo, hi)`` bounds of the streamed
  tiles the dense terms leave (traced), or None.
  """
  valid = {}
  if has_lengths:
    valid = dict(q_valid=held_info_ref[ROW_Q_VALID],
                 kv_valid=held_info_ref[ROW_KV_VALID])
  block_range = spec.kv_block_range if held_q else spec.q_block_range
  lo, full_lo, full_hi, hi = block_range(held_start, held_block,
                                         stream_block, **valid)
  count = jnp.int32(0)

  def counted(masked):
    def run(t, state):
      c, n = state
      return body(t, c, masked=masked), n + 1
    return run

  if stream_info_ref is None and dense_class is None:
    # Three runs: partial tiles, fully visible tiles (no mask arithmetic),
    # partial tiles.  Tiles outside [lo, hi) are never loaded.
    state = (carry, count)
    state = lax.fori_loop(lo, full_lo, counted(True), state)
    state = lax.fori_loop(full_lo, full_hi, counted(False), state)
    carry, count = lax.fori_loop(full_hi, hi, counted(True), state)
    return (carry, count) if count_tiles else carry

  # Per tile: the positional class, narrowed by the segment summaries and
  # the dense mask's; a hidden tile is skipped, a full one runs unmasked.
  if stream_info_ref is not None:
    held = [held_info_ref[r] for r in range(3)]
    lo = jnp.maximum(lo, held_info_ref[ROW_RANGE_LO])
    hi = jnp.minimum(hi, held_info_ref[ROW_RANGE_HI])
  if dense_range is not None:
    lo = jnp.maximum(lo, dense_range[0])
    hi = jnp.minimum(hi, dense_range[1])

  def visit(t, state):
    live = jnp.bool_(True)
    full = (t >= full_lo) & (t < full_hi)
    if stream_info_ref is not None:
      stream = [stream_info_ref[r, t] for r in range(3)]
      live = masks.tiles_overlap(held, stream)
      full = full & masks.tiles_segment_full(held, stream)
    if dense_class is not None:
      cls = dense_class(t)
      live = live & (cls != masks.DENSE_HIDDEN)
      full = full & (cls == masks.DENSE_FULL)
    run_full = functools.partial(counted(False), t)
    run_part = functools.partial(counted(True), t)
    return lax.cond(
        live, lambda s: lax.cond(full, run_full, run_part, s),
        lambda s: s, state)

  carry, count = lax.fori_loop(lo, jnp.maximum(lo, hi), visit,
                               (carry, count))
  return (carry, count) if count_tiles else carry


def kv_tile_visible(spec: masks.MaskSpec, q_idx, t, block_k: int, *,
                    valid: dict, q_seg, kv_seg_ref):
  """Element mask of streamed key tile ``t`` for a held query tile
  (``q_idx [block_q, block_k]``, ``q_seg [block_q, 1]`` or None)."""
  k_idx = t * block_k + lax.broadcasted_iota(jnp.int32, q_idx.shape, 1)
  seg = {}
  if q_seg is not None:
    seg = dict(q_seg=q_seg, k_seg=slice_tile(kv_seg_ref, t, block_k)[None, :])
  return spec.visible(q_idx, k_idx, **valid, **seg)


def q_tile_visible(spec: masks.MaskSpec, k_idx, t, block_q: int, *,
                   valid: dict, k_seg, q_seg_ref):
  """Element mask of streamed query tile ``t`` for a held key tile
  (``k_idx [block_q, block_k]``, ``k_seg [1, block_k]`` or None)."""
  q_idx = t * block_q + lax.broadcasted_iota(jnp.int32, k_idx.shape, 0)
  seg = {}
  if k_seg is not None:
    seg = dict(q_seg=slice_tile(q_seg_ref, t, block_q)[:, None], k_seg=k_seg)
  return spec.visible(q_idx, k_idx, **valid, **seg)


def slice_tile(ref, t, block: int):
  """``ref[t*block:(t+1)*block]`` along the first axis."""
  return ref[pl.ds(pl.multiple_of(t * block, block), block)]


def mask_specs_and_args(m: MaskInputs, held_info, stream_info, *,
                        held_q: bool, held_block: int, stream_len: int,
                        index_held):
  """BlockSpecs and arrays of a kernel's optional mask inputs, in the order
  the kernels unpack them: held_info, stream_info, held segment tile,
  streamed segment row.  ``index_held(*grid_indices) -> (batch, tile)``.
  """
  specs, args = [], []
  if held_info is not None:
    specs.append(pl.BlockSpec(
        (None, INFO_ROWS, None),
        lambda *ix: (index_held(*ix)[0], 0, index_held(*ix)[1])))
    args.append(held_info)
  if stream_info is not None:
    held_seg, stream_seg = (m.q_seg, m.kv_seg) if held_q else (m.kv_seg,
                                                               m.q_seg)
    specs += [
        pl.BlockSpec((None, INFO_ROWS, stream_info.shape[-1]),
                     lambda *ix: (index_held(*ix)[0], 0, 0)),
        pl.BlockSpec((None, held_block), lambda *ix: index_held(*ix)),
        pl.BlockSpec((None, stream_len), lambda *ix: (index_held(*ix)[0], 0)),
    ]
    args += [stream_info, held_seg, stream_seg]
  return specs, args


def split_mask_refs(has_segments: bool, has_lengths: bool, refs):
  """Inverse of :func:`mask_specs_and_args` inside a kernel: returns
  ``(held_info, stream_info, held_seg, stream_seg, remaining refs)``."""
  refs = list(refs)
  held_info = stream_info = held_seg = stream_seg = None
  if has_segments or has_lengths:
    held_info, refs = refs[0], refs[1:]
  if has_segments:
    stream_info, held_seg, stream_seg, refs = (refs[0], refs[1], refs[2],
                                               refs[3:])
  return held_info, stream_info, held_seg, stream_seg, refs
