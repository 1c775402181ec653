"""Ring attention: context parallelism for sequences split across devices.

Call :func:`ring_attention` inside ``jax.shard_map`` with the sequence axis
of q, k, v (and segment ids) split over the mesh axis ``axis_name``.  Each
device keeps its query block and passes its key/value block around the
ring with ``ppermute``; at every step it runs the flash kernels on (its
queries, the visiting keys) and merges the partial result exactly through
the log-sum-exp (Liu et al., "Ring Attention with Blockwise Transformers",
arXiv 2310.01889):

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward pass runs the ring again: each visiting block's dK/dV
accumulate along the ring and come home, where the owner adds its own
share (``n - 1`` transfers, as of K/V); dQ stays local.  It uses
the *final* output and LSE, so every partial gradient is exact.

Causal load balance: with contiguous blocks, device ``i`` of ``n`` would do
``i + 1`` blocks of work.  ``zigzag=True`` expects each device to hold two
chunks of the sequence cut in ``2n``: chunk ``i`` and chunk ``2n - 1 - i``
(:func:`zigzag_indices` gives the token order), so every device does the
same work.  Positions of a chunk pair decide its mask statically: an
earlier key chunk is fully visible, the same chunk is causal, a later one
is skipped.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from jaxflash import _context, backends, checks, flashmask
from jaxflash import op as op_lib
from jaxflash.flashmask import FlashMask
from jaxflash.masks import MaskArrays


def zigzag_indices(seq_len: int, n: int) -> np.ndarray:
  """Token order that gives device ``i`` chunks ``i`` and ``2n-1-i``:
  ``x[:, zigzag_indices(S, n)]`` before sharding the sequence over ``n``
  devices; ``np.argsort`` of it restores the original order."""
  if seq_len % (2 * n):
    raise ValueError(
        f"seq_len={seq_len} must be a multiple of 2 * {n} for zig-zag order")
  c = seq_len // (2 * n)
  order = []
  for i in range(n):
    order += list(range(i * c, (i + 1) * c))
    order += list(range((2 * n - 1 - i) * c, (2 * n - i) * c))
  return np.asarray(order)


def kernel_backend(q, *, config=None, interpret=False,
                   per_head_mask: bool = False) -> str:
  """The kernel backend ring attention runs when none is named: the one
  ``config`` belongs to; else Mosaic GPU where it serves ``q``'s head_dim
  and dtype (Hopper) and the FlashMask, if any, is shared by the heads
  (not ``per_head_mask``), else Triton (other GPUs, and interpret
  mode)."""
  cfg_owner = backends.owner(config)
  if cfg_owner is not None:
    return cfg_owner.name
  if interpret or per_head_mask:
    return "triton"
  x = jax.ShapeDtypeStruct((1, 128, 1, q.shape[-1]), q.dtype)
  try:
    return backends.select(x, x, x, implementation=None, config=None,
                           interpret=False, kernels_only=True).name
  except NotImplementedError:
    return "triton"


# The pair kernels under `jit`: a model traces ring attention once per
# layer, and every layer's pairs are the same few kernels (per relation
# and shape).  As jitted functions they are traced and lowered once per
# (params, shapes) and shared by all layers: lowering a 4-layer ring
# gradient for sm90 took 37 s on a 2-core CPU when each layer lowered its
# own kernels, against 7.5 s for one layer.
_local_forward = jax.jit(op_lib.local_forward, static_argnums=0)
_local_backward = jax.jit(op_lib.local_backward, static_argnums=0)


def ring_attention(q, k, v, *, axis_name: str, causal: bool = False,
                   segment_ids=None, mask: FlashMask | None = None,
                   softmax_scale: float | None = None,
                   zigzag: bool = True, return_lse: bool = False,
                   implementation: str | None = None, config=None,
                   interpret: bool = False,
                   deterministic: bool | None = None):
  """Attention over a sequence split across ``axis_name`` (in shard_map).

  Args:
    q, k, v: this device's blocks ``[batch, seq / n, heads, head_dim]`` of
      a sequence split evenly over the ``n`` devices of ``axis_name``; with
      ``causal`` and ``zigzag`` the tokens must be in
      :func:`zigzag_indices` order (self-attention, equal q/kv lengths).
    axis_name: the mesh axis the sequence is split over.
    causal: causal self-attention over the global sequence.
    segment_ids: this device's ``[batch, seq / n]`` ids (self-attention),
      or a pair for q and k/v; they travel with their blocks.
    mask: a :class:`jaxflash.FlashMask` of the *whole* sequence in its
      natural token order (``[batch|1, heads|1, n * seq / n]`` columns,
      the same on every device, whatever the blocks' order); each block
      pair reads its keys' columns at its global rows.
    zigzag: balance causal work (see module docstring).
    implementation: the kernel backend of each block (``"triton"`` or
      ``"mosaic_gpu"``); ``None`` picks it as :func:`kernel_backend` does.
      ``config``, ``interpret`` and ``deterministic`` as for
      :func:`jaxflash.flash_attention` (the ring itself sums in a fixed
      order).

  Returns ``out`` (and ``lse``), this device's block; differentiable.
  """
  # The checks of flash_attention, on this device's blocks.
  checks.validate(q, k, v)
  checks.check_bools(causal=causal, zigzag=zigzag, return_lse=return_lse,
                     interpret=interpret)
  n = lax.axis_size(axis_name)
  terms = MaskArrays()
  if segment_ids is not None:
    terms = checks.mask_arrays(q, k, segment_ids, None, None)
  if mask is not None:
    if not isinstance(mask, FlashMask):
      raise ValueError(
          f"mask must be a jaxflash.FlashMask, got {type(mask).__name__}")
    terms = terms._replace(flash_mask=flashmask.columns(mask.check(
        q.shape[0], q.shape[2], n * q.shape[1], n * k.shape[1])))

  picked = implementation is None
  if picked:
    implementation = kernel_backend(
        q, config=config, interpret=interpret,
        per_head_mask=terms.flash_mask is not None
        and terms.flash_mask.shape[1] > 1)
  if implementation not in ("triton", "mosaic_gpu"):
    raise ValueError(
        f"implementation={implementation!r}: ring attention runs the kernel"
        " backends 'triton' or 'mosaic_gpu'")
  if q.shape[1] != k.shape[1] and causal:
    raise ValueError(
        f"causal ring attention needs equal q and kv blocks, got {q.shape}"
        f" and {k.shape}")
  if causal and zigzag and q.shape[1] % 2:
    raise ValueError(
        f"zig-zag blocks hold two chunks: local seq {q.shape[1]} must be"
        " even")
  scale = (1.0 / math.sqrt(q.shape[3]) if softmax_scale is None
           else checks.static_positive("softmax_scale", softmax_scale))
  deterministic = checks.resolve_deterministic(deterministic)
  # The ring calls the kernels directly (no dispatch): refuse here, with
  # the backend's reason, what it cannot run.  A named backend is lowered
  # as asked (so that a CPU host can lower it for a GPU, as the tests
  # do), but for what the Mosaic GPU interpreter cannot run (it fails
  # inside shard_map over several devices); a backend picked here is
  # checked as flash_attention's dispatch checks it (no CUDA GPU and no
  # interpret=True: the Triton backend's refusal, not Pallas' error).
  backend = backends.get(implementation)
  if backend.check_config is not None:
    backend.check_config(config, deterministic)
  if interpret if implementation == "mosaic_gpu" else picked:
    backend.check_supported(q, k, v, arrays=terms,
                            logits_soft_cap=None, config=config,
                            interpret=interpret)

  def params_for(spec):
    return backends.op_params(backend, mask=spec, softmax_scale=scale,
                              logits_soft_cap=None, config=config,
                              interpret=interpret,
                              deterministic=deterministic)

  ring = _context.Ring(
      axis_name, n, causal, zigzag, params_for,
      varying=frozenset().union(*map(_context.varying_axes, (q, k, v))),
      local_forward=_local_forward, local_backward=_local_backward)
  out, lse = _context.ring_attention(ring, q, k, v, *terms)
  return (out, lse) if return_lse else out
