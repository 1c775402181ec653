"""jaxflash in one screen: the kernel against the reference, error and time.

    make compare         (or: python examples/demo.py)

On a CUDA GPU this runs the compiled Pallas kernels; elsewhere it runs the
same kernels in Pallas interpret mode (correct but slow: the timing there is
not a performance figure).
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import reference


def timed(fn, *args, reps=3):
  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main():
  on_gpu = jax.default_backend() == "gpu"
  batch, seq, heads, kv_heads, head_dim = (4, 4096, 16, 4, 128) if on_gpu \
      else (1, 512, 4, 2, 64)
  dtype = jnp.bfloat16
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim), dtype)
  k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), dtype)
  v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), dtype)
  do = jax.random.normal(kd, q.shape, dtype)
  mode = "compiled" if on_gpu else "interpret mode (CPU)"
  print(f"jaxflash {jaxflash.__version__} on {jax.devices()[0].device_kind}"
        f" [{jax.default_backend()}], kernels {mode}")
  print(f"q {q.shape}, k/v {k.shape} {jnp.dtype(dtype).name}, causal,"
        f" GQA {heads // kv_heads}:1")

  def fwd_bwd(attn):
    def run(q, k, v, do):
      out, vjp = jax.vjp(attn, q, k, v)
      return (out, *vjp(do))
    return jax.jit(run)

  flash = fwd_bwd(lambda q, k, v: jaxflash.flash_attention(
      q, k, v, causal=True, implementation="triton", interpret=not on_gpu))
  ref = fwd_bwd(lambda q, k, v: reference.attention(
      q, k, v, causal=True)[0])
  got = flash(q, k, v, do)
  want = ref(*(x.astype(jnp.float32) for x in (q, k, v, do)))
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
    print(f"  {name:3s}: max |jaxflash - float32 reference| / max|ref| ="
          f" {err:.2e}")
  t_flash = timed(flash, q, k, v, do)
  t_ref = timed(ref, q, k, v, do)
  print(f"forward+backward: jaxflash {t_flash * 1e3:.1f} ms, reference"
        f" (XLA, float32) {t_ref * 1e3:.1f} ms")
  if not on_gpu:
    print("(interpret mode emulates the kernel on the CPU: the times above"
          " are not performance figures)")


if __name__ == "__main__":
  main()
