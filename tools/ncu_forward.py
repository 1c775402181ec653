"""One forward call of jaxflash's or tokamax's Hopper kernel, for ncu.

The d256 forward (batch 2, seq 8192, 8 heads, non-causal) is compiled and
run twice; profile the second launch (``ours`` or ``tok``)::

    K='regex:(anonymous_mosaic|flash_attention_sm90)'
    ncu --target-processes all -k "$K" --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section ComputeWorkloadAnalysis \\
        --section LaunchStats --section Occupancy --csv --page details \\
        python3 tools/ncu_forward.py ours
    # stall reasons per SASS instruction:
    ncu --target-processes all -k "$K" --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o rep \\
        python3 tools/ncu_forward.py ours
    ncu -i rep.ncu-rep --page source --csv --print-source sass

``ours`` takes an optional second argument, MosaicConfig fields over the
tuned default (``"early_k_wait=1,row_sum_in_pv=1"``).  ncu is
/usr/local/cuda/bin/ncu on the H200 machine, counters enabled.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import tokamax

import jaxflash

which = sys.argv[1]
keys = jax.random.split(jax.random.key(0), 3)
q, k, v = [jax.random.normal(key, (2, 8192, 8, 256), jnp.bfloat16)
           for key in keys]
jax.block_until_ready((q, k, v))
if which == "ours":
  from jaxflash import mosaic_gpu
  from jaxflash.mosaic_gpu.config import parse_overrides
  config = dataclasses.replace(
      mosaic_gpu.default_config(jax.devices()[0].device_kind, 256,
                                causal=False, kv_len=8192),
      **parse_overrides(sys.argv[2] if len(sys.argv) > 2 else ""))
  f = jax.jit(lambda q, k, v: jaxflash.flash_attention(
      q, k, v, implementation="mosaic_gpu", config=config))
else:
  f = jax.jit(lambda q, k, v: tokamax.dot_product_attention(
      q, k, v, implementation="mosaic"))
jax.block_until_ready(f(q, k, v))
jax.block_until_ready(f(q, k, v))
