"""Attention over a paged KV cache: decode, speculative decoding and
chunked prefill (:func:`paged_attention`), and the cache update beside it
(:func:`append`).

The cache is vLLM's layout: ``k_pages, v_pages [num_pages, page_size,
kv_heads, head_dim]`` and a page table ``page_indices [batch,
pages_per_sequence]`` (logical page ``p`` of sequence ``b`` is physical
page ``page_indices[b, p]``; pages may be shared between sequences), with
``kv_lengths [batch]`` valid keys per sequence.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import checks, fp8, reference
from jaxflash._util import require_cuda, sm_count
from jaxflash.mosaic_gpu import decode as hopper_decode
from jaxflash.triton import decode

IMPLEMENTATIONS = ("mosaic_gpu", "triton", "xla")
# The kernels implementation=None tries, in order, before XLA.
DEFAULT_KERNELS = ("triton", "mosaic_gpu")


def _concrete(x):
  """``x`` as a NumPy array where it is concrete (not traced), else None."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return None


def _check_cache(k_pages, v_pages, page_indices, kv_lengths):
  """The cache's arguments checked: ``(page_indices, kv_lengths)`` as
  int32 (checks.int_array)."""
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be [num_pages, page_size, kv_heads,"
                       f" head_dim], got shape {getattr(x, 'shape', x)}")
  if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
    raise ValueError(
        f"k_pages {k_pages.shape} {k_pages.dtype} and v_pages"
        f" {v_pages.shape} {v_pages.dtype} must match")
  return _check_table(page_indices, kv_lengths, k_pages.shape[1])


def _check_table(page_indices, kv_lengths, page: int):
  """The page table and lengths checked: ``(page_indices, kv_lengths)`` as
  int32 (checks.int_array)."""
  if page % 8 or not 8 <= page <= 256:
    raise ValueError(f"page_size={page} must be a multiple of 8 up to 256")
  if getattr(page_indices, "ndim", None) != 2:
    raise ValueError(
        "page_indices must be an integer [batch, pages_per_sequence] array,"
        f" got shape {getattr(page_indices, 'shape', page_indices)}")
  B, M = page_indices.shape
  # Entries past a sequence's length may hold anything (never read).
  table = checks.int_array("page_indices", page_indices, (B, M))
  lengths = checks.int_array("kv_lengths", kv_lengths, (B,),
                             valid=(0, M * page))
  return table, lengths


def _kernel_serves(implementation, config, interpret: bool, check,
                   fp8_cache: bool = False) -> bool:
  """Whether the Triton kernel runs the call (else XLA's reference):
  ``implementation`` None takes it where ``check()`` (NotImplementedError
  for what it cannot serve) passes and a CUDA GPU (compute capability 8.9
  for an FP8 cache) or the interpreter runs it; ``"triton"`` takes it or
  raises; ``"xla"`` never does."""
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(f"implementation={implementation!r} is not one of"
                     f" {(None, *IMPLEMENTATIONS)}")
  if config is not None and not isinstance(config, decode.PagedConfig):
    raise ValueError(f"config must be a PagedConfig, got {config!r}")
  if implementation == "xla":
    return False
  if implementation == "mosaic_gpu":
    raise NotImplementedError("the Hopper paged kernel does not serve"
                              " latent attention or an FP8 cache")
  try:
    check()
    if not interpret:
      require_cuda("the Triton paged kernel",
                   "a CUDA GPU (of compute capability 8.9 or more for an FP8"
                   " cache)",
                   lambda cc: float(cc) >= (8.9 if fp8_cache else 8.0),
                   "pass interpret=True to run it in the Pallas"
                   " interpreter")
  except NotImplementedError:
    if implementation == "triton":
      raise
    return False
  return True


def _paged_kernel(implementation, config, interpret: bool, q, k_pages,
                  fp8_cache: bool) -> str:
  """The implementation that runs a :func:`paged_attention` call:
  ``"mosaic_gpu"`` (the Hopper kernel: an sm90 GPU or the Mosaic GPU
  interpreter), ``"triton"`` (:func:`_kernel_serves`) or ``"xla"``.  A
  named kernel runs or raises; None takes the first of
  :data:`DEFAULT_KERNELS` that serves the call (a config names its
  kernel), else XLA."""
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(f"implementation={implementation!r} is not one of"
                     f" {(None, *IMPLEMENTATIONS)}")
  configs = {"mosaic_gpu": hopper_decode.MosaicPagedConfig,
             "triton": decode.PagedConfig}
  if config is not None and not isinstance(config, tuple(configs.values())):
    raise ValueError(f"config must be a PagedConfig or a MosaicPagedConfig,"
                     f" got {config!r}")
  if implementation == "xla":
    return "xla"
  names = DEFAULT_KERNELS if implementation is None else (implementation,)
  if config is not None:
    names = [n for n in names if isinstance(config, configs[n])]
    if not names:
      raise ValueError(f"implementation={implementation!r} does not take"
                       f" {config!r}")
  for name in names:
    if name == "triton":
      if _kernel_serves(name if implementation else None, config, interpret,
                        lambda: decode.check_supported(q, k_pages, config),
                        fp8_cache):
        return name
      continue
    try:
      hopper_decode.check_supported(q, k_pages, config)
      if not interpret:
        require_cuda("the Hopper paged kernel",
                     "an sm90 GPU (compute capability 9.x, Hopper)",
                     lambda cc: cc.startswith("9"),
                     "pass interpret=True to run it in the Mosaic GPU"
                     " interpreter")
      return name
    except NotImplementedError:
      if implementation is not None:
        raise
  return "xla"


def _interpret_params(interpret: bool):
  """The Mosaic GPU interpreter's parameters for ``interpret``, or None."""
  if not interpret:
    return None
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams()


def _window_left(local_window_size) -> int | None:
  """The window's left side (the right one is 0: the queries are
  causal)."""
  left, _ = checks.window_sizes(local_window_size)
  return left


def paged_attention(q, k_pages, v_pages, page_indices, kv_lengths, *,
                    softmax_scale: float | None = None,
                    logits_soft_cap: float | None = None,
                    local_window_size=None, return_lse: bool = False,
                    implementation: str | None = None,
                    config: decode.PagedConfig | None = None,
                    interpret: bool = False, k_scale=None, v_scale=None):
  """Attention of new queries over a paged KV cache.

  Args:
    q: ``[batch, q_len, heads, head_dim]``; ``q_len`` 1 for decode, more
      for speculative decoding or chunked prefill.  Query row ``i`` of
      sequence ``b`` sits at position ``kv_lengths[b] - q_len + i`` (the
      new tokens are already in the cache) and attends causally.
    k_pages, v_pages: ``[num_pages, page_size, kv_heads, head_dim]``;
      ``page_size`` a multiple of 8 up to 256; ``heads`` a multiple of
      ``kv_heads`` (GQA, MQA).
    page_indices: ``[batch, pages_per_sequence]`` integers; entries past a
      sequence's length are never read (they may hold anything).
    kv_lengths: ``[batch]`` integers in ``[0, pages_per_sequence *
      page_size]``; a sequence of length 0 gets zeros (and ``lse =
      -inf``).
    softmax_scale: logits multiplier, default ``1 / sqrt(head_dim)``.
    logits_soft_cap: ``cap * tanh(logits / cap)`` before the softmax.
    local_window_size: ``w`` or ``(w, right)``: a query sees the keys at
      most ``w`` positions back (``right`` is moot: the queries are
      causal).
    return_lse: also return the natural-log log-sum-exp ``[batch, heads,
      q_len]`` (float32).
    implementation: ``"triton"`` (the split-K kernel: a CUDA GPU, or the
      interpreter with ``interpret=True``), ``"mosaic_gpu"`` (the Hopper
      split-K kernel: TMA page copies, wgmma; bf16/fp16 caches, head_dim
      a multiple of 64, pages a multiple of 16), ``"xla"`` (pages
      gathered, then dense attention), or None: the first kernel of
      :data:`DEFAULT_KERNELS` that runs and serves the call, else XLA.
    config: :class:`jaxflash.triton.decode.PagedConfig` or
      :class:`jaxflash.mosaic_gpu.decode.MosaicPagedConfig` (the kernel's
      split count and launch; it names the kernel).
    interpret: run the kernel in the Pallas interpreter (CPU).
    k_scale, v_scale: an FP8 cache's dequantization scales (pages in
      ``float8_e4m3fn`` or ``float8_e5m2``, queries in bfloat16 or
      float16): float32 scalars or ``[kv_heads]``; None is 1.  The kernel
      reads the pages at one byte per element (half a bf16 cache's
      traffic) and widens them on chip.

  Returns:
    ``out [batch, q_len, heads, head_dim]`` in ``q``'s dtype, and with
    ``return_lse`` the log-sum-exp.
  """
  if getattr(q, "ndim", None) != 4:
    raise ValueError("q must be [batch, q_len, heads, head_dim], got shape"
                     f" {getattr(q, 'shape', q)}")
  page_indices, kv_lengths = _check_cache(k_pages, v_pages, page_indices,
                                          kv_lengths)
  B, T, H, D = q.shape
  _, _, K, Dk = k_pages.shape
  if page_indices.shape[0] != B:
    raise ValueError(f"page_indices has {page_indices.shape[0]} rows for"
                     f" batch {B}")
  fp8_cache = checks.is_fp8(k_pages)
  if Dk != D or (q.dtype != k_pages.dtype and not (
      fp8_cache and q.dtype in (jnp.bfloat16, jnp.float16))):
    raise ValueError(f"q {q.shape} {q.dtype} and k_pages {k_pages.shape}"
                     f" {k_pages.dtype} must share head_dim and dtype (or"
                     " the pages be FP8 and q bfloat16 or float16)")
  kv_scales = None
  if fp8_cache:
    kv_scales = jnp.stack([fp8.dequant_scale("k_scale", k_scale, K),
                           fp8.dequant_scale("v_scale", v_scale, K)], axis=1)
  elif k_scale is not None or v_scale is not None:
    raise ValueError(f"k_scale and v_scale apply to FP8 pages only; got"
                     f" k_pages in {k_pages.dtype}")
  if H % K:
    raise ValueError(f"heads={H} must be a multiple of kv_heads={K}")
  if T < 1:
    raise ValueError(f"q_len={T} must be at least 1")
  scale = checks.static_positive(
      "softmax_scale", 1.0 / math.sqrt(D) if softmax_scale is None
      else softmax_scale)
  cap = (None if logits_soft_cap is None
         else checks.static_positive("logits_soft_cap", logits_soft_cap))
  left = _window_left(local_window_size)
  kernel = _paged_kernel(implementation, config, interpret, q, k_pages,
                         fp8_cache)
  if kernel == "mosaic_gpu":
    out, lse = hopper_decode.paged_forward(
        q, k_pages, v_pages, page_indices, kv_lengths, softmax_scale=scale,
        logits_soft_cap=cap, window_left=left, config=config,
        interpret=_interpret_params(interpret), sm_count=sm_count())
  elif kernel == "triton":
    out, lse = decode.paged_forward(
        q, k_pages, v_pages, page_indices, kv_lengths, softmax_scale=scale,
        logits_soft_cap=cap, window_left=left, config=config,
        interpret=interpret, sm_count=sm_count(), kv_scales=kv_scales)
  else:
    out, lse = reference.paged_attention(
        q, k_pages, v_pages, page_indices, kv_lengths, softmax_scale=scale,
        logits_soft_cap=cap, window_left=left,
        **({} if kv_scales is None else dict(k_scale=kv_scales[:, 0],
                                             v_scale=kv_scales[:, 1])))
  return (out, lse) if return_lse else out


class FP8Latent(NamedTuple):
  """A latent cache in FlashMLA's FP8 format (656 bytes a token at
  DeepSeek's widths): the latent columns in e4m3 with one float32 scale
  per token and block of columns, the rotary columns unquantized.  A
  pytree: index, update and shard it field by field.

  Attributes:
    latent: ``[num_pages, page_size, v_head_dim]`` ``float8_e4m3fn``.
    scales: ``[num_pages, page_size, v_head_dim // block]`` float32:
      column block ``i`` (``block`` columns) of a token is ``latent *
      scales[..., i]``.
    rope: ``[num_pages, page_size, head_dim - v_head_dim]`` in the
      queries' dtype.
  """

  latent: jax.Array
  scales: jax.Array
  rope: jax.Array

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The cache as ``[..., head_dim]`` of ``dtype`` (latent, then
    rotary columns)."""
    n = self.scales.shape[-1]
    lat = self.latent.astype(jnp.float32).reshape(
        *self.latent.shape[:-1], n, -1) * self.scales[..., None]
    return jnp.concatenate(
        [lat.reshape(self.latent.shape), self.rope.astype(jnp.float32)],
        axis=-1).astype(dtype)


def quantize_latent(x, *, v_head_dim: int = 512,
                    block: int = 128) -> FP8Latent:
  """``x [..., head_dim]`` (latent vectors, e.g. a cache's pages or new
  tokens) in :class:`FP8Latent`'s format: each token's first
  ``v_head_dim`` columns in blocks of ``block``, each block scaled so that
  its largest magnitude is e4m3's largest (scale 1 for an all-zero
  block), the rest kept in ``x``'s dtype (FlashMLA: 512 columns in blocks
  of 128, 64 rotary columns in bf16)."""
  if getattr(x, "ndim", 0) < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating array [..., head_dim], got"
                     f" {getattr(x, 'dtype', type(x))}"
                     f" {getattr(x, 'shape', '')}")
  D = x.shape[-1]
  if not isinstance(v_head_dim, int) or not 0 < v_head_dim < D:
    raise ValueError(f"v_head_dim={v_head_dim!r} must be an int in (0,"
                     f" head_dim={D})")
  if not isinstance(block, int) or block < 1 or v_head_dim % block:
    raise ValueError(f"block={block!r} must be a positive int dividing"
                     f" v_head_dim={v_head_dim}")
  lat, scales = fp8.amax_quantize(x[..., :v_head_dim].reshape(
      *x.shape[:-1], v_head_dim // block, block), (x.ndim,))
  return FP8Latent(lat.reshape(*x.shape[:-1], v_head_dim), scales,
                   x[..., v_head_dim:])


def _check_fp8_latent(cache: FP8Latent, q, v_head_dim: int) -> int:
  """The FP8 latent cache checked against ``q``: its head_dim."""
  lat, sc, rope = cache
  for name, x in (("latent", lat), ("scales", sc), ("rope", rope)):
    if getattr(x, "ndim", None) != 3:
      raise ValueError(f"FP8Latent.{name} must be [num_pages, page_size,"
                       f" .], got shape {getattr(x, 'shape', x)}")
  if lat.dtype != jnp.float8_e4m3fn or sc.dtype != jnp.float32:
    raise ValueError(f"FP8Latent takes float8_e4m3fn latent columns and"
                     f" float32 scales, got {lat.dtype} and {sc.dtype}")
  if (sc.shape[:2] != lat.shape[:2] or rope.shape[:2] != lat.shape[:2]
      or sc.shape[2] < 1 or lat.shape[2] % sc.shape[2]):
    raise ValueError(
        f"FP8Latent fields {lat.shape}, {sc.shape}, {rope.shape} must share"
        " [num_pages, page_size] and the scales' blocks divide the latent"
        " columns")
  if lat.shape[2] != v_head_dim:
    raise ValueError(f"v_head_dim={v_head_dim} must be the FP8 latent's"
                     f" width {lat.shape[2]}")
  if q.dtype not in (jnp.bfloat16, jnp.float16) or rope.dtype != q.dtype:
    raise ValueError(f"an FP8 latent cache is read with bfloat16 or"
                     f" float16 queries in the rotary columns' dtype, got q"
                     f" {q.dtype} and rope {rope.dtype}")
  return lat.shape[2] + rope.shape[2]


def mla_attention(q, kv_pages, page_indices, kv_lengths, *,
                  v_head_dim: int = 512, softmax_scale: float | None = None,
                  return_lse: bool = False,
                  implementation: str | None = None,
                  config: decode.PagedConfig | None = None,
                  interpret: bool = False):
  """Multi-head latent attention (DeepSeek-V2's absorbed form, as FlashMLA
  serves it) of new queries over a paged latent cache.

  Every query head attends to one cached vector per token; the values are
  its first ``v_head_dim`` columns: ``out = softmax(q k^T scale) k[...,
  :v_head_dim]``, causal bottom-right as in :func:`paged_attention`.

  Args:
    q: ``[batch, q_len, heads, head_dim]`` (DeepSeek: head_dim 576, the
      512 latent and 64 rotary columns).
    kv_pages: ``[num_pages, page_size, head_dim]``, one latent vector per
      token, or an :class:`FP8Latent` (FlashMLA's FP8 format, from
      :func:`quantize_latent`), dequantized in the kernel.
    page_indices, kv_lengths: as :func:`paged_attention`'s.
    v_head_dim: the value width (DeepSeek: 512).
    softmax_scale: default ``1 / sqrt(head_dim)``; DeepSeek-V2/V3 use ``1 /
      sqrt(192)`` (their query/key width before absorption).
    implementation: ``"triton"`` (the split-K paged kernel reading the
      latent and rotary columns as two blocks and the latent block once
      for both products: ``v_head_dim`` and ``head_dim - v_head_dim``
      powers of two, the second dividing the first, page sizes powers of
      two from 16), ``"xla"``, or None: the kernel where it serves the
      call, else XLA.
    config, interpret, return_lse: as :func:`paged_attention`'s.

  Returns:
    ``out [batch, q_len, heads, v_head_dim]`` in ``q``'s dtype, and with
    ``return_lse`` the log-sum-exp ``[batch, heads, q_len]``.
  """
  if getattr(q, "ndim", None) != 4:
    raise ValueError("q must be [batch, q_len, heads, head_dim], got shape"
                     f" {getattr(q, 'shape', q)}")
  B, T, H, D = q.shape
  fp8_latent = isinstance(kv_pages, FP8Latent)
  if fp8_latent:
    if _check_fp8_latent(kv_pages, q, v_head_dim) != D:
      raise ValueError(f"q's head_dim {D} must be the FP8 latent's"
                       f" {kv_pages.latent.shape[2]} + rotary"
                       f" {kv_pages.rope.shape[2]} columns")
    page = kv_pages.latent.shape[1]
  else:
    if getattr(kv_pages, "ndim", None) != 3:
      raise ValueError("kv_pages must be [num_pages, page_size, head_dim]"
                       " or an FP8Latent, got shape"
                       f" {getattr(kv_pages, 'shape', kv_pages)}")
    if kv_pages.shape[2] != D or kv_pages.dtype != q.dtype:
      raise ValueError(f"q {q.shape} {q.dtype} and kv_pages"
                       f" {kv_pages.shape} {kv_pages.dtype} must share"
                       " head_dim and dtype")
    page = kv_pages.shape[1]
  if not isinstance(v_head_dim, int) or not 0 < v_head_dim < D:
    raise ValueError(f"v_head_dim={v_head_dim!r} must be an int in (0,"
                     f" head_dim={D})")
  page_indices, kv_lengths = _check_table(page_indices, kv_lengths, page)
  if page_indices.shape[0] != B:
    raise ValueError(f"page_indices has {page_indices.shape[0]} rows for"
                     f" batch {B}")
  if T < 1:
    raise ValueError(f"q_len={T} must be at least 1")
  scale = checks.static_positive(
      "softmax_scale", 1.0 / math.sqrt(D) if softmax_scale is None
      else softmax_scale)
  if fp8_latent:  # one key/value head
    pages = kv_pages.latent[:, :, None, :]
    extra = dict(latent_scales=kv_pages.scales,
                 rope_pages=kv_pages.rope[:, :, None, :])
    block = v_head_dim // kv_pages.scales.shape[2]
  else:
    pages, extra, block = kv_pages[:, :, None, :], {}, 0
  check = lambda: decode.check_mla(q, page, v_head_dim, latent_block=block)
  if _kernel_serves(implementation, config, interpret, check, fp8_latent):
    out, lse = decode.paged_forward(
        q, pages, None, page_indices, kv_lengths, softmax_scale=scale,
        logits_soft_cap=None, window_left=None, config=config,
        interpret=interpret, sm_count=sm_count(), v_head_dim=v_head_dim,
        **extra)
  else:
    if fp8_latent:
      pages = kv_pages.dequantize()[:, :, None, :]
    out, lse = reference.paged_attention(
        q, pages, pages[..., :v_head_dim], page_indices, kv_lengths,
        softmax_scale=scale)
    out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


def append(k_pages, v_pages, page_indices, kv_lengths, k_new, v_new):
  """Writes new tokens into their pages: ``(k_pages, v_pages,
  kv_lengths + n)``.

  ``k_new, v_new [batch, n, kv_heads, head_dim]``: token ``t`` of
  sequence ``b`` lands at position ``kv_lengths[b] + t``, row ``(pos %
  page_size)`` of page ``page_indices[b, pos // page_size]``.
  Functional; under ``jit`` with the pages donated the update is in
  place.  Lengths that would pass the page table's capacity raise
  ValueError where they are concrete; under ``jit`` such tokens are
  dropped.
  """
  table, lengths32 = _check_cache(k_pages, v_pages, page_indices,
                                  kv_lengths)
  _, page, K, D = k_pages.shape
  B = page_indices.shape[0]
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if getattr(x, "ndim", None) != 4 or x.shape[0] != B or x.shape[2:] != (
        K, D):
      raise ValueError(f"{name} must be [batch={B}, n, kv_heads={K},"
                       f" head_dim={D}], got {getattr(x, 'shape', x)}")
  if k_new.shape != v_new.shape:
    raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} must"
                     " match")
  n = k_new.shape[1]
  slots = _slots(table, lengths32, kv_lengths, n, page, k_pages.shape[0])
  return (_put(k_pages, slots, k_new), _put(v_pages, slots, v_new),
          kv_lengths + jnp.asarray(n, kv_lengths.dtype))


def _put(pages, slots, new):
  """``new [batch, n, ...]`` written at :func:`_slots`' ``(page, row)``
  slots of ``pages`` (tokens without a page dropped)."""
  phys, rows = slots
  return pages.at[phys, rows].set(
      new.reshape(phys.shape[0], *pages.shape[2:]).astype(pages.dtype),
      mode="drop")


def _slots(table, lengths32, kv_lengths, n: int, page: int,
           num_pages: int):
  """Where ``n`` new tokens per sequence go: ``(page, row)`` index
  vectors ``[batch * n]``; a token without a page gets the index past
  the pages (dropped by ``mode="drop"``), a ValueError where the table
  and lengths are concrete."""
  M = table.shape[1]
  lengths = _concrete(kv_lengths)
  if lengths is not None and lengths.size and lengths.max() + n > M * page:
    raise ValueError(
        f"appending {n} tokens to kv_lengths {lengths.tolist()} passes the"
        f" page table's capacity {M * page}")
  pos = lengths32[:, None] + jnp.arange(n, dtype=jnp.int32)
  logical = pos // page
  inside = logical < M
  phys = jnp.take_along_axis(table, jnp.minimum(logical, M - 1), axis=1)
  valid = inside & (phys >= 0) & (phys < num_pages)
  concrete = _concrete(phys)
  if concrete is not None and lengths is not None and not np.all(
      np.asarray(valid)):
    b, t = np.argwhere(~np.asarray(valid))[0]
    raise ValueError(
        f"no page for token {t} of sequence {b} (position"
        f" {int(lengths[b]) + t}): page_indices[{b},"
        f" {(int(lengths[b]) + t) // page}] = {int(concrete[b, t])} is not"
        f" one of the {num_pages} pages")
  # Tokens without a page go to an index past the pages: dropped (a
  # negative index would wrap to the last page).
  phys = jnp.where(valid, phys, num_pages)
  return phys.reshape(-1), (pos % page).reshape(-1)


def append_latent(kv_pages, page_indices, kv_lengths, new):
  """Writes new latent vectors into a latent cache (:func:`mla_attention`'s
  ``kv_pages``): ``(kv_pages, kv_lengths + n)``.

  ``new [batch, n, head_dim]``: token ``t`` of sequence ``b`` lands at
  position ``kv_lengths[b] + t``, as :func:`append` places them.  An
  :class:`FP8Latent` cache takes them quantized in its own blocks
  (:func:`quantize_latent`).  Functional; in place under ``jit`` with the
  cache donated.
  """
  fp8_latent = isinstance(kv_pages, FP8Latent)
  pages = kv_pages.latent if fp8_latent else kv_pages
  if getattr(pages, "ndim", None) != 3:
    raise ValueError("kv_pages must be [num_pages, page_size, head_dim] or"
                     " an FP8Latent, got shape"
                     f" {getattr(pages, 'shape', pages)}")
  num_pages, page = pages.shape[:2]
  D = (pages.shape[2] + kv_pages.rope.shape[2] if fp8_latent
       else pages.shape[2])
  table, lengths32 = _check_table(page_indices, kv_lengths, page)
  B = table.shape[0]
  if getattr(new, "ndim", None) != 3 or new.shape[0] != B or (
      new.shape[2] != D):
    raise ValueError(f"new must be [batch={B}, n, head_dim={D}], got"
                     f" {getattr(new, 'shape', new)}")
  n = new.shape[1]
  slots = _slots(table, lengths32, kv_lengths, n, page, num_pages)
  lengths = kv_lengths + jnp.asarray(n, kv_lengths.dtype)
  if not fp8_latent:
    return _put(kv_pages, slots, new), lengths
  width = pages.shape[2]
  quantized = quantize_latent(
      new, v_head_dim=width, block=width // kv_pages.scales.shape[2])
  return FP8Latent(*(_put(f, slots, x)
                     for f, x in zip(kv_pages, quantized))), lengths


class PageAllocator:
  """A host-side free list of a cache's physical pages (for examples and
  tests; a serving engine keeps its own)."""

  def __init__(self, num_pages: int):
    if not isinstance(num_pages, int) or num_pages < 1:
      raise ValueError(f"num_pages={num_pages!r} must be a positive int")
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))

  @property
  def free(self) -> int:
    """Pages not handed out."""
    return len(self._free)

  def allocate(self, n: int) -> list[int]:
    """``n`` free pages (ValueError where fewer are free)."""
    if n > len(self._free):
      raise ValueError(f"{n} pages asked, {len(self._free)} of"
                       f" {self.num_pages} free")
    return [self._free.pop() for _ in range(n)]

  def release(self, pages) -> None:
    """Gives pages back (ValueError for one not handed out)."""
    pages = [int(p) for p in pages]
    bad = [p for p in pages if not 0 <= p < self.num_pages
           or p in self._free]
    if bad:
      raise ValueError(f"pages {bad} were not handed out")
    self._free.extend(reversed(pages))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """A paged KV cache as one pytree: ``k_pages``, ``v_pages``,
  ``page_indices`` and ``kv_lengths`` (the arguments of
  :func:`paged_attention` and :func:`append`)."""

  k_pages: jax.Array
  v_pages: jax.Array
  page_indices: jax.Array
  kv_lengths: jax.Array

  @classmethod
  def create(cls, *, num_pages: int, page_size: int, kv_heads: int,
             head_dim: int, batch: int, pages_per_sequence: int,
             dtype=jnp.bfloat16) -> "PagedKVCache":
    """Zero pages, a page table of -1 (no page yet) and lengths 0."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    # Two buffers: the cache is donated to jit'ed steps, and XLA refuses
    # one buffer donated twice.
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
               jnp.full((batch, pages_per_sequence), -1, jnp.int32),
               jnp.zeros((batch,), jnp.int32))

  def with_pages(self, b: int, start: int, pages) -> "PagedKVCache":
    """Page-table row ``b`` with logical pages ``start, start + 1, ...``
    set to ``pages`` (from a :class:`PageAllocator`)."""
    pages = jnp.asarray(pages, jnp.int32)
    table = self.page_indices.at[b, start:start + pages.shape[0]].set(pages)
    return dataclasses.replace(self, page_indices=table)

  def append(self, k_new, v_new) -> "PagedKVCache":
    """The cache with ``k_new, v_new [batch, n, kv_heads, head_dim]``
    written after each sequence's keys (:func:`append`)."""
    k, v, lengths = append(self.k_pages, self.v_pages, self.page_indices,
                           self.kv_lengths, k_new, v_new)
    return dataclasses.replace(self, k_pages=k, v_pages=v,
                               kv_lengths=lengths)

  def attention(self, q, **kwargs):
    """:func:`paged_attention` of ``q`` over this cache."""
    return paged_attention(q, self.k_pages, self.v_pages, self.page_indices,
                           self.kv_lengths, **kwargs)
