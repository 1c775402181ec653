"""Smoke test of an installed jaxflash wheel (run by .ci/wheel-smoke.sh
in a fresh virtual environment, outside the source tree): every file the
package reads at run time is in the wheel."""

import os
import subprocess
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxflash  # noqa: E402
from jaxflash import mosaic_gpu, triton  # noqa: E402
from jaxflash.mosaic_gpu import config as mosaic_config  # noqa: E402

here = os.path.dirname(jaxflash.__file__)
if "site-packages" not in here:
  sys.exit(f"jaxflash imported from {here}, not from the installed wheel")

# Every backend's config and tuning.
for kind in [*mosaic_config.tuned_device_kinds(), None]:
  for dp in (64, 128, 256):
    for causal in (False, True):
      mosaic_gpu.default_config(kind, dp, causal=causal, kv_len=4096)
triton.default_config(256, 256, 64, jnp.bfloat16)

# One interpret-mode call per backend, checked against the reference.
key = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (1, 128, 2, 64), jnp.bfloat16)
           for kk in key)
ref = jaxflash.flash_attention(q, k, v, causal=True, implementation="xla")
for impl in ("triton", "mosaic_gpu"):
  out = jaxflash.flash_attention(q, k, v, causal=True, implementation=impl,
                                 interpret=True)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                              - ref.astype(jnp.float32))))
  if not err < 0.05:
    sys.exit(f"{impl}: max error {err} against the reference")
  print(f"{impl}: interpret-mode call ok (max error {err:.4f})")

# The benchmark's command line.
res = subprocess.run([sys.executable, "-m", "jaxflash.bench", "--help"],
                     capture_output=True, text=True)
if res.returncode:
  sys.exit(f"python -m jaxflash.bench --help failed:\n{res.stderr}")
import jaxflash.linen  # noqa: E402, F401
import jaxflash.sharding  # noqa: E402, F401

print(f"wheel smoke test passed: jaxflash {jaxflash.__version__} from {here}")
