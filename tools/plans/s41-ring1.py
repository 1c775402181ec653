"""s41: ring_attention on one GPU after its backend check moved (2cfc24b).

Each kernel backend (None = kernel_backend's pick, mosaic_gpu, triton) over
a one-device ring, causal zig-zag: forward against the XLA reference and a
finite gradient.  One device only: the multi-GPU ring is
tests/test_multigpu.py's.
"""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxflash
from jaxflash import sharding

mesh = jax.make_mesh((1,), ("context",), axis_types=(AxisType.Auto,))
q = jax.random.normal(jax.random.key(0), (1, 1024, 4, 128), jnp.bfloat16)
ref = jaxflash.flash_attention(q, q, q, causal=True, implementation="xla")
for impl in (None, "mosaic_gpu", "triton"):
  f = jax.shard_map(
      functools.partial(sharding.ring_attention, axis_name="context",
                        causal=True, implementation=impl),
      mesh=mesh, in_specs=(P(None, "context"),) * 3,
      out_specs=P(None, "context"), check_vma=False)
  out = jax.jit(f)(q, q, q)
  err = jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))
  g = jax.jit(jax.grad(lambda x, f=f: f(x, x, x).astype(jnp.float32).sum(
  )))(q)
  print(f"{impl}: max |out - xla| {float(err):.4f}, grad finite"
        f" {bool(jnp.isfinite(g.astype(jnp.float32)).all())}", flush=True)
