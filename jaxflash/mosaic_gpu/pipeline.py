"""The producer/consumer tile pipeline shared by the Hopper kernels.

A producer warpgroup fills a ``stages``-deep shared-memory ring with TMA
copies (slot ``step % stages``), each slot completing on a "ready" barrier;
consumer warpgroups release slots on "free" barriers.  Every consumer
observes every step of the ring: it computes the steps of the tiles it
needs and only acknowledges ("skips") those that only another consumer of
the program needs, so every barrier phase is waited on by every
warpgroup (the invariant Mosaic GPU's barriers need).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic import gpu as mgpu

from jaxflash import flashmask
from jaxflash.masks import (
  dropout_col_keys,
  dropout_keep_from_keys,
  dropout_row_keys,
)
from jaxflash.mosaic_gpu.config import (
  DEFAULT_CONSUMER_REGISTERS,
  MIN_REGISTERS,
  THREE_CONSUMER_REGISTERS,
  producer_registers,
  swizzle_columns,
)


def tiled_over(contraction: int, itemsize: int = 2) -> dict:
  """The shared-memory layout of a wgmma operand whose contraction runs
  along its major dimension, ``contraction`` long (V in ``P V``, and
  ``P`` staged in shared memory): the widest swizzle whose width in
  ``itemsize``-byte elements divides it.  Mosaic GPU's wgmma needs the
  contraction to be a multiple of that width (``K must be a multiple of
  64, got: 80`` at the 128-byte swizzle), so FlashAttention-3's 80- and
  176-key tiles take the 32-byte swizzle (16 elements)."""
  cols = swizzle_columns(contraction, itemsize)
  return dict(transforms=(plgpu.TilingTransform((8, cols)),
                          plgpu.SwizzleTransform(itemsize * cols)))


# Rows of the tiling Mosaic GPU applies to both ends of a tiled TMA copy
# (mosaic/gpu/launch_context.py, TileTransform): a global array's row count
# must be a multiple of it (or smaller) for a copy into a tiled buffer.
TMA_ROW_TILE = 8


def one_swizzle_wide(columns: int, itemsize: int = 2) -> bool:
  """Whether rows ``columns`` wide are exactly one swizzle wide (16-bit
  head_dims 64, 32 or 16): then :func:`tiled_over`'s ``(8, columns)``
  tiles, row after row, are the bytes of the plain rows swizzled alike,
  and :func:`row_buffer` can give a buffer a second, row-wise view."""
  return swizzle_columns(columns, itemsize) == columns


def row_buffer(shape, dtype):
  """A shared-memory buffer ``shape`` (its rows one swizzle wide:
  :func:`one_swizzle_wide`) with two views of the same bytes, unpacked
  by :func:`row_views`: the tiled one wgmma and the register stores take
  (:func:`tiled_over`), and a swizzle-only one for the TMA copies.  A
  copy into the tiled view tiles the global array too, so its row count
  must be a multiple of :data:`TMA_ROW_TILE`; the row view's copies take
  any row count (TMA zero-fills the rows past the array and clips a
  store to it), so a call of 577 rows needs no padded copy of its
  arrays.  Only on the GPU: the interpreter gives each view of a union a
  buffer of its own."""
  dtype = jnp.dtype(dtype)
  columns = shape[-1]
  if not one_swizzle_wide(columns, dtype.itemsize):
    raise ValueError(f"row_buffer: rows of {columns} {dtype} elements are"
                     f" not one swizzle wide")
  tiled = plgpu.SMEM(shape, dtype, **tiled_over(columns, dtype.itemsize))
  rows = plgpu.SMEM(shape, dtype, transforms=(
      plgpu.SwizzleTransform(dtype.itemsize * columns),))
  return plgpu.RefUnion(tiled, rows)


def operand_buffer(shape, dtype, tiled: dict, rows: bool):
  """A 16-bit wgmma operand's shared-memory buffer: laid out as ``tiled``
  (:func:`tiled_over`'s dict) says, or with ``rows`` a
  :func:`row_buffer` (the same tiles and a row view for its copies)."""
  return (row_buffer(shape, dtype) if rows
          else plgpu.SMEM(shape, dtype, **tiled))


def row_views(ref, rows: bool):
  """``(tiled, rows)`` views of a scratch buffer: a :func:`row_buffer`'s
  two where ``rows``, else the plain buffer twice (copies go through the
  tiled view)."""
  return tuple(ref) if rows else (ref, ref)


def launch(body, *, out_type, scratch, grid, grid_names, consumers: int,
           interpret, reduction_scratch_bytes: int | None = None,
           cluster: int = 1):
  """``plgpu.kernel`` in the layout every jaxflash Hopper kernel uses:
  ``consumers`` compute warpgroups plus one producer (thread axis
  ``"wg"``, the producer last), hardware-approximate ``exp2``/``tanh``.
  ``reduction_scratch_bytes``: shared memory for cross-warp reductions
  (None: Pallas' default; lowering fails if a reduction needs more).
  ``cluster`` > 1: CTAs per cluster (axis ``"cluster"``; ``grid`` then
  counts clusters)."""
  params = dict(approx_math=True)
  if reduction_scratch_bytes is not None:
    params["reduction_scratch_bytes"] = reduction_scratch_bytes
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=grid,
      grid_names=grid_names, num_threads=consumers + 1, thread_name="wg",
      **(dict(cluster=(cluster,), cluster_names=("cluster",))
         if cluster > 1 else {}),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(**params))


# Hardware named barriers (``bar.arrive`` / ``bar.sync``): 16 per CTA;
# Mosaic GPU uses id 0 and 1 + warpgroup index for its own barriers: 0-3
# with three warpgroups (tokamax's sm90 kernel starts at 4 as well), 0-4
# with four (the forward's three consumers, which run no ping-pong: its
# ids 4 and 5 stay unused there and the rings start at 6).
FIRST_NAMED_BARRIER = 4


def named_barrier(op: str, barrier_id, num_threads: int) -> None:
  """``bar.<op> id, num_threads`` from every thread of the warpgroup
  (inline Mosaic GPU, which the interpreter does not run)."""
  # The PTX is named in the function's qualname, which the traced program
  # prints (tools/kernel_fingerprint.py then sees a change of it).
  if isinstance(barrier_id, int):
    def static(_):
      mgpu.utils.inline_ptx(f"bar.{op} {barrier_id}, {num_threads};")
    static.__qualname__ = f"bar.{op}.{barrier_id}.{num_threads}"
    plgpu.inline_mgpu()(static)()
  else:
    def dynamic(_, barrier_id):
      mgpu.utils.inline_ptx(f"bar.{op} $0, {num_threads};",
                            barrier_id.registers[()])
    dynamic.__qualname__ = f"bar.{op}.dynamic.{num_threads}"
    plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))(dynamic)(
        barrier_id)


@dataclasses.dataclass(frozen=True)
class MBarriers:
  """A ring's "free" signals as mbarriers: ``ref`` is a Barrier scratch
  with one barrier per slot (the interpretable form)."""

  ref: object

  def arrive(self, slot) -> None:
    plgpu.barrier_arrive(self.ref.at[slot])

  def wait(self, slot) -> None:
    plgpu.barrier_wait(self.ref.at[slot])


@dataclasses.dataclass(frozen=True)
class NamedBarriers:
  """A ring's "free" signals as hardware named barriers, ids ``base +
  slot``: each consumer thread ``bar.arrive``s, the producer warpgroup
  ``bar.sync``s (``threads`` = all of them).  Against an mbarrier there is
  no phase to track and no try-wait loop: the producer thread sleeps in
  hardware until the count is reached.  A slot's arrivals must not run a
  round ahead of the producer's sync; they cannot, since a consumer
  releases a slot again only after the producer refilled it, which took
  that sync."""

  base: int
  threads: int

  def arrive(self, slot) -> None:
    named_barrier("arrive", self.base + slot, self.threads)

  def wait(self, slot) -> None:
    named_barrier("sync", self.base + slot, self.threads)


def ring_free(barrier_ref, named: bool, n_consumers: int,
              first: int = FIRST_NAMED_BARRIER):
  """A ring's "free" signals, ``.arrive(slot)`` by each consumer and
  ``.wait(slot)`` by the producer: its mbarriers ``barrier_ref``, or with
  ``named`` hardware named barriers ``first + slot`` (every consumer
  thread and the producer warpgroup take part)."""
  if not named:
    return MBarriers(barrier_ref)
  return NamedBarriers(first, (n_consumers + 1) * 128)


def flash_visible(flash_ref, b, q_idx, k_start, n_k: int, shape, *,
                  key_axis: int):
  """The FlashMask's element mask of one tile (arXiv 2410.01359): key
  ``j`` is hidden from the rows ``[lt_start, lt_end)`` and ``[ut_start,
  ut_end)`` of its column.  ``flash_ref [B, n, Sp]`` (GMEM): the fields
  the mask has (:func:`jaxflash.flashmask.present`), only those read and
  compared; the tile's keys ``[k_start, k_start + n_k)`` along
  ``key_axis`` of ``shape``, ``q_idx`` its query index (a row or column
  vector broadcast by :func:`index_tile`, or a tile)."""
  layout = (plgpu.Layout.WGMMA.reduce(0) if key_axis == 1
            else plgpu.Layout.WGMMA.reduce(1))
  have = flashmask.present(flash_ref)

  def col(field):
    # Straight from GMEM into the tile's key layout (a plain load).
    c = plgpu.load(flash_ref.at[b, have.index(field), pl.ds(k_start, n_k)],
                   layout=layout, optimized=False)
    return lax.broadcast_in_dim(c, shape, [key_axis])

  # Outside both ranges (written without a bool negation, which Mosaic
  # GPU does not lower for register tiles); an absent lt_end is past
  # every row, an absent upper range empty.
  visible = q_idx < col(0)
  if 1 in have:
    visible = visible | (q_idx >= col(1))
  if 2 in have:
    visible = visible & ((q_idx < col(2)) | (q_idx >= col(3)))
  return visible


# -- element terms of one tile -------------------------------------------------
# Read or computed per tile by the forward (in the layout of S, queries
# along axis 0: q_axis=0) and the backward kernels (the dQ kernel's S, the
# dK/dV kernel's S^T: q_axis=1); per-query and per-key values are built
# on their vectors and broadcast (index_tile).

def _tile_shape(n_q: int, n_k: int, q_axis: int) -> tuple[int, int]:
  return (n_q, n_k) if q_axis == 0 else (n_k, n_q)


def _vector_layout(axis: int):
  """The layout of a vector along ``axis`` of a wgmma tile."""
  return plgpu.Layout.WGMMA.reduce(1 - axis)


def _batch_head(ref, b, h):
  """``ref [B | 1, H | 1, ...]`` at batch row ``b`` and head ``h`` (an
  axis of 1 shared)."""
  return ref.at[b if ref.shape[0] > 1 else 0, h if ref.shape[1] > 1 else 0]


def key_row(ref, b, h, *, k_start, n_k: int, n_q: int, q_axis: int):
  """One row of keys for every query (``ref [B | 1, H | 1, 1, keys]``,
  an axis of 1 shared; a key padding bias or mask) of the tile's keys
  ``[k_start, k_start + n_k)``, read from GMEM (a plain load, as the
  segment ids) and broadcast over its queries."""
  src = _batch_head(ref, b, h)
  row = plgpu.load(src.at[0, pl.ds(k_start, n_k)],
                   layout=_vector_layout(1 - q_axis), optimized=False)
  return lax.broadcast_in_dim(row, _tile_shape(n_q, n_k, q_axis),
                              [1 - q_axis])


def dense_mask_tile(ref, b, h, *, q_start, n_q: int, k_start, n_k: int,
                    q_axis: int):
  """A dense boolean mask's tile (int8 in GMEM, ``[B | 1, H | 1, rows,
  keys]``, an axis of 1 shared; the dK/dV kernel's transposed, keys
  first), read from GMEM; one row of keys for every query (a key padding
  mask) broadcast over the queries."""
  src = _batch_head(ref, b, h)
  if src.shape[0] == 1:
    return key_row(ref, b, h, k_start=k_start, n_k=n_k, n_q=n_q,
                   q_axis=q_axis) != 0
  rows, cols = (q_start, n_q), (k_start, n_k)
  if q_axis == 1:
    rows, cols = cols, rows
  tile = plgpu.load(src.at[pl.ds(*rows), pl.ds(*cols)],
                    layout=plgpu.Layout.WGMMA, optimized=False)
  return tile != 0


def alibi_tile(table_ref, b, h, offset: int, *, q_start, n_q: int, k_start,
               n_k: int, q_axis: int):
  """ALiBi's bias ``-slope * |i + offset - j + shift|`` of one tile from
  ``table_ref [B, H, 2]`` (each head's slope, in the units of the logits
  it is added to, and shift: a block pair's offset), computed from the
  tile's index vectors (:func:`jaxflash.masks.alibi_bias`)."""
  shape = _tile_shape(n_q, n_k, q_axis)
  q_idx = index_tile(q_start + offset, shape, q_axis)
  k_idx = index_tile(k_start, shape, 1 - q_axis)
  slope, shift = table_ref[b, h, 0], table_ref[b, h, 1]
  return jnp.abs((q_idx - k_idx).astype(jnp.float32) + shift) * (-slope)


def dropped(x, keep, rate: float):
  """``x`` under attention dropout's keep mask: kept entries scaled by
  ``1 / (1 - rate)``, the others 0 (the forward's ``P`` for ``P V``, the
  backward's ``P`` for dV and ``dP`` for dS)."""
  return jnp.where(keep, x * (1.0 / (1.0 - rate)), 0.0)


def dropout_keep_tile(table_ref, b, h, heads: int, rate: float, *, q_start,
                      n_q: int, k_start, n_k: int, q_axis: int):
  """Attention dropout's keep mask of one tile: the hash of
  :func:`jaxflash.masks.dropout_keep_from_keys` (the queries' keys hashed
  on their vector, the keys' on theirs, one mix per pair) from the table
  ``[B, heads + 2]`` int32 (each head's key, then the first row's and
  key's offsets)."""
  row0, col0 = table_ref[b, heads], table_ref[b, heads + 1]
  shape = _tile_shape(n_q, n_k, q_axis)
  q_layout, k_layout = _vector_layout(q_axis), _vector_layout(1 - q_axis)
  # (The head's key as a vector: the hash's uint32 casts lower for
  # arrays, not scalars.)
  key = plgpu.layout_cast(jnp.full((n_q,), table_ref[b, h]), q_layout)
  rows = q_start + row0 + plgpu.broadcasted_iota(jnp.int32, (n_q,), 0,
                                                 layout=q_layout)
  cols = k_start + col0 + plgpu.broadcasted_iota(jnp.int32, (n_k,), 0,
                                                 layout=k_layout)
  row_key, row_key2 = dropout_row_keys(key, rows)
  bcast = lambda x, axis: lax.broadcast_in_dim(x, shape, [axis])
  return dropout_keep_from_keys(
      bcast(row_key, q_axis), bcast(row_key2, q_axis),
      bcast(dropout_col_keys(cols), 1 - q_axis), rate)


def narrow_to_segments(u_lo, u_hi, range_ref, b, group):
  """Clip a work item's streamed tile range ``[u_lo, u_hi)`` to the tiles
  whose segment ids can match its own (``range_ref [B, 2, n_groups]``,
  from :func:`jaxflash.masks.overlap_range`); unchanged without segments."""
  if range_ref is None:
    return u_lo, u_hi
  u_lo = jnp.maximum(u_lo, range_ref[b, 0, group])
  u_hi = jnp.maximum(jnp.minimum(u_hi, range_ref[b, 1, group]), u_lo)
  return u_lo, u_hi


@dataclasses.dataclass(frozen=True)
class TileGap:
  """Streamed tiles ``[lo, lo + length)`` that a work item's walk skips:
  hidden from every row of the item (a FlashMask's or a dense mask's
  longest hidden run, :func:`jaxflash.flashmask.tile_runs`).  The ring
  steps count the walk's tiles, so an item's tiles are numbered
  contiguously ("virtual" tiles): virtual tile ``v`` is tile ``v +
  length`` from ``lo`` on."""

  lo: object
  length: object

  def tile(self, v):
    """The streamed tile of virtual tile ``v``."""
    return v + jnp.where(v >= self.lo, self.length, 0)

  def virtual(self, t):
    """Tile ``t`` (a range bound) as a virtual tile: the gap's tiles and
    its end map to its start."""
    return t - jnp.clip(t - self.lo, 0, self.length)


def tile_gap(u_lo, u_hi, range_ref, b, group):
  """``(u_hi, gap)`` of a work item streaming tiles ``[u_lo, u_hi)``: the
  gap, rows 4 and 5 of ``range_ref [B, 6, n_groups]`` clipped to the
  item's tiles, and ``u_hi`` in virtual tiles (less the gap); ``(u_hi,
  None)`` where the ranges have no gap rows (no FlashMask or dense
  mask)."""
  if range_ref is None or range_ref.shape[1] < 6:
    return u_hi, None
  lo = jnp.clip(range_ref[b, 4, group], u_lo, u_hi)
  hi = jnp.clip(range_ref[b, 5, group], lo, u_hi)
  return u_hi - (hi - lo), TileGap(lo, hi - lo)


def key_start(gap: TileGap | None, t, block: int):
  """The first key of virtual tile ``t`` of ``block`` keys."""
  return (t if gap is None else gap.tile(t)) * block


def virtual_range(gap: TileGap | None, own):
  """A consumer's tile range ``own`` (:func:`tile_loop`'s) in the walk's
  virtual tiles."""
  return own if gap is None else tuple(gap.virtual(x) for x in own)


def flash_full_range(own, range_ref, b, held, *, segment_ids: bool):
  """``(own, element_mask_everywhere)`` for :func:`tile_loop`: ``own``
  unchanged without segment inputs; with segment ids or lengths every
  computed tile takes the element mask; with a FlashMask alone
  (``range_ref [B, 4, n_held]``, rows 2 and 3 the run of streamed tiles
  it leaves fully visible to held tile ``held``) the fully visible range
  narrows to that run, the other tiles taking the element mask."""
  if range_ref is None:
    return own, False
  if segment_ids:
    return own, True
  lo, full_lo, full_hi, hi = own
  return (lo, jnp.maximum(full_lo, range_ref[b, 2, held]),
          jnp.minimum(full_hi, range_ref[b, 3, held]), hi), False


def split_registers(is_producer: bool, n_consumers: int,
                    consumer_registers: int | None = None) -> None:
  """With two or three consumers, move registers from the producer (which
  only issues TMA copies) to the consumers' float32 accumulators:
  ``consumer_registers`` per consumer thread (232 as tokamax, leaving the
  producer 40; 240 as FlashAttention-3, leaving it 24), the rest to the
  producer (at most 40; :func:`config.producer_registers`, whose rule
  MosaicConfig enforces).  None: 232 for two consumers, 160 for three
  (``THREE_CONSUMER_REGISTERS``, the producer 32)."""
  if consumer_registers is None:
    consumer_registers = (THREE_CONSUMER_REGISTERS if n_consumers == 3
                          else DEFAULT_CONSUMER_REGISTERS)
  if n_consumers >= 2:
    if producer_registers(consumer_registers, n_consumers) < MIN_REGISTERS:
      raise ValueError(
          f"{n_consumers} consumers of {consumer_registers} registers leave"
          f" the producer fewer than {MIN_REGISTERS}")
    if is_producer:
      plgpu.set_max_registers(
          min(40, producer_registers(consumer_registers, n_consumers)),
          action="decrease")
    else:
      plgpu.set_max_registers(consumer_registers, action="increase")


def _wait_free(barriers, slot) -> None:
  """The producer waits until every ``barriers`` says ``slot`` is free."""
  for barrier in barriers:
    barrier.wait(slot)


def produce(n_steps, stages: int, load, free_barriers) -> None:
  """Producer side: ``load(step, slot)`` for ``step in [0, n_steps)``.

  The first ``stages`` loads fill the empty ring; later ones wait until the
  consumers freed the slot.  A final drain observes the consumers' last
  releases, so no barrier phase is left unobserved when the kernel ends.
  """
  produce_split(n_steps, stages, [(free_barriers, load)])


def produce_split(n_steps, stages: int, loads) -> None:
  """:func:`produce` with operands released apart: ``loads =
  [(free_barriers, load), ...]``, each ``load(step, slot)`` issued as soon
  as its own barriers say the slot is free (``intra_wg_overlap``: K frees
  a step before V)."""
  for i in range(stages):
    for _, load in loads:
      pl.when(i < n_steps)(functools.partial(
          lambda load, i: load(jnp.int32(i), i), load, i))

  @pl.loop(stages, jnp.maximum(n_steps, stages))
  def _(step):
    slot = lax.rem(step, stages)
    for barriers, load in loads:
      _wait_free(barriers, slot)
      load(step, slot)

  @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
  def _(step):
    for barriers, _ in loads:
      _wait_free(barriers, lax.rem(step, stages))


def produce_continuing(first_step, n_steps, stages: int, loads,
                       start=0) -> None:
  """Producer side of one work item of a persistent kernel: ring steps
  ``first_step + [start, n_steps)``, each ``load(step, slot)`` of ``loads
  = [(free_barriers, load), ...]`` with the item's own ``step``, issued
  once its own barriers say the slot is free (as :func:`produce_split`).
  The ring is drained once at the end (:func:`drain`)."""
  @pl.loop(start, n_steps)
  def _(step):
    ring_step = first_step + step
    slot = lax.rem(ring_step, stages)
    for barriers, load in loads:
      pl.when(ring_step >= stages)(
          functools.partial(_wait_free, barriers, slot))

      load(step, slot)


def drain(total_steps, stages: int, free_barriers) -> None:
  """Observe the consumers' releases of the last ``stages`` ring steps."""
  @pl.loop(jnp.maximum(total_steps - stages, 0), total_steps)
  def _(step):
    for barrier in free_barriers:
      barrier.wait(lax.rem(step, stages))


def acknowledge(ready, free, stages: int):
  """A consumer's ``skip`` for a ring with one ready and one free barrier
  per slot: observe the slot's phase and release it untouched."""
  def skip(step, carry):
    slot = lax.rem(step, stages)
    plgpu.barrier_wait(ready.at[slot])
    free.arrive(slot)
    return carry
  return skip


def index_tile(start, shape, axis: int, *, vectors: bool = True):
  """``start`` plus each element's index along ``axis`` of a ``shape``
  tile in the wgmma layout: the query or key index of an element mask.

  Built as one value per row or column (the tile's row or column layout)
  and broadcast over the tile where it is used, so no int32 tile of one
  value per element stays live beside the accumulators.  ptxas' report of
  the compiled kernels: the 176-key forward tiles at head_dim 128 spilled
  644 bytes causal with the tile, none with the vector; the causal d128
  dK/dV kernel 24 / 68 bytes -> none.  On the H200 the vectors ran level
  to +4% in the forward (d128, 2048-16384 keys) and level to +1.4%
  forward+backward (docs/benchmarks/, 2026-12-03).
  ``vectors=False``: the iota tile itself, for the paired backward
  kernels' held side (built once before the loop, as measured there)."""
  if not vectors:
    return start + plgpu.broadcasted_iota(jnp.int32, shape, axis,
                                          layout=plgpu.Layout.WGMMA)
  vec = start + plgpu.broadcasted_iota(
      jnp.int32, (shape[axis],), 0, layout=plgpu.Layout.WGMMA.reduce(1 - axis))
  return lax.broadcast_in_dim(vec, shape, [axis])


def computed_tiles(u_lo, u_hi, own, element_mask_everywhere: bool):
  """``own = (lo, full_lo, full_hi, hi)`` clipped to the streamed tiles
  ``[u_lo, u_hi)``: the ranges :func:`tile_loop` computes (``[lo, hi)``,
  unmasked on ``[full_lo, full_hi)``)."""
  lo, full_lo, full_hi, hi = own
  lo = jnp.clip(lo, u_lo, u_hi)
  hi = jnp.clip(hi, lo, u_hi)
  if element_mask_everywhere:
    full_lo = full_hi = hi
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def tile_loop(u_lo, u_hi, own, *, first_step, compute, skip,
              element_mask_everywhere: bool, carry=()):
  """Consumer side: one step per tile ``t`` in ``[u_lo, u_hi)`` (the tiles
  the producer streams), ``step = first_step + t - u_lo``.

  ``own = (lo, full_lo, full_hi, hi)`` are this consumer's tiles (from
  :class:`jaxflash.masks.MaskSpec`): ``compute(step, t, carry,
  masked=...)`` runs for ``[lo, hi)`` (``masked=False`` on the fully
  visible ``[full_lo, full_hi)``), ``skip(step, carry)`` for the others.
  ``element_mask_everywhere``: every computed tile takes the element mask
  (segment ids: a tile inside the position band may still cross
  documents).
  """
  lo, full_lo, full_hi, hi = computed_tiles(u_lo, u_hi, own,
                                            element_mask_everywhere)
  step_of = lambda t: first_step + t - u_lo

  def run(start, stop, fn, carry):
    return lax.fori_loop(start, stop, lambda t, c: fn(step_of(t), t, c),
                         carry)

  do_skip = lambda step, t, c: skip(step, c)
  masked = functools.partial(compute, masked=True)
  carry = run(u_lo, lo, do_skip, carry)
  carry = run(lo, full_lo, masked, carry)
  carry = run(full_lo, full_hi, functools.partial(compute, masked=False),
              carry)
  carry = run(full_hi, hi, masked, carry)
  return run(hi, u_hi, do_skip, carry)
