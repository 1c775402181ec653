"""Helpers shared by the kernel packages (and nothing above them): array
padding, kernel output types, the softmax delta of the backward pass and
the device check of ``check_supported``."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  """Zero-pads ``axis`` of ``x`` up to ``size`` (no copy when equal)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def sm_count() -> int:
  """Streaming multiprocessors of the default device (132, an H100/H200
  SXM's, when the runtime does not say, as on the CPU interpreter)."""
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def out_struct(shape, dtype, *like) -> jax.ShapeDtypeStruct:
  """A kernel output type that varies over the manual mesh axes of the
  arrays it is computed from (needed inside ``shard_map`` with
  ``check_vma=True``)."""
  mats = [jax.typeof(x).manual_axis_type for x in like]
  varying = frozenset().union(*(m.varying for m in mats))
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=mats[0].update(varying=varying))


def softmax_delta(out, dout, dlse):
  """``delta_i = sum_d dO_id O_id - dlse_i`` per query row, float32,
  ``[B, H, T]`` from ``[B, T, H, D]`` operands (``dlse`` ``[B, H, T]``).

  A product summed over ``d`` in float32, then the small ``[B, T, H]``
  result transposed: one fused XLA pass, shared by both backends' backward.
  (The einsum ``"bthd,bthd->bht"`` it replaces is a ``dot_general`` with
  reordered batch dimensions; on the H200 XLA ran it as the same fused
  reduction, bitwise equal and as fast, 0.04 ms at 16k tokens x width 2048:
  docs/benchmarks/h200-2026-12-02-cc71c69-softmax-overlap.md.)
  ``d lse_i / d s_ij = P_ij``, so the LSE cotangent enters the gradient
  through ``delta``.
  """
  prod = out.astype(jnp.float32) * dout.astype(jnp.float32)
  return (jnp.sum(prod, axis=-1).transpose(0, 2, 1)
          - dlse.astype(jnp.float32))


def require_cuda(backend: str, need: str, accepts: Callable[[str], bool],
                 interpret_hint: str) -> None:
  """Raises NotImplementedError unless the default device is a CUDA GPU
  whose compute capability ``accepts``; ``need`` words the requirement."""
  if jax.default_backend() != "gpu":
    raise NotImplementedError(
        f"{backend} backend needs {need} (default backend is"
        f" {jax.default_backend()!r}); {interpret_hint}")
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", None)
  if cc is not None and not accepts(str(cc)):
    raise NotImplementedError(
        f"{backend} backend needs {need}, got compute capability {cc}"
        f" ({dev.device_kind})")
