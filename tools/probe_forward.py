"""Probe the Hopper forward against tokamax (and cuDNN) outside the bench grid.

    PYTHONPATH=. python3 tools/probe_forward.py items [--head-dim 256]
    PYTHONPATH=. python3 tools/probe_forward.py clocks [--seq 8192]
        [--overrides "kv_multicast=1"]

``items``: jaxflash's and tokamax's forward (non-causal, both with their
tuned defaults) timed in interleaved rounds at one head_dim over several
(batch, seq, heads) whose work-item count (one item = 128 query rows of
one head) runs from about two waves of the 132 SMs to sixteen: is the gap
a cost per call, per item, or does it grow with the number of waves?

``clocks``: each implementation run back to back for a few seconds at
``--seq`` keys (default 8192; batch 16384 / seq), 2048 channels, while
``nvidia-smi`` samples the SM clock, board power and throttle reasons
every 50 ms; once on random inputs and once on zeros (which draw far
less power).  Says whether an implementation is power-bound (same
power, lower clock) or needs more cycles for the same work (time x
clock: the ``Mcyc`` column, per call).  ``--overrides`` (MosaicConfig
fields over the tuned default for the call) adds a ``jaxflash[...]``
row with them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

# Shapes of the items probe: (batch, seq, heads) at 16 or fewer heads.
ITEM_SHAPES = ((1, 8192, 4), (1, 8192, 8), (2, 8192, 8), (4, 8192, 8),
               (1, 4096, 8), (1, 16384, 4), (1, 16384, 8))


def _inputs(batch, seq, heads, head_dim, zeros=False):
  import jax
  import jax.numpy as jnp
  shape = (batch, seq, heads, head_dim)
  if zeros:
    return [jnp.zeros(shape, jnp.bfloat16)] * 3
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]


def _impls(overrides: str = "", head_dim: int = 256, seq: int = 8192):
  import jax
  import tokamax

  import jaxflash
  from jaxflash.bench import core, impls
  from jaxflash.mosaic_gpu.config import parse_overrides
  variant = {}
  if overrides:  # the benchmark's --mosaic-variants row at this shape
    heads = 2048 // head_dim
    shape = core.Shape(batch=max(1, 16384 // seq), seq_q=seq, seq_k=seq,
                       heads=heads, kv_heads=heads, head_dim=head_dim,
                       causal=False)
    make = impls.mosaic_variant(parse_overrides(overrides))
    variant[f"jaxflash[{overrides}]"] = jax.jit(
        make(shape, {}, False))
  return {
      "jaxflash": jax.jit(lambda q, k, v: jaxflash.flash_attention(
          q, k, v, implementation="mosaic_gpu")),
      **variant,
      "tokamax": jax.jit(lambda q, k, v: tokamax.dot_product_attention(
          q, k, v, implementation="mosaic")),
      "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, implementation="cudnn")),
  }


def items(head_dim: int) -> None:
  from jaxflash.bench import core
  impls = _impls()
  print(f"{'batch seq heads':18s} {'items':>6s} {'jaxflash':>9s}"
        f" {'tokamax':>9s} {'diff us':>8s} {'ratio':>6s}")
  for b, s, h in ITEM_SHAPES:
    args = _inputs(b, s, h, head_dim)
    t = core.time_interleaved({n: (impls[n], args)
                               for n in ("jaxflash", "tokamax")}, samples=9)
    n_items = b * h * s // 128
    ours, tok = t["jaxflash"], t["tokamax"]
    print(f"b{b} s{s} h{h}".ljust(18),
          f"{n_items:6d} {ours * 1e3:9.3f} {tok * 1e3:9.3f}"
          f" {(ours - tok) * 1e6:8.1f} {tok / ours:6.3f}", flush=True)


def _sampled_run(name, fn, args, seconds=3.0):
  import jax
  jax.block_until_ready(fn(*args))
  smi = subprocess.Popen(
      ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,"
       "clocks_throttle_reasons.active", "--format=csv,noheader,nounits",
       "-lms", "50"], stdout=subprocess.PIPE, text=True)
  time.sleep(0.3)
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    for _ in range(20):
      out = fn(*args)
    jax.block_until_ready(out)
    n += 20
  per_call = (time.perf_counter() - t0) / n
  smi.terminate()
  rows = [line.split(", ") for line in smi.communicate()[0].splitlines()]
  rows = rows[len(rows) // 4:]  # the steady part
  med = lambda i: statistics.median(float(r[i]) for r in rows)
  print(f"{name:28s} {per_call * 1e3:7.3f} ms  clock {med(0):6.0f} MHz"
        f"  {per_call * med(0):7.3f} Mcyc"
        f"  power {med(1):6.1f} W  temp {med(2):4.0f}"
        f"  throttle {sorted({r[3] for r in rows})}", flush=True)
  time.sleep(1.0)


def clocks(head_dim: int, seq: int = 8192, overrides: str = "") -> None:
  impls = _impls(overrides, head_dim, seq)
  heads = 2048 // head_dim
  for zeros in (False, True):
    args = _inputs(max(1, 16384 // seq), seq, heads, head_dim, zeros=zeros)
    for _ in range(2):
      for name, fn in impls.items():
        _sampled_run(f"d{head_dim} s{seq} {'zeros' if zeros else 'normal'}"
                     f" {name}", fn, args)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("probe", choices=["items", "clocks"])
  ap.add_argument("--head-dim", type=int, default=256)
  ap.add_argument("--seq", type=int, default=8192,
                  help="clocks: keys per call (batch 16384 / seq)")
  ap.add_argument("--overrides", default="",
                  help="clocks: also jaxflash with these MosaicConfig"
                       " fields over the tuned default (field=value,...)")
  args = ap.parse_args(argv)
  if args.probe == "items":
    items(args.head_dim)
  else:
    clocks(args.head_dim, args.seq, args.overrides)
  return 0


if __name__ == "__main__":
  sys.exit(main())
