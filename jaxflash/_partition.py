"""How the attention op is partitioned across devices (the rules of
:mod:`jaxflash.op`'s ``custom_partitioning``).

Under ``jit`` with sharded inputs, :mod:`jaxflash.op` asks XLA (through
``custom_partitioning``) to run the kernels per shard.  The rules here:

* batch sharding (data parallel, FSDP): every mesh axis on q's batch
  dimension shards batch of q, k, v, the mask arrays and the outputs;
* head sharding (tensor parallel): the mesh axes on q's head dimension
  shard the query heads and, consistently with the GQA groups, the
  key/value heads (``kv_heads`` divisible by the axis size; a single
  key/value head, MQA, is replicated);
* sequence sharding (context parallelism): the ring or the all-gather
  of :mod:`jaxflash._context` on each shard's blocks
  (:func:`context_lower`, the scheme by :func:`check_context`), the
  dense terms' query rows sharded with q and their key axis whole;
* head_dim sharding cannot be served: ValueError naming the mesh axis
  rather than gathering silently.

Batch and head sharding run no collective in the forward or the backward
pass (each device computes attention for its batch rows and heads),
except for MQA with sharded query heads, whose backward all-reduces dK/dV
over the head axes (the one key/value head serves every shard), and a
bias broadcast over a sharded axis, whose gradient is summed over it.

The public helpers that place arrays by these rules are in
:mod:`jaxflash.sharding`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflash import _context, flashmask
from jaxflash.masks import MaskArrays

_DROPOUT_SEEDS = MaskArrays._fields.index("dropout_seeds")


def axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def axes_size(mesh, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def spec_entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec4(spec):
  return tuple(spec) + (None,) * (4 - len(tuple(spec)))


def seq_axes(q_spec) -> tuple[str, ...]:
  """The mesh axes q's sequence axis is sharded over."""
  return axes_of(_spec4(q_spec)[1])


def check_context(p, present, seq: tuple[str, ...], q_shape, k_shape,
                  n: int) -> str:
  """The context-parallel scheme for a call sharded over ``seq`` (``n``
  devices) on its sequence axis (:func:`jaxflash._context.choose`, or the
  call's ``context_parallel``); ValueError where it cannot serve the call.

  Both serve causal or no positional mask with segment ids,
  sequence lengths (the ring folds them into segment ids,
  :func:`jaxflash._context.fold_lengths`), local windows (the ring carries
  them as FlashMask columns, not beside a FlashMask), GQA/MQA, a soft cap,
  dropout, a dense bias (with its gradient) or mask, FlashMask (each
  block pair is given its global positions,
  :func:`jaxflash._context.pair_arrays`) and ALiBi (the pair's offset as
  the distance's shift).  The ring serves self-attention (equal query and
  key lengths, query ``i`` aligned with key ``i``); the all-gather also
  queries and keys of different lengths (cross-attention, a prefix
  before the queries) at any alignment, each device's query pieces
  placed at their global rows."""
  m = p.mask
  window = m.window_left is not None or m.window_right is not None
  alibi = present[MaskArrays._fields.index("alibi_slopes")]
  unaligned = q_shape[1] != k_shape[1] or m.offset != 0
  mode = _context.choose(p.context_parallel, q_shape[2], k_shape[2],
                         window or alibi or unaligned)
  served = {"q_segment_ids", "kv_segment_ids", "q_seq_lengths",
            "kv_seq_lengths", "dropout_seeds", "bias", "dense_mask",
            "flash_mask", "alibi_slopes"}
  unserved = [f for f, on in zip(MaskArrays._fields, present)
              if on and f not in served]
  if present[MaskArrays._fields.index("fp8_scales")]:
    unserved = [f for f in unserved if f != "fp8_scales"] + ["FP8 inputs"]
  if window and mode == "ring" and present[
      MaskArrays._fields.index("flash_mask")]:
    unserved.append("local_window_size with a FlashMask")
  if unaligned and mode == "ring":
    unserved.append(f"q_len={q_shape[1]}, kv_len={k_shape[1]} with query"
                    f" 0 aligned to key {m.offset} (the ring: self-attention"
                    " only; context_parallel='allgather' serves it)")
  if unserved:
    raise ValueError(
        f"q's sequence axis is sharded over mesh axis {seq}: context"
        f" parallelism ({mode}) serves causal or full attention with"
        " segment ids, lengths, windows, ALiBi, dropout, dense bias or"
        " mask and FlashMask (the ring self-attention only, a window only"
        " without a FlashMask), not"
        f" {', '.join(unserved)}. Replicate the sequence axis, or call"
        " jaxflash.sharding.ring_attention in shard_map (docs/sharding.md)")
  for name, length in (("q_len", q_shape[1]), ("kv_len", k_shape[1])):
    if length % n:
      raise ValueError(
          f"{name}={length} is not divisible by the {n} devices of mesh"
          f" axis {seq} that shard the sequence")
  return mode


def plan(mesh, q_spec, q_shape, k_shape, *, allow_seq: bool = False):
  """``(batch_axes, head_axes, kv_head_axes)`` for q sharded as ``q_spec``.

  Raises ValueError, naming the mesh axis, for a sharding the per-shard
  kernels cannot serve (a sharded sequence axis unless ``allow_seq``:
  the caller runs the ring, :func:`check_context`).
  """
  batch, seq, heads, head_dim = (axes_of(e) for e in _spec4(q_spec))
  if seq and not allow_seq:
    raise ValueError(
        f"q's sequence axis is sharded over mesh axis {seq}: per-shard"
        " kernels need whole sequences. Use jaxflash.sharding.ring_attention"
        " for context parallelism, or replicate the sequence axis (on an"
        " Auto mesh a constraint after the call can carry this sharding"
        " back onto q: constrain q before the call, docs/sharding.md)")
  if head_dim:
    raise ValueError(
        f"q's head_dim axis is sharded over mesh axis {head_dim}: attention"
        " needs whole heads; replicate head_dim")
  B, H, K = q_shape[0], q_shape[2], k_shape[2]
  nb, nh = axes_size(mesh, batch), axes_size(mesh, heads)
  if B % nb:
    raise ValueError(
        f"batch={B} is not divisible by mesh axis {batch} of size {nb}")
  if H % nh:
    raise ValueError(
        f"heads={H} is not divisible by mesh axis {heads} of size {nh}")
  if K % nh == 0:
    kv_heads = heads
  elif K == 1:
    kv_heads = ()  # MQA: every shard uses the one key/value head
  else:
    raise ValueError(
        f"kv_heads={K} is not divisible by mesh axis {heads} of size {nh}"
        " that shards the query heads: each shard would need part of a GQA"
        " group's key/value heads")
  return batch, heads, kv_heads


def _q_spec(arg_shapes):
  s = arg_shapes[0].sharding
  return s.spec if isinstance(s, NamedSharding) else P()


def _plan_from_args(mesh, arg_shapes, p=None, present=None):
  """``(batch, heads, kv_heads, seq)`` axes of a call; with ``p`` a
  sharded sequence axis is checked for the ring (:func:`check_context`),
  else refused."""
  q, k = arg_shapes[0], arg_shapes[1]
  spec = _q_spec(arg_shapes)
  seq = seq_axes(spec)
  mode = None
  if seq and p is not None:
    mode = check_context(p, present, seq, q.shape, k.shape,
                         axes_size(mesh, seq))
  return (*plan(mesh, spec, q.shape, k.shape, allow_seq=p is not None),
          seq, mode)


def mask_array_spec(field: str, shape, b, h, t=None):
  """Spec of the mask array ``field`` (a :class:`MaskArrays` field):
  segment ids ``[B, L]`` by batch and sequence (``t``), lengths ``[B]``
  and dropout seeds ``[B, 4]`` by batch, and a dense bias or mask ``[B|1,
  H|1, T|1, S]``, FlashMask columns ``[B|1, H|1, n, S]`` or ALiBi slopes
  ``[B|1, H, 1, 2]`` (and FP8's scales ``[1, H, 1, 2]``) by batch and
  heads where those axes are full (an axis of size 1 is replicated).
  Under context parallelism the dense terms' query rows are sharded with
  the queries; their keys and FlashMask's columns stay whole
  (:func:`context_lower`)."""
  if field in ("q_segment_ids", "kv_segment_ids"):
    return P(b, t)
  if len(shape) < 4:
    return P(b)
  rows = t if field in ("bias", "dense_mask") and shape[2] > 1 else None
  return P(b if shape[0] > 1 else None, h if shape[1] > 1 else None, rows,
           None)


def mask_fields(present) -> list[str]:
  """The :class:`MaskArrays` fields ``present`` flags, in order."""
  return [f for f, on in zip(MaskArrays._fields, present) if on]


def _forward_specs(fields, mask_shapes, b, h, kv, bias_at=None, t=None):
  del bias_at
  qs, kvs = P(b, t, h, None), P(b, t, kv, None)
  args = [qs, kvs, kvs, *(mask_array_spec(f, m, b, h, t)
                          for f, m in zip(fields, mask_shapes))]
  results = (qs, P(b, h, t))
  return args, results


def _backward_specs(fields, mask_shapes, b, h, kv, bias_at=None, t=None):
  qs, kvs, lse = P(b, t, h, None), P(b, t, kv, None), P(b, h, t)
  masks = [mask_array_spec(f, m, b, h, t)
           for f, m in zip(fields, mask_shapes)]
  args = [qs, kvs, kvs, qs, lse, qs, lse, *masks]
  results = (qs, kvs, kvs)
  if bias_at is not None:  # the dense bias's gradient, laid out like it
    results += (masks[bias_at],)
  return args, results


def shard_dropout_seeds(seeds, head_axes, local_heads: int):
  """``MaskArrays.dropout_seeds`` inside one shard of head-sharded
  attention: column 1 set to the shard's first head among all heads, so
  dropout's hash sees global head indices and the masks are those of the
  unsharded call."""
  return seeds.at[:, 1].set(jax.lax.axis_index(head_axes) * local_heads)


def _bias_at(present, bias_grad):
  """Index of the dense bias among the mask arrays when its gradient is
  computed, else None."""
  i = MaskArrays._fields.index("bias")
  return sum(present[:i]) if bias_grad else None


def _partition(specs_fn, local_fn, backward=False):
  def partition(p, present, *rest):
    bias_grad, (mesh, arg_shapes, result_shape) = (
        (rest[0], rest[1:]) if backward else (False, rest))
    del result_shape
    first = 7 if backward else 3
    mask_shapes = [a.shape for a in arg_shapes[first:]]
    bias_at = _bias_at(present, bias_grad)
    batch, heads, kv_heads, seq, mode = _plan_from_args(mesh, arg_shapes,
                                                        p, present)
    b, h, kv, t = (spec_entry(a) for a in (batch, heads, kv_heads, seq))
    args, results = specs_fn(mask_fields(present), mask_shapes, b, h, kv,
                             bias_at, t)
    named = lambda spec: NamedSharding(mesh, spec)
    # MQA with sharded query heads: each shard's dK/dV sums only its own
    # query heads; the replicated key/value head needs the sum of all.
    reduce_kv = backward and heads and not kv_heads
    # A bias broadcast over a sharded axis: each shard's gradient sums its
    # own rows or heads; the replicated bias needs the sum of all.
    bias_axes = ()
    if bias_at is not None:
      shape = mask_shapes[bias_at]
      bias_axes = ((batch if shape[0] == 1 else ())
                   + (heads if shape[1] == 1 else ())
                   + (seq if shape[2] == 1 else ()))

    def lower(*operands):
      if heads and p.dropout_rate and present[_DROPOUT_SEEDS]:
        at = first + sum(present[:_DROPOUT_SEEDS])
        operands = list(operands)
        operands[at] = shard_dropout_seeds(
            operands[at], heads,
            arg_shapes[0].shape[2] // axes_size(mesh, heads))
      if seq:
        res = context_lower(mode, seq, axes_size(mesh, seq), local_fn, p,
                            present, backward=backward, bias_grad=bias_grad,
                            operands=operands)
      else:
        res = (local_fn(p, present, bias_grad, *operands) if backward
               else local_fn(p, present, *operands))
      if reduce_kv:
        res = (res[0], jax.lax.psum(res[1], heads),
               jax.lax.psum(res[2], heads), *res[3:])
      if bias_axes:
        res = (*res[:3], jax.lax.psum(res[3], bias_axes))
      return res

    return (mesh, lower, tuple(named(s) for s in results),
            tuple(named(s) for s in args))
  return partition


def context_lower(mode: str, seq, n: int, local_fn, p, present, *,
                  backward: bool, bias_grad: bool, operands):
  """The ring or the all-gather (``mode``) on this shard's blocks of a
  sequence sharded over ``seq`` (contiguous blocks in natural order, which
  both balance through zig-zag order when causal).  The mask arrays come
  as :func:`mask_array_spec` lays them out: the dense terms' rows sharded
  with the queries, their keys and FlashMask's columns whole."""
  first = 7 if backward else 3
  flat = iter(operands[first:])
  terms = MaskArrays(*(next(flat) if on else None for on in present))

  def call(fn, params, *xs, arrays: MaskArrays, bias_grad=None):
    flags = tuple(x is not None for x in arrays)
    flat = tuple(x for x in arrays if x is not None)
    if bias_grad is None:
      return fn(params, flags, *xs, *flat)
    return fn(params, flags, bias_grad, *xs, *flat)

  fwd = lambda params, q, k, v, a: call(local_fn, params, q, k, v, arrays=a)
  bwd = lambda params, q, k, v, a, *res: call(
      local_fn, params, q, k, v, *res, arrays=a, bias_grad=bias_grad)
  axis = seq if len(seq) > 1 else seq[0]
  params_for = lambda spec: dataclasses.replace(p, mask=spec)
  # Causal: query blocks in zig-zag order (two half-block ppermutes each
  # way), so every device does the same work.
  balance = _context.balances(p.mask.causal, n, operands[0].shape[1])
  if mode == "allgather":
    ag = _context.AllGather(axis, n, params_for, p.mask, fwd, bwd,
                            balance=balance, bias_grad=bias_grad)
    if backward:
      return _cast_bias_grad(_context.allgather_backward(
          ag, *operands[:3], terms, *operands[3:7]), terms)
    return _context.allgather_forward(ag, *operands[:3], terms)
  # Lengths on the ring: folded into this block's segment ids at its
  # global positions, as the kernels fold them on one device.  A window:
  # as FlashMask columns over the global sequence, which each block pair
  # reads at its own rows and keys (its MaskSpec has no window: the
  # pair's offset is known only at run time).
  terms = _context.fold_lengths(terms, axis, operands[0].shape[1],
                                operands[1].shape[1])
  m = p.mask
  if m.window_left is not None or m.window_right is not None:
    terms = terms._replace(flash_mask=flashmask.window_columns(
        n * operands[1].shape[1], m.window_left, m.window_right))
  z = lambda x, ax=1: (_context.to_zigzag(x, axis, n, ax) if balance
                       else x)
  unz = lambda x, ax=1: (_context.from_zigzag(x, axis, n, ax) if balance
                         else x)
  ring = _context.Ring(axis, n, p.mask.causal, balance, params_for,
                       frozenset(), local_forward=fwd, local_backward=bwd,
                       bias_grad=bias_grad)
  q, k, v = (z(x) for x in operands[:3])
  terms = _context.zigzag_rows(terms, z)._replace(
      kv_segment_ids=z(terms.kv_segment_ids))
  if backward:
    out, lse, dout, dlse = operands[3:7]
    grads = _context.ring_backward(ring, q, k, v, terms, z(out), z(lse, 2),
                                   z(dout), z(dlse, 2))
    dq, dk, dv = (unz(g) for g in grads[:3])
    if not bias_grad:
      return dq, dk, dv
    db = grads[3]
    return _cast_bias_grad(
        (dq, dk, dv, db if db.shape[2] == 1 else unz(db, 2)), terms)
  out, lse = _context.ring_forward(ring, q, k, v, terms)
  return unz(out), unz(lse, 2)


def _cast_bias_grad(grads, terms: MaskArrays):
  """The bias's gradient (float32 from the schemes) in the bias's dtype."""
  if len(grads) == 3:
    return grads
  return (*grads[:3], grads[3].astype(terms.bias.dtype))


def forward_partition(local_fn):
  return _partition(_forward_specs, local_fn)


def backward_partition(local_fn):
  return _partition(_backward_specs, local_fn, backward=True)


def _infer(specs_fn, backward=False):
  def infer(p, present, *rest):
    bias_grad, (mesh, arg_shapes, result_shape) = (
        (rest[0], rest[1:]) if backward else (False, rest))
    del result_shape
    first = 7 if backward else 3
    mask_shapes = [a.shape for a in arg_shapes[first:]]
    b, h, kv, t = (spec_entry(a) for a in _plan_from_args(
        mesh, arg_shapes, p, present)[:4])
    _, results = specs_fn(mask_fields(present), mask_shapes, b, h, kv,
                          _bias_at(present, bias_grad), t)
    return tuple(NamedSharding(mesh, s) for s in results)
  return infer


forward_result_shardings = _infer(_forward_specs)
backward_result_shardings = _infer(_backward_specs, backward=True)


# Per MaskArrays field, in its order (FP8's scales [1, H, 1, 2] as ALiBi's
# slopes).
_MASK_FACTORS = ("b t", "b s", "b", "b", "b c", "dense", "dense",
                 "columns", "slopes", "slopes")


def _mask_factors(present, types) -> list[str]:
  """Shardy factors of the present mask arrays: batch ``b``, heads ``h``,
  the sequences; a broadcast (size-1) axis of a dense array gets a factor
  of its own."""
  kinds = [f for f, on in zip(_MASK_FACTORS, present) if on]
  out = []
  for n, (kind, x) in enumerate(zip(kinds, types)):
    if kind in ("dense", "columns", "slopes"):  # [B|1, H|1, T|1|4, S|2]
      shape = x.shape
      kind = " ".join([
          "b" if shape[0] > 1 else f"x{n}b", "h" if shape[1] > 1 else
          f"x{n}h", "t" if kind == "dense" and shape[2] > 1 else f"x{n}t",
          f"x{n}s" if kind == "slopes" else "s"])
    out.append(kind)
  return out


def forward_rule(p, present, mesh, value_types, result_types):
  """Shardy rule: batch ``b`` and heads ``h``/``k`` may be sharded; the
  partition callback decides (and refuses) the rest.

  Marking ``t``, ``d`` and ``s`` as need-replication factors does not, in
  jax 0.11.2, keep a constraint after the call from reaching q's sequence
  axis on an Auto mesh (the callback still sees q sharded there, as
  tried), so the rule leaves them plain and
  docs/sharding.md gives the workaround."""
  del p, mesh, result_types
  masks = "".join(", " + f for f in _mask_factors(present, value_types[3:]))
  return f"b t h d, b s k d, b s k d{masks} -> b t h d, b h t"


def backward_rule(p, present, bias_grad, mesh, value_types, result_types):
  del p, mesh, result_types
  factors = _mask_factors(present, value_types[7:])
  masks = "".join(", " + f for f in factors)
  dbias = ""
  if bias_grad:
    dbias = ", " + factors[_bias_at(present, True)]
  return ("b t h d, b s k d, b s k d, b t h d, b h t, b t h d, b h t"
          f"{masks} -> b t h d, b s k d, b s k d{dbias}")
