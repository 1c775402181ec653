"""Kernel-time breakdown of the Hopper path: each kernel launch of one
attention call timed apart, written to ``<out>/kernel_times.json``.

    PYTHONPATH=. python3 tools/kernel_times.py --head-dim 256 --seq 8192 \
        --causal 1 [--overrides "bwd_stages=3"] [--out DIR]

The benchmark times whole calls (forward, or forward+backward); this
times each kernel launch of the Hopper path alone at one shape of the
benchmark grid (16,384 tokens per call, width 2048): the forward, then
the backward's passes in launch order (``dq`` and ``dkv``; one
``dkv+atomic-dq`` with ``bwd_atomic_dq``; see
``jaxflash.mosaic_gpu.backend.backward_passes``), each on the padded
operands the backward gives it.  ``backward prep`` is the backward's XLA
preparation alone (padding, ``delta``, the base-2 LSE); with the
padded-output slicing it is what the whole backward adds to its
kernels.  FLOP/s use the benchmark's convention per pass: ``S`` and
``P V``-sized matmuls, 2 per forward tile pair, counted per kernel from
the matmuls it runs (forward 2, dQ kernel 3, dK/dV 4, dK/dV with atomic
dQ 5).

``--variants "NAME:field=value,...;..."`` adds configs (each the base
config with those fields replaced, as the benchmark's
``--mosaic-variants``); every kernel of every config is then timed in
the same interleaved rounds (``jaxflash.bench.core.time_interleaved``).
Separate calls of this tool on the H200 disagreed by up to 8% for one
config's dK/dV kernel (docs/benchmarks/h200-2026-12-02-0f44e53-stats-in-acc.md),
so compare kernels of different configs within one call.

``--interpret`` runs a tiny shape in the Mosaic GPU interpreter (a smoke
test of the tool, not a figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

# Matmuls of one (query tile, key tile) pair, each 2 * rows * cols * D
# FLOPs, by kernel.
MATMULS = {"forward": 2, "dq": 3, "dkv": 4, "dkv+atomic-dq": 5,
           "dkv-paired": 4, "dq-paired": 3}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--causal", type=int, default=0)
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--width", type=int, default=2048)
  ap.add_argument("--overrides", default="",
                  help="MosaicConfig fields over the tuned default,"
                       " 'field=value,...' (0/1 for booleans)")
  ap.add_argument("--variants", default="",
                  help="more configs, 'NAME:field=value,...;...', timed"
                       " in the same interleaved rounds")
  ap.add_argument("--samples", type=int, default=7)
  ap.add_argument("--interpret", action="store_true",
                  help="tiny shape in the Mosaic GPU interpreter")
  ap.add_argument("--out", default=None, help="write kernel_times.json here")
  args = ap.parse_args(argv)
  if args.interpret:
    os.environ.setdefault("XLA_FLAGS",
                          "--xla_force_host_platform_device_count=8")

  import jax
  import jax.numpy as jnp

  from jaxflash import mosaic_gpu
  from jaxflash._util import round_up
  from jaxflash.bench import core
  from jaxflash.masks import MaskArrays, MaskSpec
  from jaxflash.mosaic_gpu import backend
  from jaxflash.mosaic_gpu.config import parse_overrides, parse_variants

  d, s, causal = args.head_dim, args.seq, bool(args.causal)
  batch = max(1, args.tokens // s)
  heads = max(1, args.width // d)
  if args.interpret:
    batch, heads, s = 1, 2, 256
    base = mosaic_gpu.INTERPRET_CONFIG
  else:
    base = mosaic_gpu.default_config(jax.devices()[0].device_kind,
                                     round_up(d, 64), causal=causal,
                                     kv_len=s)
  cfg = dataclasses.replace(base, **parse_overrides(args.overrides))
  configs = {"default": cfg}
  for name, overrides in parse_variants(args.variants).items():
    if name in configs:
      raise ValueError(f"variant {name!r}: the base config's name")
    configs[name] = dataclasses.replace(cfg, **overrides)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (batch, s, heads, d), jnp.bfloat16)
                 for key in keys)
  mask = MaskSpec(s, s, causal, None, None, None)
  scale = d ** -0.5
  interpret = bool(args.interpret)
  params = backend._interpret_params(interpret)  # noqa: SLF001

  def kernel_calls(cfg):
    """``name -> (jitted fn, args)``: the forward, the whole backward, its
    XLA preparation, then each backward pass on the prepared operands."""
    kw = dict(mask=mask, softmax_scale=scale, config=cfg,
              interpret=interpret)
    fwd = jax.jit(lambda q, k, v: backend.forward(q, k, v, MaskArrays(),
                                                  **kw))
    out, lse = fwd(q, k, v)
    # The backward's own preparation (what backend.backward does before
    # its kernels), then each pass on those operands.
    prob = backend.backward_problem(q, k, mask, scale, cfg,
                                    interpret=bool(interpret))
    full = jax.jit(lambda q, k, v, out, lse, do: backend.backward(
        q, k, v, MaskArrays(), out, lse, do, jnp.zeros_like(lse), **kw))
    prep = jax.jit(lambda q, k, v, out, lse, do: backend.backward_operands(
        q, k, v, out, lse, do, jnp.zeros_like(lse), prob, cfg, interpret))
    tensors = prep(q, k, v, out, lse, do)
    calls = {"forward": (fwd, (q, k, v)),
             "backward (whole)": (full, (q, k, v, out, lse, do)),
             "backward prep": (prep, (q, k, v, out, lse, do))}
    for name, run in backend.backward_passes(
        prob, cfg, None, None, params,
        head_splits=backend.head_splits(prob, cfg)):
      calls[name] = (jax.jit(run), tensors)
    return calls

  calls = {(vname, name): call for vname, vcfg in configs.items()
           for name, call in kernel_calls(vcfg).items()}
  times = core.time_interleaved(calls, samples=args.samples)
  pair_flops = 2 * s * s * d * batch * heads * (0.5 if causal else 1.0)
  rows = []
  for (vname, name), t in times.items():
    if isinstance(t, Exception):
      raise t
    mm = MATMULS.get(name)
    tflops = None if mm is None else mm * pair_flops / t / 1e12
    rows.append(dict(variant=vname, kernel=name, ms=t * 1e3, tflops=tflops))
    label = name if len(configs) == 1 else f"[{vname}] {name}"
    print(f"{label:18s} {t * 1e3:9.3f} ms"
          + ("" if tflops is None else f" {tflops:7.1f} TFLOP/s"))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    meta = dict(head_dim=d, seq=s, causal=causal, batch=batch, heads=heads,
                config=repr(cfg), commit=core.commit(),
                variants={n: repr(c) for n, c in configs.items()},
                device=jax.devices()[0].device_kind, interpret=interpret)
    with open(os.path.join(args.out, "kernel_times.json"), "w") as f:
      json.dump(dict(meta, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
