"""Train the GPT of model.py with jaxflash attention.

    python examples/gpt/train.py --preset tiny --steps 300          # CPU
    python examples/gpt/train.py --preset gpt2-124m --mesh data=8   # 8 GPUs
    python examples/gpt/train.py --mesh data=2,fsdp=2,tensor=2
    python examples/gpt/train.py --preset 1b-32k --mesh data=2,context=4

A ``jax.sharding.Mesh`` over all devices with axes (data, fsdp, tensor,
context); Flax logical axis rules map the model's axis names onto it, and
the train step is one ``jit`` with input/output shardings (no manual
collectives).  A ``context`` axis splits every row's sequence: activations
are sharded along it and ``flash_attention`` runs context parallelism by
itself (ring or all-gather, causal load balance inside), so the step and
the model are the same as without it.
optax AdamW with warm-up and cosine decay, gradient clipping, gradient
accumulation; float32 master weights, compute in the preset's dtype; orbax
checkpoints (``--ckpt-every``, resumed automatically); validation loss and
a text sample; a JSONL log and a loss plot in ``--out``.

Multi-process (several hosts): pass ``--coordinator host:port
--num-processes N --process-id I`` (or run under SLURM / Open MPI, which
``jax.distributed.initialize()`` detects); each process loads only its rows
of every batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data as data_lib  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import model as model_lib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

AXES = ("data", "fsdp", "tensor", "context")
RULES = (("batch", ("data", "fsdp")), ("length", "context"),
         ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
         ("kv", None), ("mlp", "tensor"), ("vocab", "tensor"))


def parse_mesh(text: str, n_devices: int) -> dict[str, int]:
  """``"data=2,tensor=4"`` -> sizes of AXES; one size may
  be -1 (the rest of the devices); unnamed axes get 1."""
  sizes = {a: 1 for a in AXES}
  if text:
    for part in text.split(","):
      name, _, val = part.partition("=")
      if name not in AXES:
        raise ValueError(f"mesh axis {name!r} is not one of {AXES}")
      sizes[name] = int(val)
  free = [a for a, s in sizes.items() if s == -1]
  known = math.prod(s for s in sizes.values() if s != -1)
  if len(free) > 1:
    raise ValueError("at most one mesh axis may be -1")
  if free:
    sizes[free[0]] = n_devices // known
  if math.prod(sizes.values()) != n_devices:
    raise ValueError(f"mesh {sizes} does not cover {n_devices} devices")
  return sizes


def make_mesh(sizes: dict[str, int]):
  return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


@dataclasses.dataclass
class Trainer:
  cfg: model_lib.GPTConfig
  mesh: jax.sharding.Mesh
  tx: optax.GradientTransformation
  accum: int = 1
  seed: int = 0  # attention dropout's keys (cfg.attn_dropout)

  def __post_init__(self):
    self.model = model_lib.GPT(self.cfg)
    # Rows hold seq_len + 1 tokens (inputs and shifted targets): split over
    # the batch axes only; the step splits the sequence (the context axis:
    # the model's activations are constrained to it, and attention runs
    # context parallelism by itself).
    self.data_sharding = jax.sharding.NamedSharding(
        self.mesh, nn.logical_to_mesh_axes(("batch", None), RULES))
    self.token_sharding = jax.sharding.NamedSharding(
        self.mesh, nn.logical_to_mesh_axes(("batch", "length"), RULES))
    n = dict(self.mesh.shape).get("context", 1)
    if self.cfg.seq_len % n:
      raise ValueError(
          f"seq_len={self.cfg.seq_len} must be a multiple of context={n}"
          " (the sequence is split evenly over it)")

  def abstract_state(self, batch: int):
    tok = jnp.zeros((batch, self.cfg.seq_len), jnp.int32)

    def init(rng):
      params = self.model.init(rng, tok, tok)["params"]
      return {"params": params, "opt": self.tx.init(params),
              "step": jnp.zeros((), jnp.int32)}
    abstract = jax.eval_shape(init, jax.random.key(0))
    logical = nn.get_partition_spec(abstract)
    shardings = nn.logical_to_mesh_sharding(logical, self.mesh, RULES)
    return init, nn.meta.unbox(abstract), shardings

  def init_state(self, batch: int, seed: int):
    init, _, shardings = self.abstract_state(batch)
    with jax.set_mesh(self.mesh):
      state = jax.jit(lambda r: nn.meta.unbox(init(r)),
                      out_shardings=shardings)(jax.random.key(seed))
    return state, shardings

  def loss(self, params, tokens, seg, dropout_rng=None):
    """Mean next-token loss; ``dropout_rng`` (training) turns on the
    model's attention dropout (``cfg.attn_dropout``)."""
    inputs, targets, seg = tokens[:, :-1], tokens[:, 1:], seg[:, :-1]
    # Each row's tokens split over the context axis (if any): sharding
    # propagation carries the split to the activations, and attention then
    # runs context parallelism by itself.
    inputs, targets, seg = (jax.lax.with_sharding_constraint(
        x, self.token_sharding) for x in (inputs, targets, seg))
    with nn.logical_axis_rules(RULES):
      logits = self.model.apply(
          {"params": params}, inputs, seg,
          rngs=None if dropout_rng is None else {"dropout": dropout_rng})
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets).mean()

  def make_step(self, shardings):
    def step(state, tokens, seg):
      # Attention dropout's key: a function of the step and micro-batch.
      rng = jax.random.fold_in(jax.random.key(self.seed), state["step"])

      def micro(grads_loss, batch):
        *batch, i = batch
        drop = (jax.random.fold_in(rng, i) if self.cfg.attn_dropout
                else None)
        g, l_ = jax.value_and_grad(self.loss)(state["params"], *batch,
                                              drop)[::-1]
        return jax.tree.map(jnp.add, grads_loss, (g, l_)), None
      zeros = (jax.tree.map(jnp.zeros_like, state["params"]),
               jnp.zeros((), jnp.float32))
      split = lambda x: x.reshape(self.accum, -1, *x.shape[1:])
      (grads, loss), _ = jax.lax.scan(
          micro, zeros, (split(tokens), split(seg), jnp.arange(self.accum)))
      grads = jax.tree.map(lambda g: g / self.accum, grads)
      updates, opt = self.tx.update(grads, state["opt"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      new = {"params": params, "opt": opt, "step": state["step"] + 1}
      return new, loss / self.accum
    return jax.jit(step, in_shardings=(shardings, self.data_sharding,
                                       self.data_sharding),
                   out_shardings=(shardings, None), donate_argnums=0)

  def make_eval(self, shardings):
    return jax.jit(self.loss, in_shardings=(shardings["params"],
                                            self.data_sharding,
                                            self.data_sharding))

  def global_batch(self, tokens, seg):
    """This process's rows -> global arrays sharded over the mesh."""
    put = lambda x: jax.make_array_from_process_local_data(
        self.data_sharding, x)
    return put(tokens), put(seg)


def sample(trainer, params, prompt: bytes, n: int, temperature=0.8,
           seed=0) -> str:
  """Appends ``n`` bytes to ``prompt`` (full forward per byte: simple)."""
  cfg = trainer.cfg
  toks = list(prompt)
  rng = np.random.default_rng(seed)
  fwd = jax.jit(lambda p, t, s: trainer.model.apply({"params": p}, t,
                                                          s))
  for _ in range(n):
    ctx = toks[-cfg.seq_len:]
    t = np.zeros((1, cfg.seq_len), np.int32)
    t[0, :len(ctx)] = ctx
    with nn.logical_axis_rules(RULES):
      logits = np.asarray(fwd(params, t, np.ones_like(t)))[0, len(ctx) - 1]
    p = np.exp((logits - logits.max()) / temperature)
    toks.append(int(rng.choice(len(p), p=p / p.sum())))
  return bytes(toks).decode("utf-8", errors="replace")


# Peak AdamW learning rates per preset: the tiny model's is tuned for
# `make demo`; the GPT-2/3 sizes take the GPT-3 paper's values for their
# sizes (Brown et al. 2020, Table 2.1: 6e-4 at 125M, 3e-4 at 350M, 2e-4 at
# 1.3B).
PEAK_LR = {"tiny": 3e-3, "gpt2-124m": 6e-4, "gpt2-124m-8k": 6e-4,
           "gpt2-350m": 3e-4, "1b": 2e-4, "1b-32k": 2e-4,
           "1b-128k": 2e-4}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="tiny", choices=list(model_lib.PRESETS))
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--batch", type=int, default=16, help="global batch")
  ap.add_argument("--accum", type=int, default=1)
  ap.add_argument("--lr", type=float, default=None,
                  help="peak learning rate (default: the preset's, see"
                       " PEAK_LR)")
  ap.add_argument("--warmup", type=int, default=30)
  ap.add_argument("--mesh", default="data=-1")
  ap.add_argument("--attention", default="jaxflash",
                  choices=["jaxflash", "triton", "mosaic_gpu", "xla", "cudnn",
                           "jax-xla"],
                  help="jaxflash (best backend), one jaxflash backend, or"
                       " jax.nn's cudnn / jax-xla for comparison")
  ap.add_argument("--interpret", action="store_true",
                  help="run the Pallas kernels in interpret mode (CPU)")
  ap.add_argument("--seq-len", type=int, default=None)
  ap.add_argument("--attn-dropout", type=float, default=0.0,
                  help="attention dropout rate in training (in the kernels)")
  ap.add_argument("--remat", action="store_true",
                  help="recompute each block's activations in the backward"
                       " pass (less memory, ~1/3 more compute)")
  ap.add_argument("--data", default=None)
  ap.add_argument("--doc-bytes", type=int, default=None,
                  help="join the corpus and cut it into documents of this"
                       " many bytes (long context: >= seq_len, so that"
                       " segment ids do not cut each row's attention into"
                       " short documents)")
  ap.add_argument("--limit-bytes", type=int, default=4_000_000,
                  help="corpus size cap for the default corpus")
  ap.add_argument("--out", default="out/gpt")
  ap.add_argument("--ckpt-every", type=int, default=0)
  ap.add_argument("--eval-every", type=int, default=100)
  ap.add_argument("--sample-bytes", type=int, default=120)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--coordinator", default=None)
  ap.add_argument("--num-processes", type=int, default=None)
  ap.add_argument("--process-id", type=int, default=None)
  ap.add_argument("--losses-to", default=None,
                  help="also write each process's log records here (tests)")
  args = ap.parse_args(argv)

  if args.coordinator or args.num_processes:
    # CPU processes exchange through gloo (no effect on GPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes,
                               args.process_id)
  elif any(v in os.environ for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")):
    jax.distributed.initialize()
  lead = jax.process_index() == 0

  cfg = model_lib.PRESETS[args.preset]
  cfg = dataclasses.replace(
      cfg, attention=args.attention, interpret=args.interpret,
      seq_len=args.seq_len or cfg.seq_len, remat=args.remat or cfg.remat,
      attn_dropout=args.attn_dropout)
  mesh = make_mesh(parse_mesh(args.mesh, jax.device_count()))
  if args.lr is None:
    args.lr = PEAK_LR[args.preset]
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
      args.lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b2=0.95, weight_decay=0.1))
  trainer = Trainer(cfg, mesh, tx, args.accum, args.seed)

  docs = data_lib.load_documents(args.data, args.limit_bytes)
  if args.doc_bytes:
    docs = data_lib.rechunk(docs, args.doc_bytes)
  train_docs, val_docs = data_lib.split(docs)
  train = data_lib.Batches(*data_lib.pack(train_docs, cfg.seq_len),
                           args.batch, args.seed, jax.process_index(),
                           jax.process_count())
  val = data_lib.Batches(*data_lib.pack(val_docs, cfg.seq_len), args.batch,
                         args.seed + 1, jax.process_index(),
                         jax.process_count())

  state, shardings = trainer.init_state(args.batch, args.seed)
  os.makedirs(args.out, exist_ok=True)
  ckpt = None
  if args.ckpt_every:
    import orbax.checkpoint as ocp
    ckpt = ocp.CheckpointManager(
        os.path.abspath(os.path.join(args.out, "ckpt")),
        options=ocp.CheckpointManagerOptions(max_to_keep=2))
    if ckpt.latest_step() is not None:
      state = ckpt.restore(ckpt.latest_step(), args=ocp.args.StandardRestore(
          state))
      if lead:
        print(f"resumed from step {int(state['step'])}")
  step_fn = trainer.make_step(shardings)
  eval_fn = trainer.make_eval(shardings)

  from tqdm import tqdm
  log_path = os.path.join(args.out, "log.jsonl")
  log = open(log_path, "a") if lead else None
  start = int(state["step"])
  bar = tqdm(range(start, args.steps), disable=not lead, unit="step")
  tokens_per_step = args.batch * cfg.seq_len
  history = []
  t_last = time.perf_counter()
  for step in bar:
    tokens, seg = trainer.global_batch(*train.get(step))
    state, loss = step_fn(state, tokens, seg)
    if step % 10 == 0 or step == args.steps - 1:
      loss = float(loss)
      now = time.perf_counter()
      done = 10 if step > start else 1
      tps = tokens_per_step * done / (now - t_last)
      t_last = now
      mfu = _mfu(tps, cfg.flops_per_token())
      rec = dict(step=step, loss=loss, lr=float(schedule(step)),
                 tokens_per_s=tps, mfu=mfu, peak_bytes=_peak_bytes())
      if args.eval_every and (step % args.eval_every == 0
                              or step == args.steps - 1):
        rec["val_loss"] = float(eval_fn(state["params"],
                                        *trainer.global_batch(*val.get(0))))
      history.append(rec)
      if lead:
        log.write(json.dumps(rec) + "\n")
        log.flush()
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:.0f}",
                        mfu=f"{mfu:.1%}" if mfu == mfu else "-")
    if ckpt is not None and (step + 1) % args.ckpt_every == 0:
      import orbax.checkpoint as ocp
      ckpt.save(step + 1, args=ocp.args.StandardSave(state))
  if ckpt is not None:
    ckpt.wait_until_finished()
  if args.losses_to:
    with open(f"{args.losses_to}.{jax.process_index()}", "w") as f:
      json.dump(history, f)
  if not lead:
    return history
  log.close()
  text = sample(trainer, state["params"], b"def ", args.sample_bytes)
  print("\nsample:\n" + text)
  png = _plot(history, os.path.join(args.out, "loss.png"))
  print(f"\nlog: {log_path}" + (f"\nplot: {png}" if png else ""))
  return history


def _peak_bytes():
  """Peak device memory of device 0 so far (None where the backend does
  not report it, e.g. CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


# Dense bf16 peak per device (datasheet; MFU denominator).
_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _peak_flops(kind: str):
  return next((v for k, v in _PEAKS.items() if k in kind), None)


def _mfu(tokens_per_s: float, flops_per_token: float) -> float:
  """Model FLOPs utilisation of all devices together: the global
  tokens/s times the model FLOPs per token over the peak of every device
  (NaN where the device's peak is unknown, e.g. CPU)."""
  peak = _peak_flops(jax.devices()[0].device_kind)
  if not peak:
    return float("nan")
  return tokens_per_s * flops_per_token / (jax.device_count() * peak)


def _plot(history, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot([h["step"] for h in history], [h["loss"] for h in history],
          label="train")
  val = [h for h in history if "val_loss" in h]
  if val:
    ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-",
            label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/byte)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


if __name__ == "__main__":
  main()
