"""Times Hopper-kernel configs (MosaicConfig) on an H100/H200: the data
behind jaxflash/mosaic_gpu/tuning.json.

    PYTHONPATH=. python3 tools/mosaic_sweep.py [--head-dims 64,128,256]
        [--seqs 4096] [--out DIR] [--bwd]
        [--variants "persistent=1;bwd_stages=3"]

Forward tiles, or with ``--bwd`` forward+backward over the backward tiles
(``bwd_*`` fields); bf16; 16k tokens per call and width 2048 as in
shared/ANCHORS.md. Prints the best config per
(head_dim, causal) and writes every row to mosaic_sweep.json; failures
(shared memory, compile errors) are rows with the reason.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.bench import core
from jaxflash.mosaic_gpu.config import (
  SMEM_LIMIT,
  head_dim_problem,
  parse_overrides,
)


def candidates(head_dim, full=False):
  """Two consumer warpgroups with P in registers (the fast form) over
  block_kv x stages; ``full`` adds one consumer and P through SMEM."""
  wgs_psmem = [(2, False)] + ([(1, False), (2, True)] if full else [])
  for bkv, stages, (wgs, p_smem) in itertools.product(
      (64, 128, 192), (2, 3, 4), wgs_psmem):
    cfg = jaxflash.MosaicConfig(block_q=64, block_kv=bkv, stages=stages,
                                compute_wgs=wgs, p_in_smem=p_smem,
                                schedule_barrier=wgs == 2)
    if cfg.smem_bytes(head_dim) <= SMEM_LIMIT:  # (the forward alone)
      yield cfg


def bwd_candidates(head_dim):
  """Backward tiles on top of the tuned forward: the ring depth (above
  padded head_dim 128, of the tuned paired kernels)."""
  variants = [dict(bwd_stages=2), dict(bwd_stages=3)]
  if head_dim > 128:
    variants = [dict(bwd_stages=3)]
  configs = variant_configs(head_dim, variants, causal=False, kv_len=None)
  next(configs)  # the tuned default itself (main() times it as None)
  yield from configs


def parse_variants(text):
  """``"a=1,b=2;c=0"`` -> [{"a": 1, "b": 2}, {"c": 0}]
  (:func:`jaxflash.mosaic_gpu.config.parse_overrides` per variant)."""
  try:
    return [parse_overrides(part) for part in text.split(";") if part.strip()]
  except ValueError as e:
    raise SystemExit(str(e)) from None


def variant_configs(head_dim, variants, *, causal, kv_len):
  """The tuned default of this call, then that default with each
  variant's overrides (those refused, or that cannot serve the head_dim,
  are skipped with the reason)."""
  base = jaxflash.mosaic_gpu.default_config("NVIDIA H200", head_dim,
                                            causal=causal, kv_len=kv_len)
  yield base
  for kw in variants:
    try:
      cfg = dataclasses.replace(base, **kw)
    except ValueError as e:
      print(f"skip {kw}: {e}", flush=True)
      continue
    why = head_dim_problem(cfg, head_dim)
    if why:
      print(f"skip {kw}: {why}", flush=True)
      continue
    yield cfg


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--head-dims", default="64,128,256")
  ap.add_argument("--seqs", default="4096")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--default-only", action="store_true",
                  help="time only the tuned default config")
  ap.add_argument("--tag", default="", help="suffix of the output file")
  ap.add_argument("--variants", default="",
                  help="time the tuned default and these overrides of it"
                       " (';' between variants, ',' between fields)")
  ap.add_argument("--full", action="store_true",
                  help="also one consumer warpgroup and P through SMEM")
  ap.add_argument("--bwd", action="store_true",
                  help="forward+backward over backward tiles (and the"
                       " default, whose gradient at head_dim > 128 is the"
                       " Triton kernels')")
  args = ap.parse_args()
  mode = "fwd_bwd" if args.bwd else "fwd"
  rows = []
  for d in core.parse_int_list(args.head_dims):
    for s in core.parse_int_list(args.seqs):
      for causal in (False, True):
        shape = core.Shape(16384 // s, s, s, 2048 // d, 2048 // d, d, causal)
        ks = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (shape.batch, s, shape.heads, d),
                                     jnp.bfloat16) for kk in ks)
        if args.variants:
          cfgs = list(variant_configs(d, parse_variants(args.variants),
                                      causal=causal, kv_len=s))
        elif args.default_only:
          cfgs = [None]
        elif args.bwd:
          cfgs = [None, *bwd_candidates(d)]
        else:
          cfgs = list(candidates(d, args.full))
        for cfg in cfgs:
          attend = functools.partial(jaxflash.flash_attention, causal=causal,
                                     config=cfg)
          if args.bwd:
            f = jax.jit(lambda q, k, v, attend=attend:
                        jax.vjp(attend, q, k, v)[1](q))
          else:
            f = jax.jit(attend)
          row = dict(head_dim=d, seq=s, causal=causal, mode=mode,
                     config=cfg and cfg.__dict__.copy(), tag=args.tag)
          try:
            t = core.time_fn(f, q, k, v, samples=5)
            row.update(ms=t * 1e3, tflops=core.flops(shape, mode) / t / 1e12)
          except Exception as e:  # noqa: BLE001 - a failing config is a row
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
          rows.append(row)
          print(json.dumps(row), flush=True)
  with open(os.path.join(args.out, f"mosaic_sweep{args.tag}.json"), "w") as f:
    json.dump(rows, f, indent=1)
  print("\nbest per (head_dim, seq, causal):")
  key = lambda r: (r["head_dim"], r["seq"], r["causal"])
  for k_, group in itertools.groupby(sorted(rows, key=key), key=key):
    ok = [r for r in group if "tflops" in r]
    if ok:
      best = max(ok, key=lambda r: r["tflops"])
      print(k_, f"{best['tflops']:.0f} TFLOP/s", best["config"])
    else:
      print(k_, "no config ran")


if __name__ == "__main__":
  main()
