"""The GPT of model.py trained data-parallel with ``jax.pmap``.

For codebases built on pmap: parameters replicated on every local device,
each device takes its slice of the batch, gradients averaged with
``lax.pmean``. jaxflash attention runs inside pmap unchanged.

    python examples/gpt/train_pmap.py --steps 50
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data as data_lib  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import model as model_lib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="tiny", choices=list(model_lib.PRESETS))
  ap.add_argument("--steps", type=int, default=50)
  ap.add_argument("--batch", type=int, default=16, help="global batch")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seq-len", type=int, default=None)
  ap.add_argument("--limit-bytes", type=int, default=2_000_000)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)

  n = jax.local_device_count()
  if args.batch % n:
    raise ValueError(f"batch={args.batch} not divisible by {n} devices")
  cfg = model_lib.PRESETS[args.preset]
  if args.seq_len:
    cfg = model_lib.GPTConfig(**{**cfg.__dict__, "seq_len": args.seq_len})
  model = model_lib.GPT(cfg)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr))

  docs = data_lib.load_documents(limit_bytes=args.limit_bytes)
  tokens, seg = data_lib.pack(data_lib.split(docs)[0], cfg.seq_len)
  batches = data_lib.Batches(tokens, seg, args.batch, args.seed)

  dummy = jnp.zeros((1, cfg.seq_len), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.key(args.seed), dummy,
                                    dummy)["params"])
  opt = tx.init(params)
  # One copy per local device along a leading axis, as pmap expects.
  params, opt = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)),
                             (params, opt))

  def loss_fn(params, tokens, seg):
    logits = model.apply({"params": params}, tokens[:, :-1], seg[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  @functools.partial(jax.pmap, axis_name="devices")
  def step(params, opt, tokens, seg):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, seg)
    grads = jax.lax.pmean(grads, "devices")
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, jax.lax.pmean(
        loss, "devices")

  losses = []
  for i in range(args.steps):
    t, s = batches.get(i)
    shard = lambda x: x.reshape(n, -1, *x.shape[1:])
    params, opt, loss = step(params, opt, shard(t), shard(s))
    losses.append(float(loss[0]))
    if i % 10 == 0 or i == args.steps - 1:
      print(f"step {i}: loss {losses[-1]:.3f}", flush=True)
  return losses


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
