"""Tile sweep of the Triton-lowering kernels: the data behind
``TritonConfig``'s defaults (``jaxflash/triton/config.py``).

On an NVIDIA GPU this times six forward and six backward tile configs
(``block_q`` x ``block_k`` x warps x stages) at the benchmark grid's
shapes (bf16, 16,384 tokens per call, width 2048, causal and not),
with cuDNN's forward and gradient as the reference, and writes every row
to ``<out>/sweep.json`` (a config that fails is a row with the error);
the table prints last. The record of the run that chose the current
defaults is docs/benchmarks/h200-2026-11-30-a2f93e3-triton-tiles.md.

    PYTHONPATH=. python3 tools/triton_sweep.py [--quick] [--out DIR]
    PYTHONPATH=. python3 tools/triton_sweep.py --smoke   # CPU, interpret

``--smoke`` runs one tiny shape with two small configs in interpret mode
on any machine: a test of this script, not a figure.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.bench import core


def timeit(fn, *args, smoke=False):
  """Median seconds per call (one short sample in a smoke run)."""
  if smoke:
    return core.time_fn(fn, *args, min_sample_s=0.0, samples=1)
  return core.time_fn(fn, *args, samples=5)


def flops(b, h, s, d, causal, mode):
  return core.flops(core.Shape(b, s, s, h, h, d, causal), mode)


FWD_CFGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
            (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)]
BWD_CFGS = [(32, 128, 128, 32, 8, 2), (64, 64, 64, 64, 4, 2),
            (32, 64, 64, 32, 4, 2), (64, 128, 128, 64, 8, 2),
            (32, 64, 64, 32, 4, 1), (16, 64, 64, 16, 4, 1)]
# --smoke: one tiny shape, small tiles, interpret mode (CPU).
SMOKE_FWD_CFGS = [(16, 16, 4, 1), (32, 16, 4, 1)]
SMOKE_BWD_CFGS = [(16, 16, 16, 16, 4, 1)]


def main(argv=None):
  ap = argparse.ArgumentParser(prog="tools/triton_sweep.py",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--quick", action="store_true",
                  help="three shapes (head_dim 64/128/256 at seq 4096)")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny CPU run in interpret mode: not a figure")
  args = ap.parse_args(argv)
  rows = []
  fwd_cfgs, bwd_cfgs = FWD_CFGS, BWD_CFGS
  tokens, width, interpret = 16384, 2048, False
  if args.smoke:
    shapes = [(32, 64)]
    fwd_cfgs, bwd_cfgs = SMOKE_FWD_CFGS, SMOKE_BWD_CFGS
    tokens, width, interpret = 64, 64, True
  elif args.quick:
    shapes = [(64, 4096), (128, 4096), (256, 4096)]
  else:
    shapes = [(64, 1024), (64, 4096), (128, 1024), (128, 4096),
              (128, 16384), (256, 4096)]
  key = jax.random.key(0)
  for d, s in shapes:
    b, h = tokens // s, width // d
    for causal in (False, True):
      q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16)
                 for kk in jax.random.split(key, 3))
      # (default arguments bind this iteration's values: the functions
      # are traced inside it, but ruff's B023 cannot know that)
      cudnn = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
          q, k, v, is_causal=c, implementation="cudnn"))
      try:
        if interpret:
          raise NotImplementedError("cuDNN is not timed in a smoke run")
        t = timeit(cudnn, q, k, v, smoke=args.smoke)
        rows.append(dict(d=d, s=s, causal=causal, impl="cudnn", mode="fwd",
                         ms=t * 1e3, tflops=flops(b, h, s, d, causal, "fwd")
                         / t / 1e12))
        g = jax.jit(jax.grad(lambda q, k, v, f=cudnn: f(q, k, v).astype(
            jnp.float32).sum(), (0, 1, 2)))
        t = timeit(g, q, k, v, smoke=args.smoke)
        rows.append(dict(d=d, s=s, causal=causal, impl="cudnn",
                         mode="fwd_bwd", ms=t * 1e3,
                         tflops=flops(b, h, s, d, causal, "fwd_bwd")
                         / t / 1e12))
      except Exception as e:  # noqa: BLE001
        print("cudnn failed", d, s, causal, repr(e)[:200])
      for bq, bk, w, st in fwd_cfgs:
        cfg = jaxflash.TritonConfig(block_q=bq, block_k=bk, num_warps=w,
                                    num_stages=st)
        f = jax.jit(lambda q, k, v, cfg=cfg, c=causal:
                    jaxflash.flash_attention(q, k, v, causal=c, config=cfg,
                                             implementation="triton",
                                             interpret=interpret))
        name = f"fwd{bq}x{bk}w{w}s{st}"
        try:
          t = timeit(f, q, k, v, smoke=args.smoke)
          rows.append(dict(d=d, s=s, causal=causal, impl=name,
                           mode="fwd", ms=t * 1e3,
                           tflops=flops(b, h, s, d, causal, "fwd") / t / 1e12))
        except Exception as e:  # noqa: BLE001
          rows.append(dict(d=d, s=s, causal=causal, impl=name,
                           mode="fwd", error=repr(e)[:300]))
      for bqk, bkk, bqq, bkq, w, st in bwd_cfgs:
        cfg = jaxflash.TritonConfig(block_q_dkv=bqk, block_k_dkv=bkk,
                                    block_q_dq=bqq, block_k_dq=bkq,
                                    num_warps_bwd=w, num_stages_bwd=st)
        g = jax.jit(jax.grad(
            lambda q, k, v, cfg=cfg, c=causal: jaxflash.flash_attention(
                q, k, v, causal=c, config=cfg, implementation="triton",
                interpret=interpret).astype(jnp.float32).sum(),
            (0, 1, 2)))
        name = f"bwd{bqk}x{bkk}/{bqq}x{bkq}w{w}s{st}"
        try:
          t = timeit(g, q, k, v, smoke=args.smoke)
          rows.append(dict(d=d, s=s, causal=causal, impl=name,
                           mode="fwd_bwd", ms=t * 1e3,
                           tflops=flops(b, h, s, d, causal, "fwd_bwd")
                           / t / 1e12))
        except Exception as e:  # noqa: BLE001
          rows.append(dict(d=d, s=s, causal=causal, impl=name,
                           mode="fwd_bwd", error=repr(e)[:300]))
      print(json.dumps(rows[-14:]), flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "sweep.json"), "w") as fh:
    json.dump(dict(smoke=args.smoke, interpret=interpret, rows=rows)
              if args.smoke else rows, fh, indent=1)
  print("\n%-5s %-6s %-6s %-8s %-28s %8s %8s" % ("d", "s", "causal", "mode",
                                               "impl", "ms", "TF/s"))
  for r in rows:
    print("%-5s %-6s %-6s %-8s %-28s %8s %8s" % (
        r["d"], r["s"], r["causal"], r["mode"], r["impl"],
        "%.3f" % r["ms"] if "ms" in r else "-",
        "%.0f" % r["tflops"] if "tflops" in r else r.get("error", "")[:60]))


if __name__ == "__main__":
  main()
