"""How the attention op is partitioned across devices.

Under ``jit`` with sharded inputs, :mod:`jaxflash.op` asks XLA (through
``custom_partitioning``) to run the kernels per shard.  The rules here:

* batch sharding (data parallel, FSDP): every mesh axis on q's batch
  dimension shards batch of q, k, v, the mask arrays and the outputs;
* head sharding (tensor parallel): the mesh axes on q's head dimension
  shard the query heads and, consistently with the GQA groups, the
  key/value heads (``kv_heads`` divisible by the axis size; a single
  key/value head, MQA, is replicated);
* sequence (context parallelism) and head_dim sharding cannot be served
  by per-shard kernels: they raise ValueError naming the mesh axis rather
  than gathering silently.  Context parallelism has its own entry point,
  ring attention (docs/sharding.md).

No collective runs in the forward or the backward pass under these rules
(each device computes attention for its batch rows and heads), except for
MQA with sharded query heads, whose backward all-reduces dK/dV over the
head axes (the one key/value head serves every shard).

Logical axis names for q/k/v (``batch``, ``length``, ``heads``,
``kv_heads``, ``head_dim``) map to mesh axes through rules in the style of
Flax's ``nn.logical_axis_rules``: see :func:`logical_sharding`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Logical axes of q, k and v ([batch, length, heads, head_dim]).
Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
# Default rules: data/fsdp on batch, tensor on heads, context on length.
DEFAULT_RULES = (("batch", ("data", "fsdp")), ("length", "context"),
                 ("heads", "tensor"), ("kv_heads", "tensor"),
                 ("head_dim", None))


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _size(mesh, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def plan(mesh, q_spec, q_shape, k_shape):
  """``(batch_axes, head_axes, kv_head_axes)`` for q sharded as ``q_spec``.

  Raises ValueError, naming the mesh axis, for a sharding the per-shard
  kernels cannot serve.
  """
  spec = tuple(q_spec) + (None,) * (4 - len(tuple(q_spec)))
  batch, seq, heads, head_dim = (_axes(e) for e in spec)
  if seq:
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
  nb, nh = _size(mesh, batch), _size(mesh, heads)
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


def _plan_from_args(mesh, arg_shapes):
  q, k = arg_shapes[0], arg_shapes[1]
  s = q.sharding
  spec = s.spec if isinstance(s, NamedSharding) else P()
  return plan(mesh, spec, q.shape, k.shape)


def _mask_specs(present, b):
  """Specs of the present mask arrays: segment ids [B, L], lengths [B]."""
  kinds = (P(b, None), P(b, None), P(b), P(b))
  return [spec for spec, p in zip(kinds, present) if p]


def _forward_specs(present, b, h, kv):
  qs, kvs = P(b, None, h, None), P(b, None, kv, None)
  args = [qs, kvs, kvs, *_mask_specs(present, b)]
  results = (qs, P(b, h, None))
  return args, results


def _backward_specs(present, b, h, kv):
  qs, kvs, lse = P(b, None, h, None), P(b, None, kv, None), P(b, h, None)
  args = [qs, kvs, kvs, qs, lse, qs, lse, *_mask_specs(present, b)]
  results = (qs, kvs, kvs)
  return args, results


def _partition(specs_fn, local_fn, backward=False):
  def partition(p, present, mesh, arg_shapes, result_shape):
    del result_shape
    batch, heads, kv_heads = _plan_from_args(mesh, arg_shapes)
    b, h, kv = (_entry(a) for a in (batch, heads, kv_heads))
    args, results = specs_fn(present, b, h, kv)
    named = lambda spec: NamedSharding(mesh, spec)
    # MQA with sharded query heads: each shard's dK/dV sums only its own
    # query heads; the replicated key/value head needs the sum of all.
    reduce_kv = backward and heads and not kv_heads

    def lower(*operands):
      res = local_fn(p, present, *operands)
      if reduce_kv:
        dq, dk, dv = res
        res = (dq, jax.lax.psum(dk, heads), jax.lax.psum(dv, heads))
      return res

    return (mesh, lower, tuple(named(s) for s in results),
            tuple(named(s) for s in args))
  return partition


def forward_partition(local_fn):
  return _partition(_forward_specs, local_fn)


def backward_partition(local_fn):
  return _partition(_backward_specs, local_fn, backward=True)


def _infer(specs_fn):
  def infer(p, present, mesh, arg_shapes, result_shape):
    del p, result_shape
    b, h, kv = (_entry(a) for a in _plan_from_args(mesh, arg_shapes))
    _, results = specs_fn(present, b, h, kv)
    return tuple(NamedSharding(mesh, s) for s in results)
  return infer


forward_result_shardings = _infer(_forward_specs)
backward_result_shardings = _infer(_backward_specs)

_MASK_FACTORS = ("b t", "b s", "b", "b")


def forward_rule(p, present, mesh, value_types, result_types):
  """Shardy rule: batch ``b`` and heads ``h``/``k`` may be sharded; the
  partition callback decides (and refuses) the rest.

  Marking ``t``, ``d`` and ``s`` as need-replication factors does not, in
  jax 0.11.2, keep a constraint after the call from reaching q's sequence
  axis on an Auto mesh (the callback still sees q sharded there; tried
  in the thirty-first session), so the rule leaves them plain and
  docs/sharding.md gives the workaround."""
  del p, mesh, value_types, result_types
  masks = "".join(", " + f for f, on in zip(_MASK_FACTORS, present) if on)
  return f"b t h d, b s k d, b s k d{masks} -> b t h d, b h t"


def backward_rule(p, present, mesh, value_types, result_types):
  del p, mesh, value_types, result_types
  masks = "".join(", " + f for f, on in zip(_MASK_FACTORS, present) if on)
  return ("b t h d, b s k d, b s k d, b t h d, b h t, b t h d, b h t"
          f"{masks} -> b t h d, b s k d, b s k d")


# -- logical axis helpers -----------------------------------------------------

def logical_spec(logical_axes: Sequence[str | None],
                 rules=DEFAULT_RULES, mesh=None) -> P:
  """PartitionSpec of an array with these logical axes under ``rules``
  (a sequence of ``(logical, mesh axes)``, as ``nn.logical_axis_rules``).

  The rules apply as Flax's ``nn.logical_to_mesh_axes`` applies them, so
  that jaxflash.linen's parameters and these specs agree: in rule order,
  a rule gives its mesh axes to the first dimension of its logical name
  that has none yet, unless one of them is taken already (a later rule
  for the name may then apply); ``None`` replicates; a dimension no rule
  gives axes is replicated.  One extension: mesh axes absent from
  ``mesh`` (when given) are dropped from each rule first, and a rule left
  with none does not apply, so one rule set serves meshes with and
  without, say, a ``tensor`` axis.
  """
  names = set(mesh.axis_names) if mesh is not None else None
  dims = list(logical_axes)
  out: list = [None] * len(dims)
  assigned = [False] * len(dims)
  used: set[str] = set()
  for logical, entry in rules:
    if logical not in dims or assigned[dims.index(logical)]:
      continue
    pos = dims.index(logical)
    axes = _axes(entry)
    if entry is not None:
      axes = tuple(a for a in axes if names is None or a in names)
      if not axes:
        continue
    if used.intersection(axes):
      continue
    out[pos], assigned[pos] = _entry(axes), True
    used.update(axes)
  return P(*out)


def logical_sharding(mesh, logical_axes, rules=DEFAULT_RULES):
  """NamedSharding of an array with these logical axes on ``mesh``."""
  return NamedSharding(mesh, logical_spec(logical_axes, rules, mesh))


def shard_qkv(mesh, q, k, v, rules=DEFAULT_RULES):
  """Places q, k, v on ``mesh`` by the logical rules (a convenience).

  A single key/value head (MQA) is replicated over the axes that shard
  the query heads, as the op's rules replicate it.  A dimension that its
  mesh axes do not divide is a ValueError naming both.
  """
  q_spec = tuple(logical_spec(Q_AXES, rules, mesh))
  kv_spec = list(logical_spec(KV_AXES, rules, mesh))
  if k.shape[2] == 1:
    kv_spec[2] = None
  for name, x, spec, axes_names in (("q", q, q_spec, Q_AXES),
                                    ("k", k, kv_spec, KV_AXES),
                                    ("v", v, kv_spec, KV_AXES)):
    for dim, (entry, logical) in enumerate(zip(spec, axes_names)):
      n = _size(mesh, _axes(entry))
      if x.shape[dim] % n:
        raise ValueError(
            f"{name}'s {logical} dimension ({x.shape[dim]}) is not divisible"
            f" by mesh axis {_axes(entry)} of size {n} (shape"
            f" {tuple(x.shape)})")
  return (jax.device_put(q, NamedSharding(mesh, P(*q_spec))),
          jax.device_put(k, NamedSharding(mesh, P(*kv_spec))),
          jax.device_put(v, NamedSharding(mesh, P(*kv_spec))))


def ring_attention(*args, **kwargs):
  """Context parallelism: see :func:`jaxflash.ring.ring_attention`."""
  from jaxflash import ring  # noqa: PLC0415 - ring imports op, op imports us
  return ring.ring_attention(*args, **kwargs)


def zigzag_indices(seq_len: int, n: int):
  """See :func:`jaxflash.ring.zigzag_indices`."""
  from jaxflash import ring  # noqa: PLC0415
  return ring.zigzag_indices(seq_len, n)
