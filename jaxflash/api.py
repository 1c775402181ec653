"""``flash_attention``: input checks and dispatch to a backend.

Backends, in the order ``implementation=None`` tries them:

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

from jaxflash import reference
from jaxflash import triton as triton_backend
from jaxflash.masks import MaskSpec

MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256


def _xla_check(q, k, v, *, interpret):
  del q, k, v, interpret  # the reference serves every valid call


def _xla_attention(q, k, v, *, mask: MaskSpec, softmax_scale, config,
                   interpret):
  del config, interpret
  out, lse = reference.attention(q, k, v, causal=mask.causal,
                                 causal_offset=mask.causal_offset,
                                 softmax_scale=softmax_scale)
  return out, lse


def _triton_attention(q, k, v, *, mask, softmax_scale, config, interpret):
  return triton_backend.attention(q, k, v, mask=mask,
                                  softmax_scale=softmax_scale, config=config,
                                  interpret=interpret)


# name -> (check_supported, attention, config type or None)
_BACKENDS: dict[str, tuple[Callable, Callable, type | None]] = {
    "triton": (triton_backend.check_supported, _triton_attention,
               triton_backend.TritonConfig),
    "xla": (_xla_check, _xla_attention, None),
}
IMPLEMENTATIONS = tuple(_BACKENDS)


def _shape_str(x) -> str:
  return f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}"


def _validate(q, k, v) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
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
        "q, k and v must share one dtype, got"
        f" q: {_shape_str(q)}, k: {_shape_str(k)}, v: {_shape_str(v)}")
  if not q.shape[0] == k.shape[0] == v.shape[0]:
    raise ValueError(
        f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)},"
        f" v {tuple(v.shape)}")
  if k.shape[1:3] != v.shape[1:3]:
    raise ValueError(
        "k and v must have the same sequence length and heads, got"
        f" k {tuple(k.shape)}, v {tuple(v.shape)}")
  if not q.shape[3] == k.shape[3] == v.shape[3]:
    raise ValueError(
        f"head_dim differs: q {tuple(q.shape)}, k {tuple(k.shape)},"
        f" v {tuple(v.shape)}")
  head_dim = q.shape[3]
  if (head_dim % 8 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM):
    raise ValueError(
        f"head_dim={head_dim} must be a multiple of 8 in"
        f" [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (q shape {tuple(q.shape)})")
  heads, kv_heads = q.shape[2], k.shape[2]
  if heads % kv_heads:
    raise ValueError(
        f"query heads ({heads}) must be a multiple of key/value heads"
        f" ({kv_heads}): q {tuple(q.shape)}, k {tuple(k.shape)}")
  for name, x in (("q", q), ("k", k)):
    if x.shape[1] < 1:
      raise ValueError(f"{name} has an empty sequence: {tuple(x.shape)}")


def _candidates(implementation, config, interpret) -> tuple[list[str], bool]:
  """Backends to try, and whether the caller named them explicitly."""
  if implementation is None:
    if config is not None:
      for name, (_, _, cfg_type) in _BACKENDS.items():
        if cfg_type is not None and isinstance(config, cfg_type):
          return [name], True
      raise ValueError(
          f"config of type {type(config).__name__} belongs to no backend")
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
    softmax_scale: float | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
    interpret: bool = False,
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
    softmax_scale: multiplier of the logits; default ``1/sqrt(head_dim)``.
      Must be a Python number (it is compiled into the kernels).
    return_lse: also return the log-sum-exp ``[batch, heads, q_len]``
      (float32, natural log, ``-inf`` for rows that see no key).
    implementation: ``None`` (best available), a backend name from
      :data:`IMPLEMENTATIONS`, or a sequence of names to try in order.
    config: a backend config (e.g. :class:`jaxflash.TritonConfig`); selects
      that backend when ``implementation`` is None.
    interpret: run Pallas kernels in interpret mode (on CPU, for testing).

  Returns:
    ``out`` shaped and typed like ``q``, or ``(out, lse)`` with
    ``return_lse=True``.  Both are differentiable.

  Raises:
    ValueError: malformed input (ranks, shapes, dtypes, head_dim, names).
    NotImplementedError: the named backend(s) cannot serve this call.
  """
  _validate(q, k, v)
  for name, val in (("causal", causal), ("return_lse", return_lse),
                    ("interpret", interpret)):
    if not isinstance(val, (bool, np.bool_)):
      raise ValueError(f"{name} must be a bool, got {val!r}")
  if softmax_scale is None:
    softmax_scale = 1.0 / math.sqrt(q.shape[3])
  elif isinstance(softmax_scale, jax.core.Tracer) or not isinstance(
      softmax_scale, (int, float, np.floating, np.integer)):
    raise ValueError(
        "softmax_scale must be a static Python number, got"
        f" {type(softmax_scale).__name__}")
  elif not (math.isfinite(softmax_scale) and softmax_scale > 0):
    raise ValueError(f"softmax_scale={softmax_scale} must be finite and > 0")
  mask = MaskSpec(q_len=q.shape[1], kv_len=k.shape[1], causal=bool(causal))

  names, explicit = _candidates(implementation, config, interpret)
  reasons = []
  for name in names:
    check, attend, cfg_type = _BACKENDS[name]
    try:
      if config is not None and not (cfg_type and isinstance(config,
                                                              cfg_type)):
        raise NotImplementedError(
            f"config of type {type(config).__name__} is not for backend"
            f" {name!r}")
      check(q, k, v, interpret=interpret)
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
      continue
    out, lse = attend(q, k, v, mask=mask, softmax_scale=float(softmax_scale),
                      config=config, interpret=interpret)
    return (out, lse) if return_lse else out
  msg = "; ".join(reasons)
  if explicit:
    raise NotImplementedError(
        f"no requested backend can serve this call: {msg}")
  raise NotImplementedError(f"no backend can serve this call: {msg}")
