"""Decode and chunked prefill over a paged KV cache on Hopper (Mosaic GPU).

FlashDecoding's split-K (:mod:`jaxflash.splitk`): program ``(b, i, s)``
runs FlashAttention's online softmax (arXiv 2205.14135, Algorithm 1) for
the packed query rows of key/value head ``i // R`` (row tile ``i % R``:
the head's ``q_len x group`` rows, FlashInfer's GQA packing, so each page
is read once per key/value head) over split ``s`` of sequence ``b``'s
pages, and writes its normalised partial output and log-sum-exp.

Each program is two warpgroups, as the forward kernel's
(:mod:`jaxflash.mosaic_gpu.pipeline`): a producer that looks the pages up
in the page table (vLLM's PagedAttention, arXiv 2309.06180) and copies
them with TMA into a ``stages``-deep shared-memory ring, ``block_pages``
pages a slot, and one consumer whose 64 rows (a wgmma's) take ``S = Q
K^T``, the softmax and ``O += P V`` per slot.  Table entries past the
split's pages are never read.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxflash import splitk
from jaxflash._util import LOG2E, out_struct
from jaxflash.mosaic_gpu import pipeline
from jaxflash.mosaic_gpu.forward import softmax_step

LN2 = math.log(2.0)

# Query rows per program: one consumer warpgroup's wgmma tile.
ROWS = 64
# Keys per ring slot where block_pages is None (pages of fewer keys go
# several to a slot).
SLOT_KEYS = 64
# decode_splits: programs for at least this many waves of the SMs.
SPLIT_WAVES = 2
# The output's float32 columns go out through a buffer this wide.
OUT_COLUMNS = 128
# Shared memory a program may take (an H100's and H200's 227 KiB, less
# Mosaic GPU's own: its barriers and reduction scratch).
SMEM_BYTES = 227 * 1024 - 4096
MAX_STAGES = 4


@dataclasses.dataclass(frozen=True)
class MosaicPagedConfig:
  """Launch of the Hopper paged decode kernel; frozen (a static argument).

  Attributes:
    splits: programs per (sequence, key/value head, row tile) along the
      pages (FlashDecoding's split-K); None: :func:`decode_splits`.
    block_pages: pages per ring slot (one TMA copy each, one softmax step
      for all); None: :data:`SLOT_KEYS` keys' worth.
    stages: ring slots, the TMA copies in flight ahead of the consumer;
      None: :func:`default_stages`.
  """

  splits: int | None = None
  block_pages: int | None = None
  stages: int | None = None

  def __post_init__(self):
    splitk.check_counts(self, ("splits", "block_pages", "stages"))


def smem_bytes(head_dim: int, slot_keys: int, stages: int) -> int:
  """Shared memory of a program: Q, the K and V ring, the output buffer
  (float32, :data:`OUT_COLUMNS` wide) and the LSE."""
  out = ROWS * min(head_dim, OUT_COLUMNS) * 4 + ROWS * 4
  return 2 * head_dim * (ROWS + 2 * stages * slot_keys) + out


def default_stages(head_dim: int, slot_keys: int) -> int:
  """The deepest ring up to :data:`MAX_STAGES` slots that fits
  :data:`SMEM_BYTES` (4 at head_dim 128 with 64-key slots, 2 at 256)."""
  stages = MAX_STAGES
  while stages > 1 and smem_bytes(head_dim, slot_keys,
                                  stages) > SMEM_BYTES:
    stages -= 1
  return stages


def decode_splits(batch: int, programs: int, slots_per_sequence: int,
                  sm_count: int) -> int:
  """Splits of each sequence's pages: enough that ``batch x programs x
  splits`` programs fill :data:`SPLIT_WAVES` waves of ``sm_count`` SMs, at
  most one per ring slot of the table's capacity."""
  want = -(-SPLIT_WAVES * sm_count // (batch * programs))
  return max(1, min(slots_per_sequence, want))


def check_supported(q, k_pages, config) -> None:
  """NotImplementedError where this kernel cannot serve the call."""
  if config is not None and not isinstance(config, MosaicPagedConfig):
    raise ValueError(f"config must be a MosaicPagedConfig, got {config!r}")
  page, d = k_pages.shape[1], k_pages.shape[3]
  if q.dtype not in (jnp.float16, jnp.bfloat16):
    raise NotImplementedError(
        f"the Hopper paged kernel takes bfloat16 or float16, got {q.dtype}")
  if k_pages.dtype != q.dtype:
    raise NotImplementedError(
        f"the Hopper paged kernel reads a {q.dtype} cache, got"
        f" {k_pages.dtype} pages")
  if d % 64 or d > 256:
    raise NotImplementedError(
        f"the Hopper paged kernel takes head_dim 64, 128, 192 or 256, got"
        f" {d}")
  if page % 16:
    raise NotImplementedError(
        f"the Hopper paged kernel takes page sizes that are multiples of 16"
        f" (P V's contraction), got page_size={page}")
  per = (config.block_pages if config is not None and config.block_pages
         else block_pages(page))
  if per * page > 256:
    raise NotImplementedError(
        f"block_pages={per} of {page} keys: a ring slot holds at most 256"
        " keys (a wgmma's width)")
  stages = config.stages if config is not None else None
  if smem_bytes(d, per * page, stages or 1) > SMEM_BYTES:
    raise NotImplementedError(
        f"the Hopper paged kernel's shared memory: head_dim {d}, slots of"
        f" {per * page} keys, {stages or 1} stages take"
        f" {smem_bytes(d, per * page, stages or 1)} bytes, over"
        f" {SMEM_BYTES}")
  q_rows = q.shape[1] * (q.shape[2] // k_pages.shape[2])
  if q_rows > 4 * ROWS:
    raise NotImplementedError(
        f"the Hopper paged kernel takes at most {4 * ROWS} query rows per"
        f" key/value head (q_len x group), got {q_rows}")


def block_pages(page: int) -> int:
  """Pages per ring slot: :data:`SLOT_KEYS` keys' worth (one page of 64
  keys or more)."""
  return max(1, SLOT_KEYS // page)


def _kernel(q_ref, k_ref, v_ref, idx_ref, len_ref, start_ref, o_ref,
            lse_ref, q_smem, k_ring, v_ring, o_smem, lse_smem, q_ready,
            k_ready, v_ready, free, *p_smem, q_len: int, group: int,
            row_tiles: int, splits: int, page: int, per_step: int,
            stages: int,
            scale: float, soft_cap: float | None, causal: bool,
            window_left: int | None, window_right: int | None,
            in_place: bool):
  b = lax.axis_index("batch")
  i = lax.axis_index("rows")
  split = lax.axis_index("split")
  kh = lax.div(i, row_tiles)
  first_row = lax.rem(i, row_tiles) * ROWS
  table_len = idx_ref.shape[1]
  slot_keys = per_step * page
  # A length past the table's capacity means the whole table (as in the
  # reference).
  length = jnp.minimum(len_ref[b], table_len * page)
  start = start_ref[b]  # position of query row 0
  lo, hi, end = splitk.split_pages(
      length=length, start=start, first_row=first_row, rows=ROWS,
      q_len=q_len, group=group, page=page, per_step=per_step, split=split,
      splits=splits, causal=causal, window_left=window_left,
      window_right=window_right)
  n_steps = lax.div(jnp.maximum(hi - lo, 0) + per_step - 1, per_step)
  wg = lax.axis_index("wg")

  @pl.when(wg == 1)
  def _producer():
    plgpu.copy_gmem_to_smem(q_ref.at[b, kh, pl.ds(first_row, ROWS)], q_smem,
                            q_ready)

    def load(step, slot):
      for j in range(per_step):
        p = lo + step * per_step + j
        # A page past hi (another split's, or past the keys) is read from
        # page 0 and masked out: its table entry may hold anything.
        src = jnp.where(p < hi, idx_ref[b, jnp.minimum(p, table_len - 1)],
                        0)
        dst = pl.ds(j * page, page)
        plgpu.copy_gmem_to_smem(k_ref.at[src, :, kh], k_ring.at[slot, dst],
                                k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src, :, kh], v_ring.at[slot, dst],
                                v_ready.at[slot])

    pipeline.produce(n_steps, stages, load, [pipeline.MBarriers(free)])

  @pl.when(wg == 0)
  def _consumer():
    plgpu.barrier_wait(q_ready)
    row = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row)
    l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row)
    acc = plgpu.layout_cast(
        jnp.full((ROWS, q_smem.shape[-1]), 0.0, jnp.float32),
        plgpu.Layout.WGMMA)
    shape = (ROWS, slot_keys)
    # Query row r is (t, g) = divmod(first_row + r, group), at position
    # start + t.
    pos = start + lax.div(pipeline.index_tile(first_row, shape, 0),
                          jnp.int32(group))
    limit = jnp.minimum(end, hi * page)

    def body(step, carry):
      acc, m, l = carry
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(k_ready.at[slot])

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_ring.at[slot].T)
        return acc_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
      key = pipeline.index_tile((lo + step * per_step) * page, shape, 1)
      visible = key < limit
      if causal:
        visible = visible & (key <= pos)
      elif window_right is not None:
        visible = visible & (key <= pos + window_right)
      if window_left is not None:
        visible = visible & (key >= pos - window_left)
      qk_scale = scale * LOG2E
      if soft_cap is not None:  # cap * tanh(logits / cap) (Gemma 2)
        s = jnp.tanh(s * (scale / soft_cap)) * (soft_cap * LOG2E)
        qk_scale = None
      s = jnp.where(visible, s, -jnp.inf)
      p, m, alpha = softmax_step(s, m, scale=qk_scale, threshold=0,
                                 masked=True)
      l = l * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p16 = p.astype(q_smem.dtype)
      if p_smem:  # the interpreter takes wgmma's A operand from SMEM
        p_smem[0][...] = p16
        plgpu.commit_smem()
        p16 = p_smem[0]
      plgpu.barrier_wait(v_ready.at[slot])

      def issue(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_ring.at[slot])

      if in_place:  # O += P V in the wgmma registers (FlashAttention-3)
        acc = pl.run_state(issue)(plgpu.ACC.init(acc))
      else:  # the interpretable form: a fresh accumulator, added

        def pv(acc_ref):
          issue(acc_ref)
          return acc_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
      plgpu.barrier_arrive(free.at[slot])
      return acc, m, l

    acc, m, l = lax.fori_loop(0, n_steps, body, (acc, m, l))
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    rows = pl.ds(first_row, ROWS)
    width = o_smem.shape[-1]
    for c in range(acc.shape[-1] // width):
      if c:  # the buffer is rewritten once the last copy has read it
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_smem[...] = out[:, c * width:(c + 1) * width]
      if not c:
        lse_smem[...] = jnp.where(empty, -jnp.inf,
                                  (m + jnp.log2(l_safe)) * LN2)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          o_smem, o_ref.at[b, kh, split, rows, pl.ds(c * width, width)])
      if not c:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, kh, split, rows])
    plgpu.wait_smem_to_gmem(0)


def paged_forward(q, k_pages, v_pages, page_indices, kv_lengths, *,
                  softmax_scale: float, logits_soft_cap: float | None,
                  window_left: int | None,
                  config: MosaicPagedConfig | None, interpret,
                  sm_count: int = 132, q_start=None, causal: bool = True,
                  window_right: int | None = None):
  """``(out [B, T, H, D], lse [B, H, T] float32)`` of queries ``q [B, T,
  H, D]`` over the paged cache, as
  :func:`jaxflash.triton.decode.paged_forward` (the same arguments and
  semantics; no FP8 cache or latent attention here).  ``interpret``:
  None, or the Mosaic GPU interpreter's parameters."""
  config = config or MosaicPagedConfig()
  B, T, H, D = q.shape
  _, page, K, _ = k_pages.shape
  M = page_indices.shape[1]
  G = H // K
  R = -(-T * G // ROWS)
  per_step = config.block_pages or block_pages(page)
  slots = -(-M // per_step)
  splits = min(config.splits or decode_splits(B, K * R, slots, sm_count),
               slots)
  qt = splitk.pack_rows(q, K, R * ROWS)
  lengths = kv_lengths.astype(jnp.int32)
  if q_start is None:
    q_start = lengths - T
  starts = jnp.broadcast_to(jnp.asarray(q_start, jnp.int32).reshape(-1),
                            (B,))
  dtype = q.dtype
  slot_keys = per_step * page
  stages = config.stages or default_stages(D, slot_keys)
  width = min(D, OUT_COLUMNS)
  # Q K^T contracts over the head_dim (128-byte swizzle at multiples of
  # 64); P V over a slot's keys, with V tiled along the head_dim: a
  # swizzle that divides both.
  tiled = pipeline.tiled_over(D)
  pv_tiled = pipeline.tiled_over(math.gcd(slot_keys, D))
  out_tiled = pipeline.tiled_over(width, 4)
  scratch = [
      plgpu.SMEM((ROWS, D), dtype, **tiled),
      plgpu.SMEM((stages, slot_keys, D), dtype, **tiled),
      plgpu.SMEM((stages, slot_keys, D), dtype, **pv_tiled),
      plgpu.SMEM((ROWS, width), jnp.float32, **out_tiled),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(),                                       # q_ready
      plgpu.Barrier(num_arrivals=per_step, num_barriers=stages),  # K in
      plgpu.Barrier(num_arrivals=per_step, num_barriers=stages),  # V in
      plgpu.Barrier(num_barriers=stages),                    # slot free
  ]
  if interpret is not None:  # P's buffer (wgmma's A from SMEM)
    scratch.append(plgpu.SMEM((ROWS, slot_keys), dtype, **pv_tiled))
  kernel = functools.partial(
      _kernel, q_len=T, group=G, row_tiles=R, splits=splits, page=page,
      per_step=per_step, stages=stages, scale=float(softmax_scale),
      soft_cap=logits_soft_cap, causal=causal, window_left=window_left,
      window_right=window_right, in_place=interpret is None)
  out_type = [
      out_struct((B, K, splits, R * ROWS, D), jnp.float32, q, k_pages),
      out_struct((B, K, splits, R * ROWS), jnp.float32, q, k_pages),
  ]
  # Mosaic GPU launches the last grid axis fastest: a sequence's splits
  # and heads run side by side.
  out_parts, lse_parts = pipeline.launch(
      kernel, out_type=out_type, scratch=scratch, grid=(B, K * R, splits),
      grid_names=("batch", "rows", "split"), consumers=1,
      interpret=interpret,
  )(qt, k_pages, v_pages, page_indices.astype(jnp.int32), lengths, starts)
  out, lse = splitk.unpack_rows(*splitk.merge(out_parts, lse_parts), T, H)
  return out.astype(q.dtype), lse
