"""The attention op built from a pair of kernels: differentiable, batchable
and partitionable.

It is handed a :class:`Kernels` record (a forward and a backward function
on local arrays; the backend registry, :mod:`jaxflash.backends`, builds
them) and knows nothing of which backend they come from.

Layers, outside in:

1. ``jax.custom_vjp``: the forward saves ``(q, k, v, out, lse)`` (output and
   LSE named :data:`RESIDUAL_NAMES` for remat policies); the backward runs
   the backward kernels from them.  A dense bias is the one differentiable
   mask array; its gradient is computed only when the bias is
   differentiated (symbolic zeros tell the forward).
2. ``jax.custom_batching.custom_vmap``: ``vmap`` folds the mapped axis into
   the batch axis (attention is independent per batch row), so the kernels
   and the partitioning below never see a batching transform.
3. ``custom_partitioning`` (rules in :mod:`jaxflash._partition`): under
   ``jit`` with sharded inputs, XLA runs the kernels per shard — batch and
   heads split, no gathers — instead of gathering the operands of an opaque
   call.  On one device, or inside ``shard_map``, it is inlined.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning

from jaxflash import _partition as partition
from jaxflash.masks import MaskArrays, MaskSpec

# Names of the residuals the forward saves besides q, k, v, e.g.
# jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(
#     *RESIDUAL_NAMES)) keeps the attention output and LSE, so the backward
# pass recomputes nothing of the attention.
RESIDUAL_NAMES = ("jaxflash_out", "jaxflash_lse")


@dataclasses.dataclass(frozen=True)
class Kernels:
  """A backend's kernels on local arrays, as the op calls them.

  ``forward(q, k, v, arrays, *, mask, softmax_scale, logits_soft_cap,
  config, interpret)`` returns ``(out, lse)``; ``backward(q, k, v, arrays,
  out, lse, dout, dlse, *, ..., deterministic)`` returns ``(dq, dk, dv)``.
  ``inline_interpreted``: the kernels' interpreter runs on ordered IO
  callbacks, an effect that ``custom_partitioning`` and ``custom_vmap``
  cannot carry, so interpreted calls skip those two layers (the Mosaic GPU
  interpreter; such calls are for testing, on one host).
  """

  name: str
  forward: Callable = dataclasses.field(repr=False)
  backward: Callable = dataclasses.field(repr=False)
  inline_interpreted: bool = False


@dataclasses.dataclass(frozen=True)
class OpParams:
  """Static arguments of one attention op."""

  kernels: Kernels
  mask: MaskSpec
  softmax_scale: float
  logits_soft_cap: float | None
  config: Any
  interpret: Any
  # Bitwise-reproducible gradients: kernels whose fastest backward sums
  # with atomics (Mosaic GPU's bwd_atomic_dq) use their fixed-order form.
  deterministic: bool = False
  # Attention dropout (the seeds ride in MaskArrays.dropout_seeds); with
  # dropout_shared one mask serves every head (Flax's broadcast_dropout).
  dropout_rate: float = 0.0
  dropout_shared: bool = False
  # Context parallelism for a sequence-sharded call: "ring", "allgather",
  # or None for the cost rule (jaxflash._context.choose).
  context_parallel: str | None = None


def _kwargs(p: OpParams) -> dict:
  kw = dict(mask=p.mask, softmax_scale=p.softmax_scale,
            logits_soft_cap=p.logits_soft_cap, config=p.config,
            interpret=p.interpret)
  if p.dropout_rate:  # only kernels that take dropout see it
    kw.update(dropout_rate=p.dropout_rate, dropout_shared=p.dropout_shared)
  return kw


def _bwd_kwargs(p: OpParams, bias_grad: bool = False) -> dict:
  kw = dict(_kwargs(p), deterministic=p.deterministic)
  if bias_grad:  # only kernels that take a bias see it
    kw.update(bias_grad=True)
  return kw


_BIAS = MaskArrays._fields.index("bias")
_DENSE_MASK = MaskArrays._fields.index("dense_mask")
_FLASH_MASK = MaskArrays._fields.index("flash_mask")
_ALIBI = MaskArrays._fields.index("alibi_slopes")
_FP8_SCALES = MaskArrays._fields.index("fp8_scales")
_DROPOUT_SEEDS = MaskArrays._fields.index("dropout_seeds")


def _flat_index(present, field: int) -> int | None:
  """Position of MaskArrays field ``field`` in the packed tuple."""
  return sum(present[:field]) if present[field] else None


def _pack(arrays: MaskArrays):
  """Present mask arrays as a flat tuple, and which fields they were."""
  present = tuple(x is not None for x in arrays)
  return tuple(x for x in arrays if x is not None), present


def _unpack(flat, present) -> MaskArrays:
  it = iter(flat)
  return MaskArrays(*(next(it) if p else None for p in present))


# -- per-shard computations ---------------------------------------------------

def _local_forward(p: OpParams, present, q, k, v, *flat):
  return p.kernels.forward(q, k, v, _unpack(flat, present), **_kwargs(p))


def _local_backward(p: OpParams, present, bias_grad, q, k, v, out, lse,
                    dout, dlse, *flat):
  return p.kernels.backward(q, k, v, _unpack(flat, present), out, lse, dout,
                            dlse, **_bwd_kwargs(p, bias_grad))


def local_forward(p: OpParams, q, k, v, arrays: MaskArrays):
  """The forward kernel on local arrays (no autodiff, no
  partitioning): for algorithms that compose kernels, like ring attention."""
  return p.kernels.forward(q, k, v, arrays, **_kwargs(p))


def local_backward(p: OpParams, q, k, v, arrays: MaskArrays, out, lse, dout,
                   dlse):
  """The backward kernels from given residuals (local arrays)."""
  return p.kernels.backward(q, k, v, arrays, out, lse, dout, dlse,
                            **_bwd_kwargs(p))


_forward_cp = custom_partitioning(_local_forward, static_argnums=(0, 1))
_forward_cp.def_partition(
    partition=partition.forward_partition(_local_forward),
    infer_sharding_from_operands=partition.forward_result_shardings,
    sharding_rule=partition.forward_rule)

_backward_cp = custom_partitioning(_local_backward,
                                   static_argnums=(0, 1, 2))
_backward_cp.def_partition(
    partition=partition.backward_partition(_local_backward),
    infer_sharding_from_operands=partition.backward_result_shardings,
    sharding_rule=partition.backward_rule)


# -- vmap: fold the mapped axis into the batch axis ---------------------------

def _fold(axis_size, batched, args, dense=()):
  """Moves each arg's vmapped axis (0) into its batch axis (0), broadcasting
  unbatched args.  ``dense``: positions of dense arrays, whose batch axis
  may be 1 (broadcast): left as they are when unbatched with batch 1, else
  broadcast to the batch rows of one vmapped slice (those of ``args[0]``,
  q) first."""
  q, q_batched = args[0], batched[0]
  batch = q.shape[1] if q_batched else q.shape[0]
  out = []
  for i, (x, b) in enumerate(zip(args, batched)):
    if i in dense:
      if not b and x.shape[0] == 1:
        out.append(x)
        continue
      if b:
        x = jnp.broadcast_to(x, (axis_size, batch, *x.shape[2:]))
    if not b:
      x = jnp.broadcast_to(x, (axis_size, *x.shape))
    out.append(x.reshape((axis_size * x.shape[1], *x.shape[2:])))
  return out


def _unfold(axis_size, results):
  return [r.reshape((axis_size, r.shape[0] // axis_size, *r.shape[1:]))
          for r in results]


def _direct(p: OpParams) -> bool:
  """Interpreted calls of kernels whose interpreter has effects skip the
  vmap and partitioning layers (:attr:`Kernels.inline_interpreted`)."""
  return p.kernels.inline_interpreted and bool(p.interpret)


def _dense_positions(present, first: int) -> tuple[int, ...]:
  """Argument positions of the dense arrays and FP8's scales (batch axis
  1 where shared by the rows), mask arrays starting at ``first``."""
  return tuple(first + i for i in (_flat_index(present, _BIAS),
                                   _flat_index(present, _DENSE_MASK),
                                   _flat_index(present, _FLASH_MASK),
                                   _flat_index(present, _ALIBI),
                                   _flat_index(present, _FP8_SCALES))
               if i is not None)


@functools.cache
def _forward_op(p: OpParams, present):
  if _direct(p):
    return lambda q, k, v, *flat: tuple(
        _local_forward(p, present, q, k, v, *flat))

  @custom_vmap
  def fwd(q, k, v, *flat):
    return tuple(_forward_cp(p, present, q, k, v, *flat))

  @fwd.def_vmap
  def _rule(axis_size, in_batched, *args):
    res = fwd(*_fold(axis_size, in_batched, args,
                     _dense_positions(present, 3)))
    return tuple(_unfold(axis_size, res)), (True, True)

  return fwd


@functools.cache
def _backward_op(p: OpParams, present, bias_grad: bool):
  if _direct(p):
    return lambda *args: tuple(_local_backward(p, present, bias_grad,
                                               *args))

  @custom_vmap
  def bwd(*args):
    return tuple(_backward_cp(p, present, bias_grad, *args))

  @bwd.def_vmap
  def _rule(axis_size, in_batched, *args):
    in_batched = list(in_batched)
    if bias_grad:
      # The bias's gradient is per mapped slice even for a bias the slices
      # share, so the bias is mapped here (broadcast over the slices).
      i = 7 + _flat_index(present, _BIAS)
      rows = args[i].shape[1] if in_batched[i] else args[i].shape[0]
      if not in_batched[i]:
        args = (*args[:i], jnp.broadcast_to(args[i], (axis_size,
                                                      *args[i].shape)),
                *args[i + 1:])
        in_batched[i] = True
    res = bwd(*_fold(axis_size, in_batched, args,
                     _dense_positions(present, 7)))
    if not bias_grad:
      return tuple(_unfold(axis_size, res)), (True, True, True)
    *grads, dbias = res
    dbias = dbias.reshape((axis_size, -1, *dbias.shape[1:]))
    if rows == 1:  # the slice's bias is broadcast over its batch rows
      dbias = dbias.sum(1, keepdims=True)
    return (*_unfold(axis_size, grads), dbias), (True,) * 4

  return bwd


# -- autodiff -----------------------------------------------------------------

def _run_forward(p, present, context, q, k, v, *flat):
  """The forward op, or with ``context = (mode, seq_axes, n)`` (inside
  shard_map over an Explicit mesh) context parallelism on this shard's
  blocks."""
  if context is None:
    return _forward_op(p, present)(q, k, v, *flat)
  return partition.context_lower(*context, _local_forward, p, present,
                                 backward=False, bias_grad=False,
                                 operands=(q, k, v, *flat))


def _run_backward(p, present, context, bias_grad, *args):
  if context is None:
    return _backward_op(p, present, bias_grad)(*args)
  return partition.context_lower(*context, _local_backward, p, present,
                                 backward=True, bias_grad=bias_grad,
                                 operands=args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, flat, p: OpParams, present, context=None):
  return _run_forward(p, present, context, q, k, v, *flat)


def _attention_fwd(q, k, v, flat, p, present, context=None):
  # Symbolic zeros: the arguments come as (value, perturbed) records.
  bias_at = _flat_index(present, _BIAS)
  bias_grad = bias_at is not None and bool(flat[bias_at].perturbed)
  q, k, v = (x.value for x in (q, k, v))
  flat = tuple(x.value for x in flat)
  out, lse = _run_forward(p, present, context, q, k, v, *flat)
  out = checkpoint_name(out, RESIDUAL_NAMES[0])
  lse = checkpoint_name(lse, RESIDUAL_NAMES[1])
  # The residuals' structure carries the static bias_grad: () or None.
  return (out, lse), (q, k, v, flat, out, lse, () if bias_grad else None)


def _dense_ct(ct, like):
  """A cotangent, with a symbolic zero made a real one."""
  if isinstance(ct, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros(like.shape, like.dtype)
  return ct.astype(like.dtype)


def _attention_bwd(p, present, context, res, cotangents):
  q, k, v, flat, out, lse, bias_flag = res
  bias_grad = bias_flag is not None
  dout, dlse = cotangents
  grads = _run_backward(
      p, present, context, bias_grad,
      q, k, v, out, lse, _dense_ct(dout, out),
      _dense_ct(dlse, lse).astype(jnp.float32), *flat)
  dflat = [None] * len(flat)  # integer inputs; the mask is not
  if bias_grad:               # differentiable
    dflat[_flat_index(present, _BIAS)] = grads[3]
  return (*grads[:3], tuple(dflat))


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _explicit_mesh(x):
  """The mesh of ``x``'s type when it has Explicit axes, else None."""
  mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  if mesh is None or mesh.empty:
    return None
  explicit = jax.sharding.AxisType.Explicit
  return mesh if any(t == explicit for t in mesh.axis_types) else None


def attention(q, k, v, arrays: MaskArrays, params: OpParams):
  """``(out [B, T, H, D], lse [B, H, T])`` of ``params.kernels``:
  differentiable, batchable and partitioned under ``jit``."""
  flat, present = _pack(arrays)
  mesh = _explicit_mesh(q)
  if mesh is None:
    return _attention(q, k, v, flat, params, present)
  # Explicit-sharding mesh: the shardings are part of the types and known
  # while tracing.  Check them with the same rules and run the op per shard
  # under shard_map (Pallas kernels cannot trace over explicitly sharded
  # types; inside shard_map the partitioning layer is inlined).
  spec = jax.typeof(q).sharding.spec
  seq = partition.seq_axes(spec)
  mode = (partition.check_context(params, present, seq, q.shape, k.shape,
                                  partition.axes_size(mesh, seq))
          if seq else None)
  b, h, kv = (partition.spec_entry(a) for a in partition.plan(
      mesh, spec, q.shape, k.shape, allow_seq=True))
  t = partition.spec_entry(seq)
  P = jax.sharding.PartitionSpec
  q_spec, kv_spec = P(b, t, h, None), P(b, t, kv, None)
  mask_specs = tuple(partition.mask_array_spec(f, x.shape, b, h, t)
                     for f, x in zip(partition.mask_fields(present), flat))
  # k, v and the mask arrays follow q's layout, whatever theirs (a
  # replicated k, host segment ids): shard_map takes only matching types.
  to = lambda xs, specs: tuple(
      jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, s))
      for x, s in zip(xs, specs))
  k, v = to((k, v), (kv_spec, kv_spec))
  flat = to(flat, mask_specs)
  def per_shard(q, k, v, flat):
    if h is not None and params.dropout_rate and present[_DROPOUT_SEEDS]:
      i = _flat_index(present, _DROPOUT_SEEDS)
      flat = (*flat[:i], partition.shard_dropout_seeds(
          flat[i], partition.axes_of(h), q.shape[2]), *flat[i + 1:])
    # Context parallelism over the sequence's axes: the ring or the
    # all-gather on this shard's blocks, as the Auto path lowers it.
    context = (mode, seq, partition.axes_size(mesh, seq)) if seq else None
    return _attention(q, k, v, flat, params, present, context)

  return jax.shard_map(
      per_shard,
      mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, mask_specs),
      out_specs=(q_spec, P(b, h, t)),
      # Unchecked: the transpose then sums the cotangent of an input that
      # is replicated over an axis (MQA k/v over sharded heads).
      check_vma=False)(q, k, v, flat)
