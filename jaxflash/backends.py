"""The backend registry: which kernels serve a call.

One :class:`Backend` record per implementation, in the order
``implementation=None`` tries them:

* ``"mosaic_gpu"``: the Hopper (sm90) kernels in Pallas Mosaic GPU
  (FlashAttention-3 structure).  Where its backward kernels do not serve a
  call (padded head_dim > 128 without ``bwd_paired_dkv``) the gradient is
  the Triton backward kernels', composed here from the same residuals.
  Only when named does it run in the Mosaic GPU interpreter.
* ``"triton"``: Pallas kernels for the Triton lowering (CUDA GPUs, sm80+;
  on CPU only with ``interpret=True``).
* ``"xla"``: the pure-JAX reference (:mod:`jaxflash.reference`), which
  runs everywhere; O(N^2) memory.

:func:`select` is the one dispatch every entry point uses: a backend that
cannot serve a call raises ``NotImplementedError`` with the reason and the
next one is tried; a backend asked for by name (or by its config) that
cannot serve the call raises that error to the caller, never falls back.
:func:`attention` runs the chosen backend: the kernel backends through
:mod:`jaxflash.op` (custom VJP, vmap, partitioning), the reference as it
is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp

from jaxflash import flashmask, masks, mosaic_gpu, op, reference, triton
from jaxflash._util import sm_count
from jaxflash.masks import MaskArrays, MaskSpec
from jaxflash.mosaic_gpu import backend as mosaic_kernels
from jaxflash.triton import backend as triton_kernels
from jaxflash.triton import decode

NO_MASK_ARRAYS = MaskArrays()


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of the attention op.

  ``check_supported(q, k, v, *, arrays, logits_soft_cap, config,
  interpret)`` raises NotImplementedError when the backend cannot serve
  the call; ``check_config(config, deterministic)`` raises ValueError for
  a config that contradicts the call's other arguments; ``kernels`` is
  None for the reference, which needs no op around it.
  """

  name: str
  config_type: type | None
  check_supported: Callable = dataclasses.field(repr=False)
  kernels: op.Kernels | None = None
  check_config: Callable | None = dataclasses.field(default=None,
                                                     repr=False)


def _mosaic_backward(q, k, v, arrays, out, lse, dout, dlse, *, mask,
                     softmax_scale, logits_soft_cap, config, interpret,
                     deterministic, bias_grad=False, dropout_rate=0.0,
                     dropout_shared=False):
  """The Hopper backward kernels, or the Triton ones where those do not
  serve the call (both take the same residuals and regenerate dropout's
  keep mask from the same hash; :func:`mosaic_gpu.serves_backward` says
  which: the paired kernels, for one, take no dense terms or dropout)."""
  bias = arrays.bias
  if bias is not None:
    # The bias as the Hopper forward read it (in q's dtype), so that the
    # recomputed probabilities match its log-sum-exp; dbias in the
    # bias's own dtype.
    arrays = arrays._replace(bias=bias.astype(q.dtype))
  if mosaic_gpu.serves_backward(
      q, k, mask=mask, config=config, interpret=interpret,
      deterministic=deterministic, arrays=arrays, bias_grad=bias_grad,
      dropout_rate=dropout_rate):
    grads = mosaic_kernels.backward(
        q, k, v, arrays, out, lse, dout, dlse, mask=mask,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        config=config, interpret=interpret, deterministic=deterministic,
        bias_grad=bias_grad, dropout_rate=dropout_rate,
        dropout_shared=dropout_shared)
  else:
    grads = triton_kernels.backward(
        q, k, v, arrays, out, lse, dout, dlse, mask=mask,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        config=None, interpret=bool(interpret), bias_grad=bias_grad,
        dropout_rate=dropout_rate, dropout_shared=dropout_shared)
  return (*grads[:3], *(g.astype(bias.dtype) for g in grads[3:]))


def _with_decode(forward: Callable) -> Callable:
  """``forward``, except that decode-shaped calls with no config (a few
  query rows over a long cache: :func:`decode.serves_contiguous`) take the
  paged split-K decode kernel over the cache viewed as pages.  Its ``(out,
  lse)`` are the residuals the backend's backward takes, so gradients
  still flow through the backend's own backward kernels."""

  def fwd(q, k, v, arrays, *, mask, softmax_scale, logits_soft_cap, config,
          interpret, **dropout):
    if config is None and decode.serves_contiguous(q, k, arrays):
      return decode.contiguous_forward(
          q, k, v, arrays, mask=mask, softmax_scale=softmax_scale,
          logits_soft_cap=logits_soft_cap, interpret=bool(interpret),
          sm_count=sm_count())
    return forward(q, k, v, arrays, mask=mask, softmax_scale=softmax_scale,
                   logits_soft_cap=logits_soft_cap, config=config,
                   interpret=interpret, **dropout)
  return fwd


def _reference_check(q, k, v, **unused):
  del q, k, v, unused  # the reference serves every valid call


_REGISTRY = (
    Backend("mosaic_gpu", mosaic_gpu.MosaicConfig, mosaic_gpu.check_supported,
            op.Kernels("mosaic_gpu", _with_decode(mosaic_kernels.forward),
                       _mosaic_backward,
                       inline_interpreted=True),
            mosaic_gpu.check_deterministic),
    Backend("triton", triton.TritonConfig, triton.check_supported,
            op.Kernels("triton", _with_decode(triton_kernels.forward),
                       triton_kernels.backward)),
    Backend("xla", None, _reference_check),
)
BACKENDS: dict[str, Backend] = {b.name: b for b in _REGISTRY}
IMPLEMENTATIONS = tuple(BACKENDS)
KERNEL_BACKENDS = tuple(b.name for b in _REGISTRY if b.kernels is not None)


def get(name: str) -> Backend:
  """The backend called ``name`` (ValueError for an unknown name)."""
  if name not in BACKENDS:
    raise ValueError(
        f"implementation={name!r} is not one of {IMPLEMENTATIONS}")
  return BACKENDS[name]


def owner(config) -> Backend | None:
  """The backend ``config`` belongs to (None for no config; ValueError
  for a config of no backend)."""
  if config is None:
    return None
  for b in _REGISTRY:
    if b.config_type is not None and isinstance(config, b.config_type):
      return b
  raise ValueError(
      f"config of type {type(config).__name__} belongs to no backend")


def candidates(implementation: str | Sequence[str] | None, config,
               interpret: bool, *, kernels_only: bool = False
               ) -> tuple[list[Backend], bool]:
  """Backends to try, in order, and whether the caller named them (by
  ``implementation`` or by ``config``).  ``kernels_only`` leaves out the
  reference (for callers that compose the kernels themselves)."""
  cfg_owner = owner(config)
  if implementation is None:
    if cfg_owner is not None:
      return [cfg_owner], True
    names = ["triton", "xla"] if interpret else list(IMPLEMENTATIONS)
    backends = [BACKENDS[n] for n in names]
    if kernels_only:
      backends = [b for b in backends if b.kernels is not None]
    return backends, False
  names = ([implementation] if isinstance(implementation, str)
           else list(implementation))
  if not names:
    raise ValueError("implementation must not be an empty sequence")
  return [get(n) for n in names], True


def select(q, k, v, *, implementation, config, interpret: bool,
           arrays: MaskArrays = NO_MASK_ARRAYS, logits_soft_cap=None,
           kernels_only: bool = False) -> Backend:
  """The first candidate backend that serves the call; NotImplementedError
  with every candidate's reason when none does."""
  backends, explicit = candidates(implementation, config, interpret,
                                  kernels_only=kernels_only)
  reasons = []
  for b in backends:
    try:
      if config is not None and not (b.config_type
                                     and isinstance(config, b.config_type)):
        raise NotImplementedError(
            f"config of type {type(config).__name__} is not for backend"
            f" {b.name!r}")
      b.check_supported(q, k, v, arrays=arrays,
                        logits_soft_cap=logits_soft_cap, config=config,
                        interpret=interpret)
    except NotImplementedError as e:
      reasons.append(f"{b.name}: {e}")
      continue
    return b
  msg = "; ".join(reasons)
  if explicit:
    raise NotImplementedError(
        f"no requested backend can serve this call: {msg}")
  raise NotImplementedError(f"no backend can serve this call: {msg}")


def op_params(backend: Backend, *, mask: MaskSpec, softmax_scale: float,
              logits_soft_cap, config, interpret,
              deterministic: bool, dropout_rate: float = 0.0,
              dropout_shared: bool = False,
              context_parallel: str | None = None) -> op.OpParams:
  """The static arguments of ``backend``'s op (a kernel backend)."""
  if backend.kernels is None:
    raise ValueError(f"backend {backend.name!r} has no kernels")
  if backend.check_config is not None:
    backend.check_config(config, deterministic)
  return op.OpParams(kernels=backend.kernels, mask=mask,
                     softmax_scale=float(softmax_scale),
                     logits_soft_cap=logits_soft_cap, config=config,
                     interpret=interpret, deterministic=bool(deterministic),
                     dropout_rate=float(dropout_rate),
                     dropout_shared=bool(dropout_shared),
                     context_parallel=context_parallel)


def attention(backend: Backend | str, q, k, v, *, mask: MaskSpec,
              arrays: MaskArrays = NO_MASK_ARRAYS, softmax_scale: float,
              logits_soft_cap: float | None = None, config=None,
              interpret=False, deterministic: bool = False,
              dropout_rate: float = 0.0, dropout_shared: bool = False,
              context_parallel: str | None = None):
  """``(out, lse)`` of ``backend`` on checked inputs, differentiable in
  both (no support check: :func:`select` chose it, or a test or tool
  asks for it)."""
  if isinstance(backend, str):
    backend = get(backend)
  if backend.kernels is None:
    segs = None
    if arrays.q_segment_ids is not None:
      segs = (arrays.q_segment_ids, arrays.kv_segment_ids)
    dense_mask, bias = arrays.dense_mask, arrays.bias
    if arrays.alibi_slopes is not None:
      slopes = arrays.alibi_slopes[:, :, :, :1]  # [B|1, H, 1, 1]
      alibi = masks.alibi_bias(
          slopes, jnp.arange(q.shape[1])[:, None],
          jnp.arange(k.shape[1])[None, :], mask.offset,
          arrays.alibi_slopes[:, :, :, 1:])
      bias = alibi if bias is None else bias + alibi
    if arrays.flash_mask is not None:
      cols = flashmask.visible_from_columns(arrays.flash_mask, q.shape[1])
      dense_mask = cols if dense_mask is None else dense_mask & cols
    return reference.attention(
        q, k, v, causal=mask.causal, offset=mask.offset,
        window=(mask.window_left, mask.window_right), segment_ids=segs,
        q_seq_lengths=arrays.q_seq_lengths,
        kv_seq_lengths=arrays.kv_seq_lengths, softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap, bias=bias,
        dense_mask=dense_mask,
        dropout_rate=dropout_rate, dropout_seeds=arrays.dropout_seeds,
        dropout_shared=dropout_shared)
  return op.attention(q, k, v, arrays, op_params(
      backend, mask=mask, softmax_scale=softmax_scale,
      logits_soft_cap=logits_soft_cap, config=config, interpret=interpret,
      deterministic=deterministic, dropout_rate=dropout_rate,
      dropout_shared=dropout_shared, context_parallel=context_parallel))
