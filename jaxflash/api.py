"""The public functions: :func:`flash_attention` and
:func:`dot_product_attention` (``jax.nn``'s signature).

Each checks its arguments (:mod:`jaxflash.checks`) and runs the backend
that :func:`jaxflash.backends.select` picks: ``"mosaic_gpu"`` on Hopper,
then ``"triton"``, then the ``"xla"`` reference (the order and the
fallback rule are in :mod:`jaxflash.backends`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import backends, checks, flashmask, fp8
from jaxflash.flashmask import FlashMask

IMPLEMENTATIONS = backends.IMPLEMENTATIONS

# Argument names in error messages: flash_attention's own, or
# dot_product_attention's (jax.nn's) for the same checks.
_DPA_NAMES = {"q": "query", "k": "key", "v": "value", "causal": "is_causal",
              "softmax_scale": "scale", "q_seq_lengths": "query_seq_lengths",
              "kv_seq_lengths": "key_value_seq_lengths"}


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    q_seq_lengths: jax.Array | None = None,
    kv_seq_lengths: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
    interpret: bool = False,
    deterministic: bool | None = None,
    q_scale: jax.Array | float | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    out_dtype: Any = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    dropout_broadcast: bool = False,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    context_parallel: str | None = None,
):
  """Exact attention in O(sequence) memory.

  Args:
    q: queries ``[batch, q_len, heads, head_dim]``.
    k: keys ``[batch, kv_len, kv_heads, head_dim]``; ``heads`` must be a
      multiple of ``kv_heads`` (grouped-query attention; one key/value head
      is multi-query attention).  Query head ``h`` uses key/value head
      ``h // (heads // kv_heads)``.
    v: values, shaped like ``k``.
    causal: causal mask, aligned bottom-right when ``q_len != kv_len``
      (the last query sees the last key; see :mod:`jaxflash.masks`).
    segment_ids: ``[batch, seq]`` integer array (self-attention) or a pair
      ``(q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len])``: a
      query attends only to keys of its own segment (packed documents).
      Negative ids (:data:`jaxflash.PAD_SEGMENT_ID`) mark padding tokens
      that attend nowhere and that no query attends to.
    local_window_size: ``w`` or ``(left, right)``: query ``i`` attends to
      keys in ``[i' - left, i' + right]``, ``i'`` its aligned key position
      (``i + kv_len - q_len``); combines with ``causal``.
    q_seq_lengths, kv_seq_lengths: ``[batch]`` valid lengths of
      right-padded rows; queries past their length see nothing (output 0),
      keys past theirs are masked.
    logits_soft_cap: ``cap * tanh(logits / cap)`` applied to the scaled
      logits before the softmax (Gemma-style); a static positive number.
    softmax_scale: multiplier of the logits; default ``1/sqrt(head_dim)``.
      Must be static, a Python or NumPy number or a concrete 0-d array (it
      is compiled into the kernels).
    return_lse: also return the log-sum-exp ``[batch, heads, q_len]``
      (float32, or float64 for float64 inputs on ``"xla"``; natural log,
      ``-inf`` for rows that see no key).
    implementation: ``None`` (best available: ``"mosaic_gpu"`` on Hopper,
      then ``"triton"``, then ``"xla"``), a backend name from
      :data:`IMPLEMENTATIONS`, or a sequence of names to try in order.
    config: a backend config (:class:`jaxflash.TritonConfig` or
      :class:`jaxflash.MosaicConfig`); selects that backend when
      ``implementation`` is None.
    interpret: run Pallas kernels in interpret mode (on CPU, for testing);
      with ``implementation=None`` this selects the Triton kernels.
    deterministic: ``True`` makes the gradients bitwise reproducible run
      to run.  Only the Hopper backward has a non-deterministic fast path
      (dQ summed by atomic adds, the default at head_dim <= 64 on the H200
      and the H100 SXM); with
      ``True`` it uses its dQ kernel instead (measured cost in
      docs/backends.md).  ``None`` (default): ``True`` when ``XLA_FLAGS``
      holds ``--xla_gpu_deterministic_ops=true``, else ``False``.
    q_scale, k_scale, v_scale: with FP8 inputs (``q`` in
      ``float8_e4m3fn``, ``k`` and ``v`` in ``float8_e4m3fn`` or
      ``float8_e5m2``), their dequantization scales: attention is computed
      on ``q * q_scale`` etc.; float32 scalars, or per head (``[heads]``
      for ``q``, ``[kv_heads]`` for ``k`` and ``v``); None is 1
      (:func:`jaxflash.quantize_fp8` makes them).  FP8 calls are forward
      only (a gradient raises NotImplementedError) and run the Hopper
      kernel (sm90; e4m3 or e5m2 keys and values), the Triton kernel
      (sm89+; e4m3) or ``"xla"``.
    out_dtype: the FP8 call's output dtype: bfloat16 (default), float16
      or float32 (the Triton kernel's).
    dropout_rate: attention dropout (FlashAttention-1/2's, in the
      kernels): each probability is dropped with this probability and the
      kept ones scaled by ``1 / (1 - rate)``; the keep mask is a hash of
      (``dropout_rng``, batch row, head, query, key), regenerated by the
      backward, so a call is a pure function of its key.  A static float
      in ``[0, 1)``; the Triton kernels and ``"xla"`` serve it (not the
      Hopper kernels yet).
    dropout_rng: a ``jax.random`` key, required with ``dropout_rate > 0``.
    dropout_broadcast: one keep mask for every batch row and head (Flax's
      ``broadcast_dropout``).
    bias: a dense ``[batch, heads, q_len, kv_len]`` floating array added
      to the scaled logits (ALiBi, T5's relative positions, a learned
      bias); any axis may be 1 and broadcast.  Differentiable: its
      gradient is computed, summed over the broadcast axes, only when the
      bias is differentiated.  Read tile by tile with the Q/K tiles.
    mask: a dense boolean array shaped like ``bias``: False hides the key
      from the query, combined with every other mask argument; or a
      :class:`jaxflash.FlashMask` (per key, the query rows it is hidden
      from: causal documents, prefix-LM, shared question, sliding and
      global windows in O(N) memory; rows counted from the top-left; its
      causal mode, ``is_causal``, runs as this call's causal mask when
      ``q_len == kv_len``).
      Tiles with no visible pair are skipped (a summary of the mask's
      tiles is made once per call).
    alibi_slopes: ``[heads]`` or ``[batch, heads]`` float: ALiBi (Press et
      al.), ``-slope * |i' - j|`` added to the scaled logits (``i'`` the
      query's aligned key position, as FlashAttention-2), computed in the
      kernels with no array; not differentiated.
    context_parallel: with q, k, v sharded on the sequence axis under
      ``jit``: ``"ring"`` (ring attention: key/value blocks passed around
      the sequence's mesh axes, overlapped with the kernels),
      ``"allgather"`` (K/V gathered once; also q_len != kv_len) or None
      (GQA of 4:1 or more, windows, ALiBi and q_len != kv_len take the
      all-gather, the rest the ring; docs/sharding.md).
    The bias and ALiBi do not combine with ``logits_soft_cap``; every
    backend serves ``bias`` and ``alibi_slopes`` (on a Hopper GPU the
    Hopper forward with the Triton backward; docs/backends.md), the
    Triton kernels and ``"xla"`` a dense ``mask``.

  Returns:
    ``out`` shaped and typed like ``q``, or ``(out, lse)`` with
    ``return_lse=True``.  Both are differentiable.

  Raises:
    ValueError: malformed input (ranks, shapes, dtypes, head_dim, names).
    NotImplementedError: the named backend(s) cannot serve this call.
  """
  mask, causal = _flash_causal(mask, causal, q, k, top_left=False)
  dense = _dense_args(q, k, bias, mask, logits_soft_cap, squeeze=False,
                      alibi_slopes=alibi_slopes)
  return _attention(
      q, k, v, causal=causal, offset=None, segment_ids=segment_ids,
      local_window_size=local_window_size, q_seq_lengths=q_seq_lengths,
      kv_seq_lengths=kv_seq_lengths, logits_soft_cap=logits_soft_cap,
      softmax_scale=softmax_scale, return_lse=return_lse,
      implementation=implementation, config=config, interpret=interpret,
      deterministic=deterministic,
      fp8_args=dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                    out_dtype=out_dtype),
      dropout=(dropout_rate, dropout_rng, dropout_broadcast), dense=dense,
      context_parallel=context_parallel)


def _flash_causal(mask, causal, q, k, *, top_left: bool, names=None):
  """``(mask, causal)``: a FlashMask's ``is_causal`` becomes the call's
  causal mask where that is aligned top-left as FlashMask's rows are
  (``top_left``: ``dot_product_attention``'s; else where ``q_len ==
  kv_len``), so the kernels compute it from the indices, with the causal
  tile schedule and configs; elsewhere its explicit upper range
  (:meth:`FlashMask.split_causal`).  Measured on an H100 SXM, causal
  documents ran 1.58x faster this way than as three fields in a
  non-causal call, 1.03x faster than segment ids
  (docs/benchmarks/h100-2026-12-07-5f4800d-flashmask-causal-decode-launch.md)."""
  if not isinstance(mask, FlashMask) or not mask.is_causal:
    return mask, causal
  checks.check_bools(names, causal=causal)
  aligned = top_left or (getattr(q, "ndim", 0) == 4
                         and getattr(k, "ndim", 0) == 4
                         and q.shape[1] == k.shape[1])
  mask, fold = mask.split_causal(aligned)
  return mask, causal or fold


def _dense_args(q, k, bias, mask, logits_soft_cap, *, squeeze: bool,
                names=None, alibi_slopes=None):
  """``(bias, mask, flash_columns, alibi)`` checked
  (:func:`jaxflash.checks.dense_array`, :meth:`FlashMask.check`,
  :func:`jaxflash.checks.alibi_slopes`), the dense ones rank 4, or None
  when no argument is given.  ``q``,
  ``k``: rank 4; ``squeeze``: the arrays come rank 3, for rank-3 inputs
  of ``dot_product_attention``."""
  if bias is None and mask is None and alibi_slopes is None:
    return None
  for name, x in (("a dense bias", bias), ("alibi_slopes", alibi_slopes)):
    if x is not None and logits_soft_cap is not None:
      raise NotImplementedError(
          f"{name} does not combine with logits_soft_cap (which of the two"
          " applies first is undefined)")
  nm = (names or {}).get
  if getattr(q, "ndim", 0) != 4 or getattr(k, "ndim", 0) != 4:
    return None  # checks.validate names the malformed inputs first
  full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
  cols = None
  if isinstance(mask, FlashMask):
    cols = flashmask.columns(mask.check(full[0], full[1], full[2], full[3]))
    mask = None
  return (checks.dense_array(nm("bias", "bias"), bias, full, squeeze,
                             boolean=False),
          checks.dense_array(nm("mask", "mask"), mask, full, squeeze,
                             boolean=True), cols,
          checks.alibi_slopes(alibi_slopes, full[0], full[1]))


def _attention(q, k, v, *, causal, offset, segment_ids, local_window_size,
               q_seq_lengths, kv_seq_lengths, logits_soft_cap, softmax_scale,
               return_lse, implementation, config, interpret, deterministic,
               names=None, dense=None, fp8_args=None, dropout=None,
               context_parallel=None):
  """Validation and dispatch shared by the public entry points.

  ``offset``: query ``i`` is aligned with key ``i + offset`` (None:
  bottom-right, as flash_attention documents; 0: top-left, as jax.nn).
  ``names``: the caller's argument names for the error messages.
  ``dense``: ``(bias, mask)`` checked by :func:`_dense_args` (either may
  be None).  ``fp8_args``: the FP8 scales and output dtype
  (:mod:`jaxflash.fp8`).  ``dropout``: ``(rate, rng, broadcast)``.
  """
  nm = (names or {}).get
  # Host arrays take JAX's canonical dtype first, as every jnp function
  # gives them (NumPy's float64 is float32 without jax_enable_x64).
  q, k, v = (jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic))
             else x for x in (q, k, v))
  checks.validate(q, k, v, names)
  checks.check_bools(names, causal=causal, return_lse=return_lse,
                     interpret=interpret)
  if softmax_scale is None:
    softmax_scale = 1.0 / math.sqrt(q.shape[3])
  softmax_scale = checks.static_positive(
      nm("softmax_scale", "softmax_scale"), softmax_scale)
  if logits_soft_cap is not None:
    logits_soft_cap = checks.static_positive("logits_soft_cap",
                                             logits_soft_cap)
  mask = checks.mask_spec(q.shape[1], k.shape[1], causal=causal,
                          offset=offset, local_window_size=local_window_size)
  arrays = checks.mask_arrays(q, k, segment_ids, q_seq_lengths,
                              kv_seq_lengths, names)
  deterministic = checks.resolve_deterministic(deterministic)
  if context_parallel not in (None, "ring", "allgather"):
    raise ValueError(f"context_parallel={context_parallel!r} must be"
                     " 'ring', 'allgather' or None")
  if dense is not None:
    arrays = arrays._replace(bias=dense[0], dense_mask=dense[1],
                             flash_mask=dense[2], alibi_slopes=dense[3])
  rate, shared = 0.0, False
  if dropout is not None:
    rate, rng, shared = dropout
    rate, seeds = checks.dropout(rate, rng, shared, q.shape[0])
    if seeds is not None:
      arrays = arrays._replace(dropout_seeds=seeds)
  fp8_args = fp8_args or {}
  if checks.is_fp8(q, k, v):
    if rate:
      raise NotImplementedError("FP8 calls take no dropout (forward only)")
    if dense is not None:
      raise NotImplementedError("FP8 inputs take no dense bias or mask")
    q_scale, k_scale, v_scale, out_dtype = fp8.check_scales(
        q, k, names=names, **fp8_args)
    out, lse = fp8.attention(
        q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        out_dtype=out_dtype, mask=mask, arrays=arrays,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        implementation=implementation, config=config, interpret=interpret)
    return (out, lse) if return_lse else out
  given = [n for n, x in fp8_args.items() if x is not None]
  if given:
    raise ValueError(f"{', '.join(given)} apply to FP8 inputs only; got"
                     f" {nm('q', 'q')} in {jnp.dtype(q.dtype).name}")
  cfg_owner = backends.owner(config)
  if cfg_owner is not None and cfg_owner.check_config is not None:
    cfg_owner.check_config(config, deterministic)

  backend = backends.select(q, k, v, implementation=implementation,
                            config=config, interpret=interpret,
                            arrays=arrays, logits_soft_cap=logits_soft_cap)
  if q.shape[0] == 0:  # an empty batch: nothing for a kernel to do
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.zeros((0, q.shape[2], q.shape[1]),
                    jnp.promote_types(jnp.float32, q.dtype))
  else:
    out, lse = backends.attention(
        backend, q, k, v, mask=mask, arrays=arrays,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        config=config, interpret=interpret, deterministic=deterministic,
        dropout_rate=rate, dropout_shared=shared,
        context_parallel=context_parallel)
  return (out, lse) if return_lse else out


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | Sequence[str] | None = None,
    return_residual: bool = False,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    logits_soft_cap: float | None = None,
    config: Any = None,
    interpret: bool = False,
    deterministic: bool | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    dropout_broadcast: bool = False,
    alibi_slopes: jax.Array | None = None,
    context_parallel: str | None = None,
):
  """Drop-in for ``jax.nn.dot_product_attention``, served by jaxflash.

  Same arguments, shapes (``[B, T, N, H]`` or ``[T, N, H]``) and semantics
  as ``jax.nn.dot_product_attention``: ``is_causal`` and the local window
  are aligned top-left (query ``i`` sees keys ``j <= i``), ``scale``
  defaults to ``1/sqrt(H)``, ``return_residual=True`` adds the log-sum-exp
  shaped ``[B, T, N]`` in the output dtype.  Extras: ``segment_ids`` and
  ``logits_soft_cap`` (see :func:`flash_attention`), ``config``,
  ``interpret``, ``deterministic``, attention dropout
  (``dropout_rate``, ``dropout_rng``, ``dropout_broadcast``) and
  ``alibi_slopes`` and ``context_parallel``, as :func:`flash_attention`'s
  (ALiBi aligned top-left here, as the causal mask).

  ``implementation``: a jaxflash backend name (``"mosaic_gpu"``,
  ``"triton"``, ``"xla"``), a sequence of them, or None (best available).
  ``bias`` (floating) and a dense boolean ``mask`` are ``[B, N, T, S]``
  arrays (``[N, T, S]`` with rank-3 inputs; any axis may be 1 and
  broadcast; ``mask`` may also be a :class:`jaxflash.FlashMask`), served
  by the Triton kernels (read tile by tile, tiles the mask hides skipped,
  the bias's gradient when it is differentiated; see
  :func:`flash_attention`) and by ``"xla"``; the bias does not combine
  with ``logits_soft_cap`` (NotImplementedError).

  Documented differences (docs/flax.md), on every path: a query row that
  sees no key at all gets output 0 and residual ``-inf`` here, where
  ``jax.nn`` averages all values of the row (it masks with a large finite
  negative number); the residual is differentiable (``jax.nn`` stops its
  gradient); ``scale`` must be a static positive number and ``H`` a
  multiple of 8 in [8, 256].
  """
  query, key, value = (jnp.asarray(x) if not hasattr(x, "ndim") else x
                       for x in (query, key, value))
  ranks = {x.ndim for x in (query, key, value)}
  if len(ranks) != 1 or not ranks <= {3, 4}:
    raise ValueError(
        "query, key and value must all have rank 4 [B, T, N, H] or all rank"
        f" 3 [T, N, H], got query {tuple(query.shape)}, key"
        f" {tuple(key.shape)}, value {tuple(value.shape)}")
  checks.check_bools(return_residual=return_residual)
  squeeze = query.ndim == 3
  if squeeze:
    query, key, value = query[None], key[None], value[None]
  mask, is_causal = _flash_causal(mask, is_causal, query, key,
                                  top_left=True, names=_DPA_NAMES)
  dense = _dense_args(query, key, bias, mask, logits_soft_cap,
                      squeeze=squeeze, alibi_slopes=alibi_slopes)
  out, lse = _attention(
      query, key, value, causal=is_causal, offset=0, segment_ids=segment_ids,
      local_window_size=local_window_size, q_seq_lengths=query_seq_lengths,
      kv_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
      softmax_scale=scale, return_lse=True, implementation=implementation,
      config=config, interpret=interpret, deterministic=deterministic,
      names=_DPA_NAMES, dense=dense,
      dropout=(dropout_rate, dropout_rng, dropout_broadcast),
      context_parallel=context_parallel)
  res = jnp.swapaxes(lse, 1, 2).astype(out.dtype)  # [B, N, T] -> [B, T, N]
  if squeeze:
    out = out[0]
    res = None if res is None else res[0]
  return (out, res) if return_residual else out
