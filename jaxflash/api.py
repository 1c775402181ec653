"""``flash_attention``: input checks and dispatch to a backend.

Backends, in the order ``implementation=None`` tries them:

* ``"mosaic_gpu"``: the Hopper (sm90) forward and backward kernels in
  Pallas Mosaic GPU (FlashAttention-3 structure); at padded head_dim > 128
  the gradient needs ``bwd_paired_dkv`` (the tuned default there) or
  ``bwd_split_dkv``, or uses
  the Triton backward kernels.  Only when named does it run in the Mosaic
  GPU interpreter.
* ``"triton"``: Pallas kernels for the Triton lowering (CUDA GPUs, sm80+;
  on CPU only with ``interpret=True``).
* ``"xla"``: the pure-JAX reference (:mod:`jaxflash.reference`), which
  runs everywhere; O(N^2) memory.

A backend that cannot serve a call raises ``NotImplementedError`` with the
reason and the next one is tried; a backend asked for by name that cannot
serve the call raises that error to the caller, never falls back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import mosaic_gpu as mosaic_backend
from jaxflash import op as op_lib
from jaxflash import reference
from jaxflash import triton as triton_backend
from jaxflash.masks import MaskArrays, MaskSpec

MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256


def _xla_check(q, k, v, **unused):
  del q, k, v, unused  # the reference serves every valid call


def _triton_check(q, k, v, *, interpret, **unused):
  del unused
  triton_backend.check_supported(q, k, v, interpret=interpret)


def _mosaic_attention(q, k, v, *, mask, arrays, softmax_scale,
                      logits_soft_cap, config, interpret, deterministic):
  return mosaic_backend.attention(q, k, v, mask=mask, arrays=arrays,
                                  softmax_scale=softmax_scale,
                                  logits_soft_cap=logits_soft_cap,
                                  config=config, interpret=interpret,
                                  deterministic=deterministic)


def _xla_attention(q, k, v, *, mask: MaskSpec, arrays: MaskArrays,
                   softmax_scale, logits_soft_cap, config, interpret,
                   deterministic, dense=(None, None)):
  del config, interpret, deterministic  # XLA's gradient has no atomics
  segs = None
  if arrays.q_segment_ids is not None:
    segs = (arrays.q_segment_ids, arrays.kv_segment_ids)
  return reference.attention(
      q, k, v, causal=mask.causal, offset=mask.offset,
      window=(mask.window_left, mask.window_right), segment_ids=segs,
      q_seq_lengths=arrays.q_seq_lengths,
      kv_seq_lengths=arrays.kv_seq_lengths, softmax_scale=softmax_scale,
      logits_soft_cap=logits_soft_cap, bias=dense[0], dense_mask=dense[1])


def _triton_attention(q, k, v, *, mask, arrays, softmax_scale,
                      logits_soft_cap, config, interpret, deterministic):
  del deterministic  # the Triton backward is always reproducible
  return triton_backend.attention(
      q, k, v, mask=mask, arrays=arrays, softmax_scale=softmax_scale,
      logits_soft_cap=logits_soft_cap, config=config, interpret=interpret)


# name -> (check_supported, attention, config type or None)
_BACKENDS: dict[str, tuple[Callable, Callable, type | None]] = {
    "mosaic_gpu": (mosaic_backend.check_supported, _mosaic_attention,
                   mosaic_backend.MosaicConfig),
    "triton": (_triton_check, _triton_attention,
               triton_backend.TritonConfig),
    "xla": (_xla_check, _xla_attention, None),
}
IMPLEMENTATIONS = tuple(_BACKENDS)


def _shape_str(x) -> str:
  return f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}"


# Argument names in error messages: flash_attention's own, or
# dot_product_attention's (jax.nn's) for the same checks.
_DPA_NAMES = {"q": "query", "k": "key", "v": "value", "causal": "is_causal",
              "softmax_scale": "scale", "q_seq_lengths": "query_seq_lengths",
              "kv_seq_lengths": "key_value_seq_lengths"}


def _validate(q, k, v, names=None) -> None:
  nm = (names or {}).get
  qn, kn, vn = nm("q", "q"), nm("k", "k"), nm("v", "v")
  for name, x in ((qn, q), (kn, k), (vn, v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape"
          f" {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(
          f"{name} must be a floating-point array, got dtype"
          f" {jnp.dtype(x.dtype).name}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(
        f"{qn}, {kn} and {vn} must share one dtype, got {qn}:"
        f" {_shape_str(q)}, {kn}: {_shape_str(k)}, {vn}: {_shape_str(v)}")
  shapes = (f"{qn} {tuple(q.shape)}, {kn} {tuple(k.shape)}, {vn}"
            f" {tuple(v.shape)}")
  if not q.shape[0] == k.shape[0] == v.shape[0]:
    raise ValueError(f"batch sizes differ: {shapes}")
  if k.shape[1:3] != v.shape[1:3]:
    raise ValueError(
        f"{kn} and {vn} must have the same sequence length and heads, got"
        f" {kn} {tuple(k.shape)}, {vn} {tuple(v.shape)}")
  if not q.shape[3] == k.shape[3] == v.shape[3]:
    raise ValueError(f"head_dim differs: {shapes}")
  head_dim = q.shape[3]
  if (head_dim % 8 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM):
    raise ValueError(
        f"head_dim={head_dim} must be a multiple of 8 in"
        f" [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] ({qn} shape {tuple(q.shape)})")
  heads, kv_heads = q.shape[2], k.shape[2]
  if kv_heads < 1 or heads < 1:
    raise ValueError(f"heads must be >= 1: {shapes}")
  if heads % kv_heads:
    raise ValueError(
        f"query heads ({heads}) must be a multiple of key/value heads"
        f" ({kv_heads}): {qn} {tuple(q.shape)}, {kn} {tuple(k.shape)}")
  for name, x in ((qn, q), (kn, k)):
    if x.shape[1] < 1:
      raise ValueError(f"{name} has an empty sequence: {tuple(x.shape)}")


def _check_bools(names=None, **flags) -> None:
  """ValueError for a flag that is not a bool (named as the caller
  names it)."""
  for name, val in flags.items():
    if not isinstance(val, (bool, np.bool_)):
      raise ValueError(
          f"{(names or {}).get(name, name)} must be a bool, got {val!r}")


def _static_positive(name: str, val) -> float:
  """A static positive number: a Python or NumPy scalar, or a concrete
  0-d array (``jnp.float32(0.1)``); never a traced value, since it is
  compiled into the kernels."""
  scalar = isinstance(val, (int, float, np.floating, np.integer)) or (
      hasattr(val, "shape") and hasattr(val, "dtype") and val.shape == ()
      and (jnp.issubdtype(val.dtype, jnp.floating)
           or jnp.issubdtype(val.dtype, jnp.integer)))
  if (isinstance(val, (jax.core.Tracer, bool, np.bool_)) or not scalar):
    raise ValueError(
        f"{name} must be a static Python number, got {type(val).__name__}")
  try:
    val = float(val)
  except OverflowError:
    raise ValueError(f"{name}={val!r} must be finite and > 0") from None
  # The kernels take it in float32: a value that float32 rounds to inf or
  # flushes to zero (below the smallest normal) would give NaN.
  f32 = np.finfo(np.float32)
  if not (math.isfinite(val) and val > 0):
    raise ValueError(f"{name}={val} must be finite and > 0")
  if not float(f32.tiny) <= val <= float(f32.max):
    raise ValueError(
        f"{name}={val} must lie in float32's normal range"
        f" [{float(f32.tiny):.3g}, {float(f32.max):.3g}]")
  return val


def window_sizes(local_window_size) -> tuple[int | None, int | None]:
  """``local_window_size`` (None, ``w`` or ``(left, right)``) checked, as
  ``(left, right)`` (None: unbounded)."""
  if local_window_size is None:
    return None, None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(
      local_window_size, bool):
    left = right = int(local_window_size)
  elif (isinstance(local_window_size, (tuple, list))
        and len(local_window_size) == 2
        and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                for x in local_window_size)):
    left, right = (int(x) for x in local_window_size)
  else:
    raise ValueError(
        "local_window_size must be an int or a pair (left, right) of ints,"
        f" got {local_window_size!r}")
  if left < 0 or right < 0:
    raise ValueError(
        f"local_window_size={local_window_size!r}: window sizes must be"
        " >= 0")
  return left, right


_INT32 = np.iinfo(np.int32)


def _value_range(x) -> tuple[int, int]:
  """Smallest and largest value of a concrete integer array: computed
  where it lives (a device array sends back two scalars, not itself)."""
  if isinstance(x, (np.ndarray, np.generic)):
    return int(x.min()), int(x.max())
  # Evaluated now even when a jit trace is active (an array closed over
  # by the traced function is concrete, but jnp.min would be staged).
  with jax.ensure_compile_time_eval():
    return int(jnp.min(x)), int(jnp.max(x))


def _int_array(name: str, x, shape: tuple[int, ...],
               valid: tuple[int, int] | None = None) -> jax.Array:
  """``x`` as the kernels' int32, checked: integer dtype, ``shape`` and,
  when concrete, values in ``valid`` (default: int32's range, so that the
  cast cannot wrap an id into another or into padding).  A traced array
  of another dtype is clipped to ``valid`` before the cast."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    x = np.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(
        f"{name} must be an integer array, got dtype"
        f" {jnp.dtype(x.dtype).name}")
  if tuple(x.shape) != shape:
    raise ValueError(
        f"{name} must have shape {shape}, got {tuple(x.shape)}")
  lo, hi = valid if valid is not None else (_INT32.min, _INT32.max)
  if isinstance(x, jax.core.Tracer):
    # Lengths past the ends mean the whole row or none of it either way;
    # clipped first, a wide one cannot wrap.  Traced ids are cast as they
    # are (documented: they must lie in int32's range).
    if valid is not None and jnp.dtype(x.dtype) != jnp.int32:
      x = jnp.clip(x, lo, hi)
    return x.astype(jnp.int32)
  info = jnp.iinfo(x.dtype)
  if valid is None and info.min >= lo and info.max <= hi:
    return jnp.asarray(x, jnp.int32)  # fits: nothing to check
  on_host = isinstance(x, (np.ndarray, np.generic))
  x_min, x_max = _value_range(x) if x.size else (lo, hi)
  if x_min < lo or x_max > hi:
    what = f"lie in [{lo}, {hi}]" + (
        " (the sequence length)" if valid is not None else
        " (int32, the kernels' id type)")
    raise ValueError(f"{name} must {what}, got {np.asarray(x).tolist()}"
                     if x.size <= 16 else
                     f"{name} must {what}, got values in"
                     f" [{x_min}, {x_max}]")
  return (jnp.asarray(np.asarray(x, np.int32)) if on_host
          else x.astype(jnp.int32))


def _mask_arrays(q, k, segment_ids, q_seq_lengths, kv_seq_lengths,
                 names=None) -> MaskArrays:
  B, T, S = q.shape[0], q.shape[1], k.shape[1]
  q_seg = kv_seg = None
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      if len(segment_ids) != 2:
        raise ValueError(
            "segment_ids must be one [batch, seq] array or a pair"
            f" (q_segment_ids, kv_segment_ids), got {len(segment_ids)}"
            " items")
      q_seg = _int_array("q_segment_ids", segment_ids[0], (B, T))
      kv_seg = _int_array("kv_segment_ids", segment_ids[1], (B, S))
    else:
      if T != S:
        raise ValueError(
            f"one segment_ids array needs q_len == kv_len, got {T} and {S};"
            " pass a pair (q_segment_ids, kv_segment_ids)")
      q_seg = kv_seg = _int_array("segment_ids", segment_ids, (B, T))
  lengths = []
  for name, x, full in (("q_seq_lengths", q_seq_lengths, T),
                        ("kv_seq_lengths", kv_seq_lengths, S)):
    lengths.append(None if x is None else _int_array(
        (names or {}).get(name, name), x, (B,), valid=(0, full)))
  return MaskArrays(q_seg, kv_seg, *lengths)


def _dense_array(name: str, x, full: tuple[int, int, int, int],
                 squeeze: bool, *, boolean: bool):
  """``dot_product_attention``'s ``bias`` (floating) or ``mask`` (bool),
  checked: rank 4 ``[B, N, T, S]`` (rank 3 ``[N, T, S]`` with rank-3
  inputs), each axis full or 1 (broadcast); returned rank 4."""
  if x is None:
    return None
  x = x if isinstance(x, jax.Array) else jnp.asarray(x)
  rank = 3 if squeeze else 4
  axes = "[N, T, S]" if squeeze else "[B, N, T, S]"
  want = full[1:] if squeeze else full
  if x.ndim != rank or any(n not in (1, f) for n, f in zip(x.shape, want)):
    raise ValueError(
        f"{name} must have shape {axes} = {want}, each axis full or 1,"
        f" got {tuple(x.shape)}")
  ok = (x.dtype == jnp.bool_ if boolean
        else jnp.issubdtype(x.dtype, jnp.floating))
  if not ok:
    raise ValueError(
        f"{name} must be a {'bool' if boolean else 'floating-point'} array,"
        f" got dtype {jnp.dtype(x.dtype).name}")
  return x[None] if squeeze else x


def _candidates(implementation, config, interpret) -> tuple[list[str], bool]:
  """Backends to try, and whether the caller named them explicitly."""
  owner = None
  if config is not None:
    owner = next((name for name, (_, _, cfg_type) in _BACKENDS.items()
                  if cfg_type is not None and isinstance(config, cfg_type)),
                 None)
    if owner is None:
      raise ValueError(
          f"config of type {type(config).__name__} belongs to no backend")
  if implementation is None:
    if owner is not None:
      return [owner], True
    if interpret:
      return ["triton", "xla"], False
    return list(IMPLEMENTATIONS), False
  names = [implementation] if isinstance(implementation, str) else list(
      implementation)
  if not names:
    raise ValueError("implementation must not be an empty sequence")
  for name in names:
    if name not in _BACKENDS:
      raise ValueError(
          f"implementation={name!r} is not one of {IMPLEMENTATIONS}")
  return names, True


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

  Returns:
    ``out`` shaped and typed like ``q``, or ``(out, lse)`` with
    ``return_lse=True``.  Both are differentiable.

  Raises:
    ValueError: malformed input (ranks, shapes, dtypes, head_dim, names).
    NotImplementedError: the named backend(s) cannot serve this call.
  """
  return _attention(
      q, k, v, causal=causal, offset=None, segment_ids=segment_ids,
      local_window_size=local_window_size, q_seq_lengths=q_seq_lengths,
      kv_seq_lengths=kv_seq_lengths, logits_soft_cap=logits_soft_cap,
      softmax_scale=softmax_scale, return_lse=return_lse,
      implementation=implementation, config=config, interpret=interpret,
      deterministic=deterministic)


def _attention(q, k, v, *, causal, offset, segment_ids, local_window_size,
               q_seq_lengths, kv_seq_lengths, logits_soft_cap, softmax_scale,
               return_lse, implementation, config, interpret, deterministic,
               names=None, dense=None):
  """Validation and dispatch shared by the public entry points.

  ``offset``: query ``i`` is aligned with key ``i + offset`` (None:
  bottom-right, as flash_attention documents; 0: top-left, as jax.nn).
  ``names``: the caller's argument names for the error messages.
  ``dense``: ``(bias, mask)`` checked by :func:`_dense_array` (either may
  be None), for the ``"xla"`` backend alone.
  """
  nm = (names or {}).get
  # Host arrays take JAX's canonical dtype first, as every jnp function
  # gives them (NumPy's float64 is float32 without jax_enable_x64).
  q, k, v = (jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic))
             else x for x in (q, k, v))
  _validate(q, k, v, names)
  _check_bools(names, causal=causal, return_lse=return_lse,
               interpret=interpret)
  if softmax_scale is None:
    softmax_scale = 1.0 / math.sqrt(q.shape[3])
  softmax_scale = _static_positive(nm("softmax_scale", "softmax_scale"),
                                   softmax_scale)
  if logits_soft_cap is not None:
    logits_soft_cap = _static_positive("logits_soft_cap", logits_soft_cap)
  T, S = q.shape[1], k.shape[1]
  # A side of the window that reaches past every key of every query
  # (T + S covers any alignment) is no bound: None, so that no position
  # arithmetic sees a size near int32's limit (2**31 - 1 would wrap).
  left, right = (None if w is not None and w >= T + S else w
                 for w in window_sizes(local_window_size))
  mask = MaskSpec(q_len=T, kv_len=S, causal=bool(causal),
                  offset=offset, window_left=left, window_right=right)
  arrays = _mask_arrays(q, k, segment_ids, q_seq_lengths, kv_seq_lengths,
                        names)
  deterministic = op_lib.resolve_deterministic(deterministic)
  if isinstance(config, mosaic_backend.MosaicConfig):
    mosaic_backend.check_deterministic(config, deterministic)

  backends, explicit = _candidates(implementation, config, interpret)
  extra = {}
  if dense is not None:
    backends, extra = ["xla"], {"dense": dense}
  reasons = []
  for name in backends:
    check, attend, cfg_type = _BACKENDS[name]
    try:
      if config is not None and not (cfg_type and isinstance(config,
                                                              cfg_type)):
        raise NotImplementedError(
            f"config of type {type(config).__name__} is not for backend"
            f" {name!r}")
      check(q, k, v, arrays=arrays, logits_soft_cap=logits_soft_cap,
            config=config, interpret=interpret)
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
      continue
    if q.shape[0] == 0:  # an empty batch: nothing for a kernel to do
      out = jnp.zeros(q.shape, q.dtype)
      lse = jnp.zeros((0, q.shape[2], T),
                      jnp.promote_types(jnp.float32, q.dtype))
      return (out, lse) if return_lse else out
    out, lse = attend(q, k, v, mask=mask, arrays=arrays,
                      softmax_scale=softmax_scale,
                      logits_soft_cap=logits_soft_cap, config=config,
                      interpret=interpret, deterministic=deterministic,
                      **extra)
    return (out, lse) if return_lse else out
  msg = "; ".join(reasons)
  if explicit:
    raise NotImplementedError(
        f"no requested backend can serve this call: {msg}")
  raise NotImplementedError(f"no backend can serve this call: {msg}")


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
):
  """Drop-in for ``jax.nn.dot_product_attention``, served by jaxflash.

  Same arguments, shapes (``[B, T, N, H]`` or ``[T, N, H]``) and semantics
  as ``jax.nn.dot_product_attention``: ``is_causal`` and the local window
  are aligned top-left (query ``i`` sees keys ``j <= i``), ``scale``
  defaults to ``1/sqrt(H)``, ``return_residual=True`` adds the log-sum-exp
  shaped ``[B, T, N]`` in the output dtype.  Extras: ``segment_ids`` and
  ``logits_soft_cap`` (see :func:`flash_attention`), ``config``,
  ``interpret`` and ``deterministic``.

  ``implementation``: a jaxflash backend name (``"mosaic_gpu"``,
  ``"triton"``, ``"xla"``), a sequence of them, or None (best available).
  ``bias`` (floating) and a dense boolean ``mask`` are ``[B, N, T, S]``
  arrays (``[N, T, S]`` with rank-3 inputs; any axis may be 1 and
  broadcast) that the O(N) kernels cannot take: they are served only
  when ``implementation`` names ``"xla"`` (alone or in a sequence), by
  jaxflash's reference with the bias added to the scaled logits and the
  mask combined with every other argument's, O(N^2) memory; otherwise
  NotImplementedError names the compact alternatives (``is_causal``,
  ``segment_ids``, ``local_window_size``, the sequence lengths).  Every
  argument is checked as on the kernels' path; ``logits_soft_cap`` does
  not combine with ``bias`` (NotImplementedError).

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
  _check_bools(return_residual=return_residual)
  squeeze = query.ndim == 3
  if squeeze:
    query, key, value = query[None], key[None], value[None]
  if bias is not None or mask is not None:
    # A sequence of names is tried in order; only "xla" takes the dense
    # arrays, so it serves the call wherever it is named.
    names, _ = _candidates(implementation, config, interpret)
    if implementation is None or "xla" not in names:
      what = "bias" if bias is not None else "a dense mask"
      raise NotImplementedError(
          f"jaxflash kernels take no {what} (an N x N array): express the"
          " mask with is_causal, segment_ids, local_window_size or"
          " query_seq_lengths/key_value_seq_lengths, or pass"
          " implementation='xla' for the dense O(N^2) path")
    if bias is not None and logits_soft_cap is not None:
      raise NotImplementedError(
          "implementation='xla' with a dense bias does not combine with"
          " logits_soft_cap (which of the two applies first is undefined)")
    _validate(query, key, value, _DPA_NAMES)
    full = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    dense = (_dense_array("bias", bias, full, squeeze, boolean=False),
             _dense_array("mask", mask, full, squeeze, boolean=True))
    config = None  # a kernel's config does not serve the dense path
  else:
    dense = None
  out, lse = _attention(
      query, key, value, causal=is_causal, offset=0, segment_ids=segment_ids,
      local_window_size=local_window_size, q_seq_lengths=query_seq_lengths,
      kv_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
      softmax_scale=scale, return_lse=True, implementation=implementation,
      config=config, interpret=interpret, deterministic=deterministic,
      names=_DPA_NAMES, dense=dense)
  res = jnp.swapaxes(lse, 1, 2).astype(out.dtype)  # [B, N, T] -> [B, T, N]
  if squeeze:
    out = out[0]
    res = None if res is None else res[0]
  return (out, res) if return_residual else out
