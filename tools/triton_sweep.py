"""Times Triton-backend tile configs on a GPU (tuning aid, not the bench).

PYTHONPATH=. python3 tools/triton_sweep.py [--quick]
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.bench import core


def timeit(fn, *args):
  return core.time_fn(fn, *args, samples=5)


def flops(b, h, s, d, causal, mode):
  return core.flops(core.Shape(b, s, s, h, h, d, causal), mode)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args()
  rows = []
  shapes = [(64, 4096), (128, 4096), (256, 4096)] if args.quick else [
      (64, 1024), (64, 4096), (128, 1024), (128, 4096), (128, 16384),
      (256, 4096)]
  fwd_cfgs = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
              (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)]
  bwd_cfgs = [(32, 128, 128, 32, 8, 2), (64, 64, 64, 64, 4, 2),
              (32, 64, 64, 32, 4, 2), (64, 128, 128, 64, 8, 2),
              (32, 64, 64, 32, 4, 1), (16, 64, 64, 16, 4, 1)]
  key = jax.random.key(0)
  for d, s in shapes:
    b, h = 16384 // s, 2048 // d
    for causal in (False, True):
      q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16)
                 for kk in jax.random.split(key, 3))
      # (default arguments bind this iteration's values: the functions
      # are traced inside it, but ruff's B023 cannot know that)
      cudnn = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
          q, k, v, is_causal=c, implementation="cudnn"))
      try:
        t = timeit(cudnn, q, k, v)
        rows.append(dict(d=d, s=s, causal=causal, impl="cudnn", mode="fwd",
                         ms=t * 1e3, tflops=flops(b, h, s, d, causal, "fwd")
                         / t / 1e12))
        g = jax.jit(jax.grad(lambda q, k, v, f=cudnn: f(q, k, v).astype(
            jnp.float32).sum(), (0, 1, 2)))
        t = timeit(g, q, k, v)
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
                    jaxflash.flash_attention(q, k, v, causal=c, config=cfg))
        name = f"fwd{bq}x{bk}w{w}s{st}"
        try:
          t = timeit(f, q, k, v)
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
                q, k, v, causal=c, config=cfg).astype(jnp.float32).sum(),
            (0, 1, 2)))
        name = f"bwd{bqk}x{bkk}/{bqq}x{bkq}w{w}s{st}"
        try:
          t = timeit(g, q, k, v)
          rows.append(dict(d=d, s=s, causal=causal, impl=name,
                           mode="fwd_bwd", ms=t * 1e3,
                           tflops=flops(b, h, s, d, causal, "fwd_bwd")
                           / t / 1e12))
        except Exception as e:  # noqa: BLE001
          rows.append(dict(d=d, s=s, causal=causal, impl=name,
                           mode="fwd_bwd", error=repr(e)[:300]))
      print(json.dumps(rows[-14:]), flush=True)
  with open(os.path.join(args.out, "sweep.json"), "w") as fh:
    json.dump(rows, fh, indent=1)
  print("\n%-5s %-6s %-6s %-8s %-28s %8s %8s" % ("d", "s", "causal", "mode",
                                               "impl", "ms", "TF/s"))
  for r in rows:
    print("%-5s %-6s %-6s %-8s %-28s %8s %8s" % (
        r["d"], r["s"], r["causal"], r["mode"], r["impl"],
        "%.3f" % r["ms"] if "ms" in r else "-",
        "%.0f" % r["tflops"] if "tflops" in r else r.get("error", "")[:60]))


if __name__ == "__main__":
  main()
