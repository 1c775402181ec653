"""Checks of the public entry points' arguments, shared by
:func:`jaxflash.flash_attention`, :func:`jaxflash.dot_product_attention`
and :func:`jaxflash.sharding.ring_attention`: ``ValueError`` naming the
offending values (in the caller's argument names, through ``names``)."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.masks import MaskArrays, MaskSpec

MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256


def _shape_str(x) -> str:
  return f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}"


# FP8 inputs (jaxflash.fp8): queries in e4m3, keys and values in e4m3 or
# e5m2 (one format for both).
FP8_Q_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)
FP8_KV_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(*xs) -> bool:
  """Whether any of ``xs`` has an FP8 dtype."""
  return any(jnp.dtype(x.dtype) in FP8_KV_DTYPES for x in xs
             if hasattr(x, "dtype"))


def validate(q, k, v, names=None) -> None:
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
  if is_fp8(q, k, v):
    if (jnp.dtype(q.dtype) not in FP8_Q_DTYPES or k.dtype != v.dtype
        or jnp.dtype(k.dtype) not in FP8_KV_DTYPES):
      raise ValueError(
          f"FP8 attention takes {qn} in float8_e4m3fn and {kn}, {vn} in one"
          f" of float8_e4m3fn, float8_e5m2, got {qn}: {_shape_str(q)},"
          f" {kn}: {_shape_str(k)}, {vn}: {_shape_str(v)}")
  elif not q.dtype == k.dtype == v.dtype:
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


def dropout(rate, rng, broadcast, batch: int):
  """``(rate, seeds)``: attention dropout's rate as a float and
  ``MaskArrays.dropout_seeds [batch, 4]``, the int32 seed per batch row
  drawn from ``rng`` (one seed for every row with ``broadcast``), or
  ``(0.0, None)`` without dropout."""
  if isinstance(rate, bool) or not isinstance(rate, (int, float, np.number)):
    raise ValueError(f"dropout_rate must be a static float in [0, 1), got"
                     f" {rate!r}")
  rate = float(rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate={rate} must lie in [0, 1)")
  if not isinstance(broadcast, bool):
    raise ValueError(f"dropout_broadcast must be a bool, got {broadcast!r}")
  if rate == 0.0:
    return 0.0, None
  if rng is None:
    raise ValueError(f"dropout_rate={rate} needs a dropout_rng key")
  rng = jnp.asarray(rng)
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.dtype != jnp.uint32 or rng.shape != (2,):
      raise ValueError("dropout_rng must be a jax.random key, got"
                       f" {rng.dtype} {rng.shape}")
    rng = jax.random.wrap_key_data(rng)
  bits = jax.random.bits(rng, (1 if broadcast else batch,), jnp.uint32)
  seeds = jnp.broadcast_to(jax.lax.bitcast_convert_type(bits, jnp.int32),
                           (batch,))
  # Columns 1-3: the index of the call's first head, query row and key
  # among the whole attention's (0 here; set per shard when the heads or
  # the sequence are sharded, jaxflash._partition and jaxflash._context).
  zero = jnp.zeros_like(seeds)
  return rate, jnp.stack([seeds, zero, zero, zero], axis=1)


def check_bools(names=None, **flags) -> None:
  """ValueError for a flag that is not a bool (named as the caller
  names it)."""
  for name, val in flags.items():
    if not isinstance(val, (bool, np.bool_)):
      raise ValueError(
          f"{(names or {}).get(name, name)} must be a bool, got {val!r}")


def static_positive(name: str, val) -> float:
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


def mask_spec(q_len: int, kv_len: int, *, causal, offset=None,
              local_window_size=None) -> MaskSpec:
  """The call's MaskSpec from the entry points' arguments (checked)."""
  # A side of the window that reaches past every key of every query
  # (q_len + kv_len covers any alignment) is no bound: None, so that no
  # position arithmetic sees a size near int32's limit (2**31 - 1 would
  # wrap).
  left, right = (None if w is not None and w >= q_len + kv_len else w
                 for w in window_sizes(local_window_size))
  return MaskSpec(q_len=q_len, kv_len=kv_len, causal=bool(causal),
                  offset=offset, window_left=left, window_right=right)


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


def int_array(name: str, x, shape: tuple[int, ...],
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


def mask_arrays(q, k, segment_ids, q_seq_lengths, kv_seq_lengths,
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
      q_seg = int_array("q_segment_ids", segment_ids[0], (B, T))
      kv_seg = int_array("kv_segment_ids", segment_ids[1], (B, S))
    else:
      if T != S:
        raise ValueError(
            f"one segment_ids array needs q_len == kv_len, got {T} and {S};"
            " pass a pair (q_segment_ids, kv_segment_ids)")
      q_seg = kv_seg = int_array("segment_ids", segment_ids, (B, T))
  lengths = []
  for name, x, full in (("q_seq_lengths", q_seq_lengths, T),
                        ("kv_seq_lengths", kv_seq_lengths, S)):
    lengths.append(None if x is None else int_array(
        (names or {}).get(name, name), x, (B,), valid=(0, full)))
  return MaskArrays(q_seg, kv_seg, *lengths)


def dense_array(name: str, x, full: tuple[int, int, int, int],
                 squeeze: bool, *, boolean: bool):
  """``dot_product_attention``'s ``bias`` (floating) or ``mask`` (bool),
  checked: rank 4 ``[B, N, T, S]`` (rank 3 ``[N, T, S]`` with rank-3
  inputs), each axis full or 1 (broadcast); returned rank 4 with the key
  axis full (the kernels slice key tiles; the other axes stay
  broadcast)."""
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
  x = x[None] if squeeze else x
  return jnp.broadcast_to(x, (*x.shape[:3], full[3]))


def alibi_slopes(x, batch: int, heads: int):
  """ALiBi slopes ``[heads]`` or ``[batch, heads]`` (floating) as the
  kernels take them: float32 ``[B|1, H, 1, 2]`` (slope, position shift:
  0 here; context parallelism's block pairs set it,
  :func:`jaxflash.masks.alibi_bias`); None stays None."""
  if x is None:
    return None
  x = x if isinstance(x, jax.Array) else jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"alibi_slopes must be floating-point, got dtype"
                     f" {jnp.dtype(x.dtype).name}")
  if x.shape not in ((heads,), (batch, heads)):
    raise ValueError(
        f"alibi_slopes must have shape (heads,) = ({heads},) or (batch,"
        f" heads) = ({batch}, {heads}), got {tuple(x.shape)}")
  x = x.astype(jnp.float32).reshape(-1, heads, 1, 1)
  return jnp.concatenate([x, jnp.zeros_like(x)], axis=3)


def resolve_deterministic(value) -> bool:
  """The ``deterministic`` argument resolved: None follows XLA's own
  switch for reproducible GPU reductions, ``--xla_gpu_deterministic_ops``
  in ``XLA_FLAGS``."""
  if value is None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    return any(f.lower() in ("--xla_gpu_deterministic_ops",
                             "--xla_gpu_deterministic_ops=true")
               for f in flags)
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"deterministic must be a bool or None, got {value!r}")
  return bool(value)
