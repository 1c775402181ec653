"""Kernel vs reference under the numerics rule, over the issue's grid.

On CPU the Triton kernels run in interpret mode with small tiles (so short
sequences still cross several tiles); the ``gpu`` variants run the compiled
kernels with their default tiles on a CUDA GPU.
"""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest

import jaxflash

SMALL_TILES = jaxflash.TritonConfig(
    block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32,
    block_k_dq=16)

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def _grid():
  """Every value of every axis, crossed where it matters.

  * each head_dim with each dtype (causal and not), at awkward lengths;
  * each (q_len, kv_len) pair of {1, 17, 113, 128, 257} with each head
    layout and causal on/off, in bf16 at head_dim 64.
  """
  cases = []
  lens = [(17, 17), (113, 257), (257, 113), (128, 128)]
  for i, (d, dn) in enumerate(itertools.product(
      [32, 64, 96, 128, 256], DTYPES)):
    for causal in (False, True):
      t, s = lens[(i + causal) % len(lens)]
      hn = list(HEADS)[(i + 2 * causal) % 3]
      cases.append((dn, hn, d, t, s, causal))
  lengths = [1, 17, 113, 128, 257]
  for j, (t, s) in enumerate(itertools.product(lengths, lengths)):
    for causal in (False, True):
      hn = list(HEADS)[(j + causal) % 3]
      cases.append(("bf16", hn, 64, t, s, causal))
  return cases


CASES = _grid()
IDS = [f"{dn}-{hn}-d{d}-q{t}-k{s}-{'causal' if c else 'full'}"
       for dn, hn, d, t, s, c in CASES]

# The interpret cases of every commit (`make test`): each dtype, each head
# layout, head_dim 32 to 256 (96 not a power of two), lengths 1, 17, 113,
# 128 and 257, q_len < kv_len and q_len > kv_len (causal rows that see
# nothing), causal on and off.  The rest of the grid is `slow`.
EVERY_COMMIT = {
    "fp16-gqa-d32-q113-k257-full",
    "fp32-gqa-d64-q257-k113-causal",
    "bf16-mqa-d96-q128-k128-causal",
    "bf16-mha-d256-q17-k17-full",
    "bf16-mqa-d64-q1-k257-causal",
    "bf16-mha-d64-q17-k1-causal",
}
assert EVERY_COMMIT <= set(IDS)
INTERPRET_CASES = [
    pytest.param(c, id=i, marks=[] if i in EVERY_COMMIT else [pytest.mark.slow])
    for c, i in zip(CASES, IDS)]


def _run(case, *, seed, interpret, config):
  dn, hn, d, t, s, causal = case
  heads, kv_heads = HEADS[hn]
  args = numerics.random_inputs(
      jax.random.key(seed), batch=2, q_len=t, kv_len=s, heads=heads,
      kv_heads=kv_heads, head_dim=d, dtype=DTYPES[dn])
  fn = functools.partial(jaxflash.flash_attention, causal=causal,
                         return_lse=True, implementation="triton",
                         interpret=interpret, config=config)
  got = numerics.outputs_and_grads(jax.jit(fn), *args)
  numerics.check_rule(got, *args, causal=causal)
  return got, args


@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_triton_interpret(case):
  _run(case, seed=zlib.crc32(repr(case).encode()), interpret=True,
       config=SMALL_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_gpu(case):
  _run(case, seed=zlib.crc32(repr(case).encode()), interpret=False, config=None)


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1024, 2048, 4096])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_triton_gpu_long(seq, causal, head_dim):
  """Default tiles at training-size shapes (many tiles per program)."""
  _run(("bf16", "gqa", head_dim, seq, seq, causal), seed=seq + head_dim,
       interpret=False, config=None)


def test_default_tiles_interpret():
  """The default (shape-chosen) tiles, as used on GPUs, in interpret mode."""
  _run(("bf16", "gqa", 64, 300, 200, True), seed=3, interpret=True,
       config=None)


@pytest.mark.gpu
def test_bitwise_deterministic():
  """Same inputs twice give bitwise-equal outputs and gradients.  (GPU
  only: the interpreter runs a kernel's programs one after another, so
  on CPU the result is deterministic whatever the kernel does.)"""
  case = ("bf16", "gqa", 64, 113, 257, True)
  first, args = _run(case, seed=11, interpret=False, config=None)
  fn = functools.partial(jaxflash.flash_attention, causal=True,
                         return_lse=True, implementation="triton",
                         interpret=False, config=None)
  second = numerics.outputs_and_grads(jax.jit(fn), *args)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
