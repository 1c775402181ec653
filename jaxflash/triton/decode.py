"""Decode and chunked prefill over a paged KV cache, in Pallas (Triton).

FlashDecoding's split-K (Dao et al., "Flash-Decoding for long-context
inference", 2023): program ``(b, kh, s)`` runs the online softmax of
FlashAttention (arXiv 2205.14135, Algorithm 1) over split ``s`` of
sequence ``b``'s pages, for every query row of key/value head ``kh``'s
group at once (FlashInfer's GQA packing: the ``q_len x group`` rows form
one tile, so each page is read once per key/value head), and writes its
normalised partial output and log-sum-exp.  The partials are merged
exactly through their log-sum-exps (:func:`jaxflash.splitk.merge`).
Pages are read through the page table (vLLM's PagedAttention, arXiv
2309.06180): page ``page_indices[b, p]`` holds keys ``p * P .. (p + 1) *
P - 1``; entries past a sequence's length are never read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxflash import splitk
from jaxflash._util import LOG2E, out_struct
from jaxflash.masks import MaskArrays, MaskSpec
from jaxflash.triton.common import LN2, dot, head_dim_padded


@dataclasses.dataclass(frozen=True)
class PagedConfig:
  """Launch of the paged decode kernel; frozen (a static argument).

  Attributes:
    splits: programs per (sequence, key/value head) along the pages
      (FlashDecoding's split-K); None: :func:`decode_splits`.
    block_pages: pages per step of a program's loop (their loads issued
      together, one softmax rescale for all); None: :func:`block_pages`.
    num_warps, num_stages: Triton's launch parameters.
  """

  splits: int | None = None
  block_pages: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    splitk.check_counts(self, ("splits", "block_pages"),
                        ("num_warps", "num_stages"))


# Query rows per program (one head group's q_len x group rows, or tiles of
# them for long chunks): a 128 x head_dim float32 accumulator is what
# Triton's flash-attention tiles hold in four warps.
MAX_TILE_ROWS = 128
# With multi-head latent attention's 512-wide values, 32 rows keep the
# float32 accumulator at 128 registers a thread in four warps.
MLA_TILE_ROWS = 32

# block_pages: keys per loop step (pages of fewer keys are taken several
# at a time).
BLOCK_KEYS = 64


def block_pages(page: int) -> int:
  """Pages per loop step: :data:`BLOCK_KEYS` keys' worth (one page of 64
  keys or more).  One page of 16 keys per step read 0.70-0.90x of pages of
  64 on an H100 (docs/benchmarks/h100-2026-12-06-959a87f-paged-decode.md)."""
  return max(1, BLOCK_KEYS // page)


# decode_splits: programs for at least this many waves of the SMs.
SPLIT_WAVES = 2


def decode_splits(batch: int, kv_heads: int, pages_per_sequence: int,
                  sm_count: int) -> int:
  """Splits of each sequence's pages: enough that ``batch x kv_heads x
  splits`` programs fill :data:`SPLIT_WAVES` waves of ``sm_count`` SMs,
  at most one per page (batch 1 with a long cache splits widely; a large
  batch runs one program per sequence and head, with no merge to pay)."""
  want = -(-SPLIT_WAVES * sm_count // (batch * kv_heads))
  return max(1, min(pages_per_sequence, want))


def check_supported(q, k_pages, config: PagedConfig | None) -> None:
  """NotImplementedError where this kernel cannot serve the call."""
  del config
  page, d = k_pages.shape[1], k_pages.shape[3]
  if page < 16 or page & (page - 1):
    raise NotImplementedError(
        f"the Triton paged kernel takes page sizes that are powers of two"
        f" from 16 (Triton's block shapes), got page_size={page}")
  if d != head_dim_padded(d):
    raise NotImplementedError(
        f"the Triton paged kernel takes head_dims that are powers of two"
        f" from 16 (padding the cache would copy it), got head_dim={d}")
  if q.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
    raise NotImplementedError(f"dtype {q.dtype} is not served")
  if k_pages.dtype != q.dtype and q.dtype == jnp.float32:
    raise NotImplementedError("an FP8 cache is read with bfloat16 or"
                              " float16 queries")


def check_mla(q, page: int, v_head_dim: int, *,
              latent_block: int = 0) -> None:
  """NotImplementedError where the kernel cannot serve multi-head latent
  attention: it reads the latent columns ``[0, v_head_dim)`` and the
  rotary ones as two blocks, each a power of two from 16 wide, the second
  dividing the first; an FP8 latent's scale blocks (``latent_block``
  columns) powers of two from 16 too."""
  d = q.shape[3]
  rope = d - v_head_dim
  if (v_head_dim & (v_head_dim - 1) or rope & (rope - 1) or rope < 16
      or v_head_dim % rope):
    raise NotImplementedError(
        f"the Triton paged kernel takes latent attention with v_head_dim"
        f" and head_dim - v_head_dim powers of two from 16, the second"
        f" dividing the first, got head_dim={d}, v_head_dim={v_head_dim}")
  if page < 16 or page & (page - 1):
    raise NotImplementedError(
        f"the Triton paged kernel takes page sizes that are powers of two"
        f" from 16, got page_size={page}")
  if q.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
    raise NotImplementedError(f"dtype {q.dtype} is not served")
  if latent_block and (latent_block < 16
                       or latent_block & (latent_block - 1)):
    raise NotImplementedError(
        f"the Triton paged kernel takes FP8 latent blocks that are powers"
        f" of two from 16 columns, got {latent_block}")


def _kernel(q_ref, k_ref, v_ref, idx_ref, len_ref, start_ref, *refs,
            q_len: int, group: int, row_tiles: int, page: int,
            per_step: int, scale: float,
            soft_cap: float | None, causal: bool, window_left: int | None,
            window_right: int | None, fp8: bool, mla: bool,
            latent_block: int = 0):
  v_scale = qr = latent_scales = None
  if mla:
    # Multi-head latent attention (DeepSeek-V2's absorbed form): k_ref
    # holds the latent columns, which are also the values, v_ref the
    # rotary columns of the same cache; the scores add both products.
    qr, refs = refs[0][...], refs[1:]
  if latent_block:
    # FlashMLA's FP8 latent: e4m3 columns with one float32 scale per
    # token and latent_block columns.  The columns go in blocks
    # throughout, each widened to q's dtype as it is (exact: every e4m3
    # number is a bfloat16 and a float16 one), its scales applied to the
    # small [rows, keys] tiles instead of the [keys, columns] page: block
    # i's scores are (q_i . k_i) * scale_i per key, its output sums
    # (p * scale_i) @ k_i.  No dequantized page is built in registers.
    latent_scales, refs = refs[0], refs[1:]
  if fp8:
    # An FP8 cache: pages widened to q's dtype (exact: every e4m3 and
    # e5m2 number is a bfloat16 and a float16 one), this head's k_scale
    # folded into the logits' scale and v_scale applied to the output.
    scale = scale * refs[0][0]
    v_scale = refs[0][1]
    refs = refs[1:]
  o_ref, lse_ref = refs
  split = pl.program_id(2)
  first_row = lax.rem(pl.program_id(1), row_tiles) * q_ref.shape[0]
  # A traced length past the table's capacity means the whole table (as
  # in the reference); uncapped, the page plan would revisit the last
  # entry's page.
  length = jnp.minimum(len_ref[0], idx_ref.shape[0] * page)
  start = start_ref[0]  # position of query row 0
  rows = q_ref.shape[0]
  # Query row r is (t, g) = divmod(r, group), at position start + t.
  t = lax.div(first_row + jnp.arange(rows, dtype=jnp.int32),
              jnp.int32(group))
  pos = start + t
  lo, hi, _ = splitk.split_pages(
      length=length, start=start, first_row=first_row, rows=rows,
      q_len=q_len, group=group, page=page, per_step=per_step, split=split,
      splits=pl.num_programs(2), causal=causal, window_left=window_left,
      window_right=window_right)
  q = q_ref[...]
  last_entry = idx_ref.shape[0] - 1
  # The value columns in blocks (one block without an FP8 latent).
  width = o_ref.shape[-1]
  block = latent_block or width
  cols = [pl.ds(c, block) for c in range(0, width, block)]
  q_parts = [q_ref[:, c] for c in cols] if latent_block else [q]

  def page_keys(slot):
    """The page's keys in column blocks (also MLA's values) and each
    block's scales per key ([page] float32; None: no FP8 latent)."""
    if not latent_block:
      return [k_ref[slot].astype(q.dtype)], [None]
    return ([k_ref[slot, :, c].astype(q.dtype) for c in cols],
            [latent_scales[slot, :, i] for i in range(len(cols))])

  def scaled(x, col_scale):
    return x if col_scale is None else x * col_scale[None, :]

  def body(step, carry):
    acc, m_prev, l_prev = carry
    # per_step pages per step; their loads do not depend on each other.
    # A page at or past hi (another split's, or past the keys) is read
    # from a valid index and masked out entirely.
    logits, values = [], []
    for j in range(per_step):
      p = lo + step * per_step + j
      live = p < hi
      slot = jnp.where(live, idx_ref[jnp.minimum(p, last_entry)], 0)
      k, k_scales = page_keys(slot)
      s = scaled(dot(q_parts[0], k[0], trans_b=True), k_scales[0])
      for q_part, k_part, k_scale in zip(q_parts[1:], k[1:], k_scales[1:]):
        s = s + scaled(dot(q_part, k_part, trans_b=True), k_scale)
      if mla:
        s = s + dot(qr, v_ref[slot], trans_b=True)
      s = s * scale
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
      s = s * LOG2E
      key = p * page + jnp.arange(page, dtype=jnp.int32)
      keep = (key[None, :] < length) & live
      if causal:
        keep = keep & (key[None, :] <= pos[:, None])
      elif window_right is not None:
        keep = keep & (key[None, :] <= pos[:, None] + window_right)
      if window_left is not None:
        keep = keep & (key[None, :] >= pos[:, None] - window_left)
      logits.append(jnp.where(keep, s, -jnp.inf))
      values.append((k, k_scales) if mla
                    else ([v_ref[slot].astype(q.dtype)], [None]))
    m_next = m_prev
    for s in logits:
      m_next = jnp.maximum(m_next, jnp.max(s, axis=1))
    # Rows with nothing seen yet keep a finite reference, so exp2 gives 0
    # rather than exp2(-inf - -inf) = NaN.
    m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_use)
    acc = [a * alpha[:, None] for a in acc]
    l_next = l_prev * alpha
    for s, (v, v_scales) in zip(logits, values):
      prob = jnp.exp2(s - m_use[:, None])
      acc = [a + dot(scaled(prob, v_scale).astype(v_part.dtype), v_part)
             for a, v_part, v_scale in zip(acc, v, v_scales)]
      l_next = l_next + jnp.sum(prob, axis=1)
    return acc, m_next, l_next

  carry = ([jnp.zeros((rows, block), jnp.float32) for _ in cols],
           jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  steps = lax.div(jnp.maximum(hi - lo, 0) + per_step - 1, per_step)
  acc, m, l = lax.fori_loop(0, steps, body, carry)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  if v_scale is not None:
    acc = [a * v_scale for a in acc]
  if not latent_block:
    o_ref[...] = acc[0] / l_safe[:, None]
  else:
    for c, a in zip(cols, acc):
      o_ref[:, c] = a / l_safe[:, None]
  lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)


def paged_forward(q, k_pages, v_pages, page_indices, kv_lengths, *,
                  softmax_scale: float, logits_soft_cap: float | None,
                  window_left: int | None, config: PagedConfig | None,
                  interpret: bool, sm_count: int = 132, q_start=None,
                  causal: bool = True, window_right: int | None = None,
                  kv_scales=None, v_head_dim: int | None = None,
                  latent_scales=None, rope_pages=None):
  """``(out [B, T, H, D], lse [B, H, T] float32)`` of queries ``q [B, T,
  H, D]`` over the paged cache (see :mod:`jaxflash.reference`'s
  ``paged_attention`` for the semantics).

  ``q_start [B]``: the position of each sequence's query row 0 (row ``t``
  sits at ``q_start + t``); None: ``kv_lengths - T``, the new tokens at the
  end of the cache.  ``causal``, ``window_left``, ``window_right``: keys
  after a row's position, more than ``window_left`` before it or more than
  ``window_right`` after it are masked, besides those past the length.
  ``kv_scales [K, 2]`` float32: an FP8 cache's ``(k_scale, v_scale)`` per
  key/value head.

  ``v_pages`` None: multi-head latent attention, the values the first
  ``v_head_dim`` columns of ``k_pages`` (:func:`check_mla`); the output is
  ``[B, T, H, v_head_dim]``.  With ``latent_scales [N, P, n]`` float32 the
  latent is FP8: ``k_pages [N, P, 1, v_head_dim]`` holds the e4m3 latent
  columns (column block ``i`` of ``v_head_dim / n`` times
  ``latent_scales[..., i]``) and ``rope_pages [N, P, 1, D - v_head_dim]``
  the rotary ones."""
  config = config or PagedConfig()
  B, T, H, D = q.shape
  _, page, K, _ = k_pages.shape
  M = page_indices.shape[1]
  G = H // K
  mla = v_pages is None
  Dv = v_head_dim if mla else D
  # The q_len x group rows of each key/value head (row t * G + g) in tiles
  # of a power of two (Triton's block shapes) up to MAX_TILE_ROWS (MLA's
  # 512-wide accumulator: MLA_TILE_ROWS): a decode step's group is one
  # tile where it fits, so each page is read once per key/value head.
  tile = min(MLA_TILE_ROWS if mla else MAX_TILE_ROWS,
             max(16, 1 << (T * G - 1).bit_length()))
  R = -(-T * G // tile)
  per_step = config.block_pages or block_pages(page)
  # At most one split per loop step of the table's capacity; the pages of
  # each split are planned in the kernel from the sequence's length.
  splits = config.splits or decode_splits(B, K * R, M, sm_count)
  splits = min(splits, -(-M // per_step))
  qt = splitk.pack_rows(q, K, R * tile)
  idx = page_indices.astype(jnp.int32)
  lengths = kv_lengths.astype(jnp.int32).reshape(B, 1)
  if q_start is None:
    q_start = lengths - T
  starts = jnp.broadcast_to(jnp.asarray(q_start, jnp.int32).reshape(-1, 1),
                            (B, 1))
  kernel = functools.partial(
      _kernel, q_len=T, group=G, row_tiles=R, page=page,
      per_step=per_step,
      scale=float(softmax_scale), soft_cap=logits_soft_cap, causal=causal,
      window_left=window_left, window_right=window_right,
      fp8=kv_scales is not None, mla=mla,
      latent_block=(0 if latent_scales is None
                    else Dv // latent_scales.shape[-1]))
  q_specs, q_args = [], []
  if mla:
    # The latent columns [0, Dv) and the rotary ones [Dv, D) of the same
    # pages, as two blocks (each a power of two wide; Dv a multiple of
    # the rotary width).
    Dr = D - Dv
    qt, qr = qt[..., :Dv], qt[..., Dv:]
    if rope_pages is None:
      v_pages, rope_block = k_pages, Dv // Dr
    else:  # (FP8 latent: the rotary columns are their own array)
      v_pages, rope_block = rope_pages, 0
    v_spec = pl.BlockSpec((k_pages.shape[0], page, None, Dr),
                          lambda b, i, s: (0, 0, i // R, rope_block))
    q_specs = [pl.BlockSpec((None, None, tile, Dr),
                            lambda b, i, s: (b, i // R, i % R, 0))]
    q_args = [qr]
    if latent_scales is not None:
      q_specs.append(pl.BlockSpec(latent_scales.shape,
                                  lambda b, i, s: (0, 0, 0)))
      q_args.append(latent_scales)
  else:
    v_spec = pl.BlockSpec((v_pages.shape[0], page, None, D),
                          lambda b, i, s: (0, 0, i // R, 0))
  # Program (b, i, s): sequence b, key/value head i // R, row tile i % R,
  # split s.
  out_parts, lse_parts = pl.pallas_call(
      kernel,
      grid=(B, K * R, splits),
      in_specs=[
          pl.BlockSpec((None, None, tile, Dv),
                       lambda b, i, s: (b, i // R, i % R, 0)),
          pl.BlockSpec((k_pages.shape[0], page, None, Dv),
                       lambda b, i, s: (0, 0, i // R, 0)),
          v_spec,
          pl.BlockSpec((None, M), lambda b, i, s: (b, 0)),
          pl.BlockSpec((None, 1), lambda b, i, s: (b, 0)),
          pl.BlockSpec((None, 1), lambda b, i, s: (b, 0)),
      ] + q_specs + ([] if kv_scales is None else [
          pl.BlockSpec((None, 2), lambda b, i, s: (i // R, 0))]),
      out_specs=[
          pl.BlockSpec((None, None, None, tile, Dv),
                       lambda b, i, s: (b, i // R, s, i % R, 0)),
          pl.BlockSpec((None, None, None, tile),
                       lambda b, i, s: (b, i // R, s, i % R)),
      ],
      out_shape=[
          out_struct((B, K, splits, R * tile, Dv), jnp.float32, q, k_pages),
          out_struct((B, K, splits, R * tile), jnp.float32, q, k_pages),
      ],
      compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                         num_stages=config.num_stages),
      interpret=interpret,
      name="jaxflash_paged_decode",
  )(qt, k_pages, v_pages, idx, lengths, starts, *q_args,
    *([] if kv_scales is None else [kv_scales]))
  out, lse = splitk.unpack_rows(*splitk.merge(out_parts, lse_parts), T, H)
  return out.astype(q.dtype), lse




# flash_attention's decode route: a contiguous cache ``[B, S, K, D]`` is
# read as pages of the largest of these sizes dividing S (a reshape, no
# copy); on an H100 pages of 64 streamed faster than pages of 16
# (docs/benchmarks/h100-2026-12-06-959a87f-paged-decode.md).
CONTIGUOUS_PAGES = (64, 32, 16)
# Calls with at most this many queries per sequence, and at most
# MAX_DECODE_ROWS query rows per key/value head (q_len x group), take the
# decode kernel: its tile holds one head group's rows, where the prefill
# kernels pad a few rows to a whole tile and run one program per
# (sequence, head) over the whole cache.
MAX_DECODE_Q_LEN = 16
MAX_DECODE_ROWS = 128


def contiguous_page(kv_len: int) -> int | None:
  """The page size a contiguous cache of ``kv_len`` keys is read in."""
  return next((p for p in CONTIGUOUS_PAGES if kv_len % p == 0), None)


def serves_contiguous(q, k, arrays: MaskArrays) -> bool:
  """Whether :func:`contiguous_forward` serves this flash_attention call
  (every :class:`MaskSpec` is served): few query rows, no segment ids or
  query lengths, a key length that pages of 16 divide, and a call the
  paged kernel takes."""
  T, S = q.shape[1], k.shape[1]
  page = contiguous_page(S)
  if (T > MAX_DECODE_Q_LEN or T * (q.shape[2] // k.shape[2]) > MAX_DECODE_ROWS
      or page is None or arrays.q_segment_ids is not None
      or arrays.q_seq_lengths is not None
      or arrays.dropout_seeds is not None or arrays.has_dense):
    return False
  try:
    check_supported(q, jax.ShapeDtypeStruct((1, page, *k.shape[2:]),
                                            k.dtype), None)
  except NotImplementedError:
    return False
  return True


def contiguous_forward(q, k, v, arrays: MaskArrays, *, mask: MaskSpec,
                       softmax_scale: float, logits_soft_cap: float | None,
                       interpret: bool, sm_count: int = 132):
  """flash_attention's ``(out, lse)`` on a contiguous cache ``k, v [B, S,
  K, D]`` by the paged kernel: the cache viewed as ``B x S / page`` pages
  (sequence ``b``'s pages in order), query row ``i`` at key position ``i +
  mask.offset``, ``arrays.kv_seq_lengths`` (default ``S``) keys valid."""
  B, S, K, D = k.shape
  page = contiguous_page(S)
  per_seq = S // page
  table = jnp.arange(B * per_seq, dtype=jnp.int32).reshape(B, per_seq)
  lengths = arrays.kv_seq_lengths
  if lengths is None:
    lengths = jnp.full((B,), S, jnp.int32)
  return paged_forward(
      q, k.reshape(B * per_seq, page, K, D), v.reshape(B * per_seq, page, K, D),
      table, lengths, softmax_scale=softmax_scale,
      logits_soft_cap=logits_soft_cap, window_left=mask.window_left,
      window_right=mask.window_right, causal=mask.causal,
      q_start=jnp.full((B,), mask.offset, jnp.int32), config=None,
      interpret=interpret, sm_count=sm_count)
