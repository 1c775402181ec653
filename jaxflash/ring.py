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

The backward pass runs the ring again: each step's dK/dV travel with the
key/value block and come home after a full turn; dQ stays local.  It uses
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

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash import backends, checks
from jaxflash import op as op_lib
from jaxflash.masks import MaskArrays, MaskSpec


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


def kernel_backend(q, *, config=None, interpret=False) -> str:
  """The kernel backend ring attention runs when none is named: the one
  ``config`` belongs to; else Mosaic GPU where it serves ``q``'s head_dim
  and dtype (Hopper), else Triton (other GPUs, and interpret mode)."""
  cfg_owner = backends.owner(config)
  if cfg_owner is not None:
    return cfg_owner.name
  if interpret:
    return "triton"
  x = jax.ShapeDtypeStruct((1, 128, 1, q.shape[-1]), q.dtype)
  try:
    return backends.select(x, x, x, implementation=None, config=None,
                           interpret=False, kernels_only=True).name
  except NotImplementedError:
    return "triton"


def _merge(out_a, lse_a, out_b, lse_b):
  """Exact merge of two partial softmax results (float32 accumulators)."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
  w_a = jnp.exp(lse_a - safe)  # [B, H, T]
  w_b = jnp.exp(lse_b - safe)
  tr = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # -> [B, T, H, 1]
  return out_a * tr(w_a) + out_b * tr(w_b), lse


def _chunks(x, parts: int):
  """Split the sequence axis (1) of a local block into ``parts`` chunks."""
  return jnp.split(x, parts, axis=1) if parts > 1 else [x]


def _varying_axes(x) -> frozenset:
  """The manual mesh axes ``x``'s type varies over (empty outside
  shard_map or with check_vma=False)."""
  return jax.typeof(x).mat.varying


class _Ring:
  """Static description of one ring attention call."""

  def __init__(self, axis_name, n, causal, zigzag, params_for, varying):
    self.axis_name, self.n, self.causal = axis_name, n, causal
    self.zigzag = zigzag and causal
    self.parts = 2 if self.zigzag else 1
    self.params_for = params_for  # MaskSpec -> OpParams
    # shard_map(check_vma=True): the blocks' types say which manual axes
    # they vary over (the ring's, and any other the blocks are split
    # over: batch on "data", heads on "tensor"), and so must every value
    # the loops and branches combine them with (zeros of skipped pairs,
    # initial accumulators).  Empty without check_vma.
    self.varying = frozenset(varying)

  def vary(self, *xs):
    """``xs`` typed as varying over the blocks' axes (under check_vma)."""
    def cast(x):
      missing = self.varying - _varying_axes(x)
      return lax.pcast(x, tuple(sorted(missing)), to="varying") if (
          missing) else x
    return tuple(cast(x) for x in xs)

  def chunk_ids(self, dev):
    """Global chunk indices of the chunks device ``dev`` holds."""
    if self.zigzag:
      return [dev, 2 * self.n - 1 - dev]
    return [dev]

  def relation(self, q_chunk, k_chunk):
    """0: skip (later keys), 1: causal diagonal, 2: fully visible."""
    if not self.causal:
      return jnp.int32(2)
    return jnp.where(k_chunk < q_chunk, 2, jnp.where(k_chunk == q_chunk, 1,
                                                     0)).astype(jnp.int32)


# The pair kernels under `jit`: a model traces ring attention once per
# layer, and every layer's pairs are the same few kernels (per relation
# and shape).  As jitted functions they are traced and lowered once per
# (params, shapes) and shared by all layers: lowering a 4-layer ring
# gradient for sm90 took 37 s on a 2-core CPU when each layer lowered its
# own kernels, against 7.5 s for one layer.
_local_forward = jax.jit(op_lib.local_forward, static_argnums=0)
_local_backward = jax.jit(op_lib.local_backward, static_argnums=0)


def _pair_forward(ring: _Ring, rel, q, k, v, q_seg, k_seg):
  """(out f32, lse) of one (query chunk, key chunk) pair by its relation."""
  t, s = q.shape[1], k.shape[1]
  arrays = MaskArrays(q_seg, k_seg) if q_seg is not None else MaskArrays()

  def run(causal):
    p = ring.params_for(MaskSpec(t, s, causal))
    out, lse = _local_forward(p, q, k, v, arrays)
    return out.astype(jnp.float32), lse

  def skip():
    return ring.vary(jnp.zeros(q.shape, jnp.float32),
                     jnp.full((q.shape[0], q.shape[2], t), -jnp.inf,
                              jnp.float32))

  return lax.switch(rel, [skip, lambda: run(True), lambda: run(False)])


def _pair_backward(ring: _Ring, rel, q, k, v, q_seg, k_seg, out, lse, dout,
                   dlse):
  t, s = q.shape[1], k.shape[1]
  arrays = MaskArrays(q_seg, k_seg) if q_seg is not None else MaskArrays()

  def run(causal):
    p = ring.params_for(MaskSpec(t, s, causal))
    dq, dk, dv = _local_backward(p, q, k, v, arrays, out, lse, dout,
                                       dlse)
    return (dq.astype(jnp.float32), dk.astype(jnp.float32),
            dv.astype(jnp.float32))

  def skip():
    return ring.vary(jnp.zeros(q.shape, jnp.float32),
                     jnp.zeros(k.shape, jnp.float32),
                     jnp.zeros(v.shape, jnp.float32))

  return lax.switch(rel, [skip, lambda: run(True), lambda: run(False)])


def _rotate(ring: _Ring, xs):
  """Sends each block to the next device of the ring."""
  perm = [(i, (i + 1) % ring.n) for i in range(ring.n)]
  return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), xs)


def _ring_forward(ring: _Ring, q, k, v, q_seg, kv_seg):
  dev = lax.axis_index(ring.axis_name)
  q_parts = _chunks(q, ring.parts)
  qs_parts = _chunks(q_seg, ring.parts) if q_seg is not None else None
  q_ids = ring.chunk_ids(dev)
  B, T, H, _ = q.shape
  outs = list(ring.vary(*(jnp.zeros(x.shape, jnp.float32)
                           for x in q_parts)))
  lses = list(ring.vary(*(jnp.full((B, H, x.shape[1]), -jnp.inf, jnp.float32)
                          for x in q_parts)))

  def step(i, carry):
    outs, lses, k, v, kv_seg = carry
    src = lax.rem(dev - i + ring.n, ring.n)  # owner of the visiting block
    k_ids = ring.chunk_ids(src)
    k_parts, v_parts = _chunks(k, ring.parts), _chunks(v, ring.parts)
    ks_parts = _chunks(kv_seg, ring.parts) if kv_seg is not None else None
    new_outs, new_lses = [], []
    for a in range(ring.parts):
      o, l_ = outs[a], lses[a]
      for b in range(ring.parts):
        po, pl_ = _pair_forward(
            ring, ring.relation(q_ids[a], k_ids[b]), q_parts[a], k_parts[b],
            v_parts[b], qs_parts[a] if qs_parts else None,
            ks_parts[b] if ks_parts else None)
        o, l_ = _merge(o, l_, po, pl_)
      new_outs.append(o)
      new_lses.append(l_)
    k, v, kv_seg = _rotate(ring, (k, v, kv_seg))
    return new_outs, new_lses, k, v, kv_seg

  outs, lses, *_ = lax.fori_loop(0, ring.n, step,
                                 (outs, lses, k, v, kv_seg))
  out = jnp.concatenate(outs, axis=1).astype(q.dtype)
  lse = jnp.concatenate(lses, axis=2)
  return out, lse


def _ring_backward(ring: _Ring, q, k, v, q_seg, kv_seg, out, lse, dout,
                   dlse):
  dev = lax.axis_index(ring.axis_name)
  split = lambda x: _chunks(x, ring.parts)
  q_parts, o_parts, do_parts = split(q), split(out), split(dout)
  l_parts = jnp.split(lse, ring.parts, axis=2) if ring.parts > 1 else [lse]
  dl_parts = (jnp.split(dlse, ring.parts, axis=2) if ring.parts > 1
              else [dlse])
  qs_parts = split(q_seg) if q_seg is not None else None
  q_ids = ring.chunk_ids(dev)
  dq = list(ring.vary(*(jnp.zeros(x.shape, jnp.float32) for x in q_parts)))
  dk, dv = ring.vary(jnp.zeros(k.shape, jnp.float32),
                     jnp.zeros(v.shape, jnp.float32))

  def step(i, carry):
    dq, k, v, kv_seg, dk, dv = carry
    src = lax.rem(dev - i + ring.n, ring.n)
    k_ids = ring.chunk_ids(src)
    k_parts, v_parts = split(k), split(v)
    ks_parts = split(kv_seg) if kv_seg is not None else None
    dk_parts, dv_parts = split(dk), split(dv)
    dq = list(dq)
    for a in range(ring.parts):
      for b in range(ring.parts):
        gq, gk, gv = _pair_backward(
            ring, ring.relation(q_ids[a], k_ids[b]), q_parts[a], k_parts[b],
            v_parts[b], qs_parts[a] if qs_parts else None,
            ks_parts[b] if ks_parts else None, o_parts[a], l_parts[a],
            do_parts[a], dl_parts[a])
        dq[a] = dq[a] + gq
        dk_parts[b] = dk_parts[b] + gk
        dv_parts[b] = dv_parts[b] + gv
    dk = jnp.concatenate(dk_parts, axis=1)
    dv = jnp.concatenate(dv_parts, axis=1)
    # The gradients travel with their key/value block.
    k, v, kv_seg, dk, dv = _rotate(ring, (k, v, kv_seg, dk, dv))
    return dq, k, v, kv_seg, dk, dv

  dq, _, _, _, dk, dv = lax.fori_loop(0, ring.n, step,
                                      (dq, k, v, kv_seg, dk, dv))
  # After n rotations every block (and its gradients) is home again.
  return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype),
          dv.astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring, q, k, v, q_seg, kv_seg):
  return _ring_forward(ring, q, k, v, q_seg, kv_seg)


def _ring_fwd(ring, q, k, v, q_seg, kv_seg):
  out, lse = _ring_forward(ring, q, k, v, q_seg, kv_seg)
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _ring_bwd(ring, res, cotangents):
  q, k, v, q_seg, kv_seg, out, lse = res
  dout, dlse = cotangents
  dq, dk, dv = _ring_backward(ring, q, k, v, q_seg, kv_seg, out, lse,
                              dout.astype(q.dtype), dlse.astype(jnp.float32))
  return dq, dk, dv, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, *, axis_name: str, causal: bool = False,
                   segment_ids=None, softmax_scale: float | None = None,
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
  picked = implementation is None
  if picked:
    implementation = kernel_backend(q, config=config, interpret=interpret)
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
  q_seg = kv_seg = None
  if segment_ids is not None:
    arrays = checks.mask_arrays(q, k, segment_ids, None, None)
    q_seg, kv_seg = arrays.q_segment_ids, arrays.kv_segment_ids

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
    backend.check_supported(q, k, v, arrays=MaskArrays(),
                            logits_soft_cap=None, config=config,
                            interpret=interpret)

  def params_for(spec):
    return backends.op_params(backend, mask=spec, softmax_scale=scale,
                              logits_soft_cap=None, config=config,
                              interpret=interpret,
                              deterministic=deterministic)

  ring = _Ring(axis_name, n, causal, zigzag, params_for,
               varying=frozenset().union(*map(_varying_axes, (q, k, v))))
  out, lse = _ring(ring, q, k, v, q_seg, kv_seg)
  return (out, lse) if return_lse else out
