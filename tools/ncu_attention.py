"""One attention call of jaxflash's or tokamax's Hopper kernels, for ncu.

The call (forward, or forward+backward with ``--mode bwd``) at one shape of
the benchmark grid (16,384 tokens, width 2048: batch 2, 8 heads at d256
s8192) is compiled and run twice; profile the second call's launches::

    K='regex:(anonymous_mosaic|flash_attention_sm90)'
    ncu --target-processes all -k "$K" --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section ComputeWorkloadAnalysis \\
        --section LaunchStats --section Occupancy --csv --page details \\
        python3 tools/ncu_attention.py --impl ours
    # stall reasons per SASS instruction, then a summary of them:
    ncu --target-processes all -k "$K" --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o rep \\
        python3 tools/ncu_attention.py --impl ours \\
          --overrides "early_k_wait=1,row_sum_in_pv=1"
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 tools/ncu_stalls.py rep.csv

With ``--mode bwd`` one call launches the forward and then the backward's
N kernels (``jaxflash.mosaic_gpu.backend.backward_passes``), so
``--launch-skip N+1 --launch-count N`` profiles the second call's.  The
backward's kernels run in the order XLA schedules them, not necessarily
``backward_passes``' order: at d128 on the H200 (2026-12-02) it was
forward, dK/dV, dQ, so the dK/dV kernel was ``--launch-skip 4``.  Tell
them apart by a first run with ``--section LaunchStats`` (shared memory
per block, and the dK/dV kernel's longer duration).  ``--overrides``
takes MosaicConfig fields over the tuned default (``--tuned-for KIND``:
that device kind's, e.g. the H200's on a Hopper part with no entry).
``--impl cudnn`` runs
``jax.nn.dot_product_attention(implementation="cudnn")``, the
benchmark's cuDNN row; its kernels are not matched by the ``K`` above:
list the launches' names first (ncu without ``-k``, ``--section
LaunchStats``) and pick them with ``-k regex:...``.  ncu is
/usr/local/cuda/bin/ncu on the H200 machine, counters enabled.  By
default it fixes the clock (about 1.35 GHz); with ``--clock-control
none`` (the device notes' advice, used from 2026-12-03) the SM ran at
1.76 GHz.  Either way it flushes the caches before each kernel, so
compare its durations only with each other.

``--shapes "64:1024:0,128:2048:1,..."`` (head_dim:seq:causal) runs one
call per shape in one process, each once, so that a single ncu run
(``-k`` without ``--launch-skip``) profiles every shape; the report
holds the launches in the order given (``ncu_stalls.py --kernel i``).
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--impl", choices=("ours", "tok", "cudnn"), default="ours")
  ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
  ap.add_argument("--head-dim", type=int, default=256)
  ap.add_argument("--seq", type=int, default=8192)
  ap.add_argument("--causal", type=int, default=0)
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--width", type=int, default=2048)
  ap.add_argument("--overrides", default="",
                  help="MosaicConfig fields, 'field=value,...'")
  ap.add_argument("--tuned-for", default=None, metavar="DEVICE_KIND",
                  help="start from tuning.json's entry for this device"
                       " kind (e.g. 'NVIDIA H200' on a Hopper part with"
                       " no entry) instead of this device's")
  ap.add_argument("--shapes", default="",
                  help="head_dim:seq:causal,... run once each, in order")
  args = ap.parse_args(argv)
  if args.shapes:
    for shape in args.shapes.split(","):
      d, s, c = (int(x) for x in shape.split(":"))
      print(f"shape {shape}", flush=True)
      run(args, d, s, c, calls=1)
  else:
    run(args, args.head_dim, args.seq, args.causal, calls=2)


def run(args, head_dim, seq, causal, calls):
  batch = max(1, args.tokens // seq)
  heads = max(1, args.width // head_dim)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = [jax.random.normal(key, (batch, seq, heads, head_dim),
                               jnp.bfloat16) for key in keys]
  if args.impl == "ours":
    import jaxflash
    from jaxflash import mosaic_gpu
    from jaxflash.mosaic_gpu.config import parse_overrides
    config = dataclasses.replace(
        mosaic_gpu.default_config(args.tuned_for
                                  or jax.devices()[0].device_kind,
                                  head_dim, causal=bool(causal),
                                  kv_len=seq),
        **parse_overrides(args.overrides))

    def attn(q, k, v):
      return jaxflash.flash_attention(q, k, v, causal=bool(causal),
                                      implementation="mosaic_gpu",
                                      config=config)
  elif args.impl == "tok":
    import tokamax

    def attn(q, k, v):
      return tokamax.dot_product_attention(q, k, v,
                                           is_causal=bool(causal),
                                           implementation="mosaic")
  else:  # cuDNN's fused attention, as the benchmark's cudnn row calls it

    def attn(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=bool(causal),
                                          implementation="cudnn")
  if args.mode == "fwd":
    f = jax.jit(attn)
  else:
    f = jax.jit(jax.grad(
        lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(),
        argnums=(0, 1, 2)))
  jax.block_until_ready((q, k, v))
  for _ in range(calls):
    jax.block_until_ready(f(q, k, v))


if __name__ == "__main__":
  main()
