"""Placing q, k and v on a mesh, and context parallelism.

Under ``jit`` the attention op partitions itself: batch- and head-sharded
inputs run the kernels per shard with no gathers (the rules are in
:mod:`jaxflash._partition`; docs/sharding.md).  This module holds the
helpers around it:

* logical axis names for q/k/v (``batch``, ``length``, ``heads``,
  ``kv_heads``, ``head_dim``) mapped to mesh axes through rules in the
  style of Flax's ``nn.logical_axis_rules``: :func:`logical_spec`,
  :func:`logical_sharding`, :func:`shard_qkv`;
* context parallelism for a sequence split over a mesh axis:
  :func:`ring_attention` and :func:`zigzag_indices` (from
  :mod:`jaxflash.ring`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflash._partition import axes_of, axes_size, spec_entry
from jaxflash.ring import ring_attention as ring_attention
from jaxflash.ring import zigzag_indices as zigzag_indices

# Logical axes of q, k and v ([batch, length, heads, head_dim]).
Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
# Default rules: data/fsdp on batch, tensor on heads, context on length.
DEFAULT_RULES = (("batch", ("data", "fsdp")), ("length", "context"),
                 ("heads", "tensor"), ("kv_heads", "tensor"),
                 ("head_dim", None))


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
    axes = axes_of(entry)
    if entry is not None:
      axes = tuple(a for a in axes if names is None or a in names)
      if not axes:
        continue
    if used.intersection(axes):
      continue
    out[pos], assigned[pos] = spec_entry(axes), True
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
      n = axes_size(mesh, axes_of(entry))
      if x.shape[dim] % n:
        raise ValueError(
            f"{name}'s {logical} dimension ({x.shape[dim]}) is not divisible"
            f" by mesh axis {axes_of(entry)} of size {n} (shape"
            f" {tuple(x.shape)})")
  return (jax.device_put(q, NamedSharding(mesh, P(*q_spec))),
          jax.device_put(k, NamedSharding(mesh, P(*kv_spec))),
          jax.device_put(v, NamedSharding(mesh, P(*kv_spec))))
