"""FP8 attention, FlashAttention-3's low-precision forward (Shah et al.,
arXiv 2407.08608, section 3.3), and the tools around it.

* :func:`quantize_fp8`: amax scaling of a tensor (per tensor or along one
  axis, e.g. per head) into ``float8_e4m3fn`` / ``float8_e5m2``, returning
  the dequantization scale.
* :func:`hadamard_rotate`: FlashAttention-3's "incoherent processing": q
  and k multiplied by one random orthogonal matrix (random signs, then a
  Hadamard transform of the head dimension), which leaves ``q k^T``
  unchanged and spreads outlier features over the whole head, so that
  their quantization error shrinks.
* :func:`attention`: what ``flash_attention`` runs for FP8 ``q, k, v``:
  the logits from the FP8 product scaled by ``q_scale * k_scale``, the
  probabilities rounded to the values' format for the ``P V`` product,
  float32 accumulation, the output scaled by ``v_scale`` and written in
  ``out_dtype``.  Forward only: a gradient raises NotImplementedError.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import backends, checks, op
from jaxflash.masks import MaskArrays, MaskSpec
from jaxflash.mosaic_gpu import backend as mosaic_kernels
from jaxflash.mosaic_gpu.config import MosaicConfig
from jaxflash.triton import backend as triton_kernels
from jaxflash.triton.config import TritonConfig

FP8_DTYPES = checks.FP8_KV_DTYPES
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
              jnp.dtype(jnp.float32))
# The config each backend takes (the XLA reference none).
_CONFIG_TYPES = {"mosaic_gpu": MosaicConfig, "triton": TritonConfig,
                 "xla": type(None)}


def quantize_fp8(x, *, axis: int | None = None, dtype=jnp.float8_e4m3fn):
  """``(x_fp8, scale)`` with ``x ~= x_fp8.astype(float32) * scale``.

  Amax scaling: ``scale = amax(|x|) / max(dtype)`` over the whole tensor
  (``axis=None``: a float32 scalar) or over everything but ``axis``
  (e.g. ``axis=2``, the heads of ``[batch, seq, heads, head_dim]``: a
  ``[heads]`` vector, the per-head scales ``flash_attention`` takes).  An
  all-zero slice gets scale 1.
  """
  dtype = jnp.dtype(dtype)
  if dtype not in FP8_DTYPES:
    raise ValueError(f"dtype={dtype.name} is not one of"
                     f" {[d.name for d in FP8_DTYPES]}")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating-point array, got {x.dtype}")
  if axis is not None:
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
      raise ValueError(f"axis={axis!r} is not an axis of shape {x.shape}")
    axis %= x.ndim
  others = tuple(a for a in range(x.ndim) if a != axis)
  return amax_quantize(x, others, dtype)


def amax_quantize(x, axes: tuple[int, ...], dtype=jnp.float8_e4m3fn):
  """``(x_fp8, scale)``: ``x`` scaled by the amax over ``axes`` so that
  the largest magnitude of each slice is ``dtype``'s largest (an all-zero
  slice: scale 1); ``scale`` float32 with ``axes`` removed."""
  x32 = jnp.asarray(x).astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
  return (x32 / scale).astype(dtype), jnp.squeeze(scale, axes)


def _hadamard(n: int) -> np.ndarray:
  """The ``n x n`` Sylvester Hadamard matrix (``n`` a power of two)."""
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def hadamard_rotate(q, k, *, key=None):
  """``(q @ M, k @ M)`` over the head dimension, ``M = diag(signs) H /
  sqrt(n)`` block-diagonal: ``H`` the Hadamard matrix of the largest power
  of two ``n`` dividing ``head_dim`` (a block per ``n`` features), signs
  random +-1 from ``key`` (default ``jax.random.key(0)``).  ``M`` is
  orthogonal, so attention logits ``q k^T`` are unchanged (up to
  rounding); outlier features are spread over their block before
  quantization (FlashAttention-3's incoherent processing).  Apply it
  before :func:`quantize_fp8`; values are left as they are."""
  q, k = jnp.asarray(q), jnp.asarray(k)
  d = q.shape[-1]
  if k.shape[-1] != d:
    raise ValueError(f"q {q.shape} and k {k.shape} differ in head_dim")
  n = d & -d  # the largest power of two dividing d
  if key is None:
    key = jax.random.key(0)
  signs = jax.random.rademacher(key, (d,), jnp.float32)
  block = jnp.asarray(_hadamard(n) / math.sqrt(n))

  def rotate(x):
    y = (x.astype(jnp.float32) * signs).reshape(*x.shape[:-1], d // n, n)
    return (y @ block).reshape(x.shape).astype(x.dtype)
  return rotate(q), rotate(k)


def dequant_scale(name: str, s, heads: int):
  """A dequantization scale as float32 ``[heads]``: None is 1, a scalar
  is broadcast, a vector must have ``heads`` entries."""
  if s is None:
    return jnp.ones((heads,), jnp.float32)
  s = jnp.asarray(s)
  if not jnp.issubdtype(s.dtype, jnp.floating):
    raise ValueError(f"{name} must be a float scalar or [{heads}] array,"
                     f" got dtype {s.dtype}")
  if s.ndim == 0:
    return jnp.broadcast_to(s.astype(jnp.float32), (heads,))
  if s.shape != (heads,):
    raise ValueError(f"{name} must be a scalar or have shape ({heads},),"
                     f" got {s.shape}")
  return s.astype(jnp.float32)


def check_scales(q, k, *, q_scale, k_scale, v_scale, out_dtype, names=None):
  """The FP8 call's scales as float32 ``[heads]``, ``[kv_heads]``,
  ``[kv_heads]``, and its output dtype (default bfloat16); ValueError
  naming the argument otherwise."""
  if out_dtype is None:
    out_dtype = jnp.bfloat16
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    raise ValueError(f"out_dtype={jnp.dtype(out_dtype).name} is not one of"
                     f" {[d.name for d in OUT_DTYPES]}")
  nm = (names or {}).get
  H, K = q.shape[2], k.shape[2]
  return (dequant_scale(nm("q_scale", "q_scale"), q_scale, H),
          dequant_scale(nm("k_scale", "k_scale"), k_scale, K),
          dequant_scale(nm("v_scale", "v_scale"), v_scale, K),
          jnp.dtype(out_dtype))


def _backend(implementation, q, k, arrays: MaskArrays, out_dtype, config,
             interpret: bool) -> str:
  """The FP8 forward's backend: the first of ``implementation`` (a name or
  a sequence tried in order; None: the backend that owns ``config``, else
  the Hopper kernel, the Triton kernel, then XLA, as the 16-bit calls
  order them) that serves the call; NotImplementedError with every
  reason when none does."""
  names = [b.name for b in backends.candidates(implementation, config,
                                               interpret)[0]]
  named = implementation is not None or config is not None
  reasons = []
  for name in names:
    try:
      if config is not None and not isinstance(config, _CONFIG_TYPES[name]):
        raise NotImplementedError(
            f"config of type {type(config).__name__} is not for this"
            " backend")
      if name == "xla":
        return "xla"
      if name == "mosaic_gpu":
        mosaic_kernels.check_supported_fp8(
            q, k, arrays=arrays, out_dtype=out_dtype, config=config,
            interpret=interpret)
      else:
        triton_kernels.check_supported_fp8(q, k, interpret=interpret)
      return name
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
  raise NotImplementedError(
      ("no requested backend" if named else "no backend")
      + " can serve this FP8 call: " + "; ".join(reasons))


@functools.cache
def _kernels(backend: str, out_dtype) -> op.Kernels:
  """The FP8 forward of ``backend`` as the op's kernels (cached: the op's
  static parameters compare equal across calls): the scales come from
  ``MaskArrays.fp8_scales``, so that the op partitions them with the
  heads under ``jit``; the backward raises."""
  kernels = mosaic_kernels if backend == "mosaic_gpu" else triton_kernels

  def forward(q, k, v, arrays, *, mask, softmax_scale, logits_soft_cap,
              config, interpret):
    scales = arrays.fp8_scales
    if scales.shape[0] != 1:
      raise NotImplementedError(
          "FP8 scales that differ between batch rows (a vmap over the"
          " scales): call once per set of scales")
    return kernels.forward_fp8(
        q, k, v, arrays._replace(fp8_scales=None), mask=mask,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        dequant=scales[0, :, 0, :], out_dtype=out_dtype, config=config,
        interpret=interpret)

  def backward(*args, **kwargs):
    del args, kwargs
    raise NotImplementedError(_FORWARD_ONLY)

  return op.Kernels(f"{backend}-fp8", forward, backward,
                    inline_interpreted=backend == "mosaic_gpu")


_FORWARD_ONLY = ("FP8 attention is forward only: differentiate the bfloat16"
                 " path (train in bfloat16, quantize for inference)")


def attention(q, k, v, *, q_scale, k_scale, v_scale, out_dtype,
              mask: MaskSpec, arrays: MaskArrays, softmax_scale: float,
              logits_soft_cap, implementation, config, interpret: bool):
  """``(out, lse)`` of FP8 ``q, k, v`` (checked by the caller) with their
  float32 scales ``[heads]``, ``[kv_heads]``, ``[kv_heads]``.  The kernels
  run as :mod:`jaxflash.op`'s op (partitioned under ``jit`` with batch-
  or head-sharded inputs, batched under ``vmap``); ``"xla"`` is XLA's
  own ops on the dequantized inputs."""
  backend = _backend(implementation, q, k, arrays, out_dtype, config,
                     interpret)
  if backend == "xla":
    return _reference(q, k, v, q_scale, k_scale, v_scale, out_dtype=out_dtype,
                      mask=mask, arrays=arrays, softmax_scale=softmax_scale,
                      logits_soft_cap=logits_soft_cap)
  G = q.shape[2] // k.shape[2]
  kv = jnp.repeat(jnp.arange(k.shape[2]), G)  # query head -> kv head
  scales = jnp.stack([q_scale * k_scale[kv], v_scale[kv]], axis=1)
  arrays = arrays._replace(fp8_scales=scales[None, :, None, :])
  return op.attention(q, k, v, arrays, op.OpParams(
      _kernels(backend, jnp.dtype(out_dtype)), mask=mask,
      softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
      config=config, interpret=interpret))


def _reference(q, k, v, qs, ks, vs, *, out_dtype, mask, arrays,
               softmax_scale, logits_soft_cap):
  """Exact attention of the dequantized inputs (the test oracle), forward
  only as the kernels are."""

  @jax.custom_vjp
  def run(q, k, v, qs, ks, vs):
    def deq(x, s):
      return x.astype(jnp.float32) * s[None, None, :, None]
    out, lse = backends.attention(
        "xla", deq(q, qs), deq(k, ks), deq(v, vs), mask=mask,
        arrays=arrays, softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap)
    return out.astype(out_dtype), lse

  def fwd(*args):
    return run(*args), None

  def bwd(res, cotangents):
    del res, cotangents
    raise NotImplementedError(_FORWARD_ONLY)

  run.defvjp(fwd, bwd)
  return run(q, k, v, qs, ks, vs)
