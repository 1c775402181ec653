"""Batched generation from the GPT of model.py with a paged KV cache.

    python examples/gpt/generate.py --batch 2 --prompt-len 16 \\
        --new-tokens 8 --interpret                           # CPU, seconds
    python examples/gpt/generate.py --preset gpt2-124m --batch 32 \\
        --prompt-len 1024 --new-tokens 256                   # one GPU

Prompts of different lengths (uniform in ``[prompt_len / 2, prompt_len]``
per row, cut from the corpus of data.py), right-padded.  A prefill writes
them into the cache in chunks, then a ``lax.scan`` of decode steps appends
one token per row and step, sampled with temperature and top-k (greedy at
temperature 0).  ``--attention jaxflash`` keeps the keys and values in a
paged cache (:class:`jaxflash.paged.PagedKVCache`, pages handed out per
row by a :class:`jaxflash.paged.PageAllocator`) and attends with
:func:`jaxflash.paged_attention`; ``--attention jax-nn`` runs the same
loop with ``jax.nn.dot_product_attention`` over a contiguous ``[batch,
max_len, kv_heads, head_dim]`` cache (XLA), ``--attention cudnn`` the
same with its decode steps by cuDNN (a GPU); ``both`` (default) runs
jaxflash and jax-nn, ``all`` the three, and prints their tokens/s side by
side.  Each is timed after a warm-up run
(compilation).  ``--ckpt`` loads the parameters of a train.py run's
checkpoints (``--out/ckpt``); without it they are a fresh initialisation
(the timing does not depend on them).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data as data_lib  # noqa: E402
import jax  # noqa: E402

# Imported up front: the first Pallas kernel traced imports it lazily, and
# the config option it registers changes JAX's tracing context, so a
# function jit'ed before that would be traced and compiled again after the
# warm-up, inside the timed run (jax 0.11.2).
import jax.experimental.pallas.fuser  # noqa: E402, F401
import jax.numpy as jnp  # noqa: E402
import model as model_lib  # noqa: E402
import numpy as np  # noqa: E402

from jaxflash import paged  # noqa: E402

# jaxflash: the paged cache; jax-nn and cudnn: a contiguous cache attended
# by jax.nn.dot_product_attention (its decode steps by XLA or by cuDNN).
ATTENTIONS = ("jaxflash", "jax-nn", "cudnn")


def sample_tokens(logits, key, temperature: float, top_k: int | None):
  """Next tokens ``[batch]`` from ``logits [batch, vocab]``: the argmax at
  ``temperature`` 0, else a draw from ``softmax(logits / temperature)``
  restricted to the ``top_k`` largest logits (all of them for None)."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k is not None and top_k < logits.shape[-1]:
    # Ties with the k-th value stay in: at most a few more candidates.
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def make_caches(cfg: model_lib.GPTConfig, attention: str, prompt_lengths,
                prefill_len: int, new_tokens: int, page_size: int):
  """One empty cache per layer, holding for row ``b`` the ``prefill_len``
  tokens the prefill writes (the padded prompts) and the ``new_tokens -
  1`` the decode steps append after its ``prompt_lengths[b]``."""
  lengths = np.asarray(prompt_lengths)
  batch = len(lengths)
  kv_heads = cfg.kv_heads or cfg.heads
  head_dim = cfg.d_model // cfg.heads
  dtype = jnp.dtype(cfg.dtype)
  need = np.maximum(prefill_len, lengths + new_tokens - 1)
  if attention in ("jax-nn", "cudnn"):
    return tuple(model_lib.ContiguousKVCache.create(
        batch=batch, max_len=int(need.max()), kv_heads=kv_heads,
        head_dim=head_dim, dtype=dtype,
        implementation="xla" if attention == "jax-nn" else "cudnn")
        for _ in range(cfg.layers))
  if attention != "jaxflash":
    raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
  # Each row gets the pages it needs; one page table serves every layer
  # (each layer has its own pages, at the same indices).
  pages = [math.ceil(int(n) / page_size) for n in need]
  allocator = paged.PageAllocator(sum(pages))
  table = np.full((batch, max(pages)), -1, np.int32)
  for b, n in enumerate(pages):
    table[b, :n] = allocator.allocate(n)
  caches = []
  for _ in range(cfg.layers):
    cache = paged.PagedKVCache.create(
        num_pages=allocator.num_pages, page_size=page_size,
        kv_heads=kv_heads, head_dim=head_dim, batch=batch,
        pages_per_sequence=table.shape[1], dtype=dtype)
    caches.append(dataclasses.replace(cache,
                                      page_indices=jnp.asarray(table)))
  return tuple(caches)


@functools.partial(jax.jit, static_argnames=("cfg", "chunk"))
def prefill(params, caches, prompts, prompt_lengths, *, cfg, chunk: int):
  """Writes ``prompts [batch, n * chunk]`` (right-padded) into ``caches``,
  ``chunk`` tokens a step: ``(caches, logits [batch, vocab])``, the
  logits after each row's last prompt token (its position
  ``prompt_lengths[b] - 1``).  The cache then holds ``prompt_lengths[b]``
  tokens per row: the padding after them is overwritten by the decode
  steps before anything reads it (a query never sees keys after it)."""
  model = model_lib.GPT(cfg)
  batch, padded = prompts.shape
  chunks = prompts.reshape(batch, padded // chunk, chunk).swapaxes(0, 1)

  def step(carry, inputs):
    caches, last = carry
    i, tokens = inputs
    logits, caches = model.apply({"params": params}, tokens, None,
                                 cache=caches)
    at = prompt_lengths - 1 - i * chunk
    pick = jnp.take_along_axis(logits, jnp.clip(at, 0, chunk - 1)[
        :, None, None], axis=1)[:, 0]
    last = jnp.where(((at >= 0) & (at < chunk))[:, None], pick, last)
    return (caches, last), None

  last = jnp.zeros((batch, cfg.vocab), jnp.float32)
  (caches, last), _ = jax.lax.scan(
      step, (caches, last), (jnp.arange(padded // chunk), chunks))
  lengths = prompt_lengths.astype(jnp.int32)
  caches = tuple(dataclasses.replace(c, kv_lengths=lengths) for c in caches)
  return caches, last


@functools.partial(jax.jit, static_argnames=(
    "cfg", "new_tokens", "temperature", "top_k", "return_logits"))
def decode(params, caches, logits, key, *, cfg, new_tokens: int,
           temperature: float, top_k: int | None, return_logits: bool):
  """``new_tokens`` tokens per row: the first from the prefill's
  ``logits``, each next one from a decode step (one token per row through
  the model and its cache).  Returns ``tokens [batch, new_tokens]`` and
  with ``return_logits`` the logits each was drawn from ``[batch,
  new_tokens, vocab]`` (else None)."""
  model = model_lib.GPT(cfg)
  keys = jax.random.split(key, new_tokens)
  first = sample_tokens(logits, keys[0], temperature, top_k)

  def step(carry, key):
    caches, token = carry
    logits, caches = model.apply({"params": params}, token[:, None], None,
                                 cache=caches)
    logits = logits[:, 0]
    token = sample_tokens(logits, key, temperature, top_k)
    return (caches, token), (token, logits if return_logits else None)

  _, (rest, rest_logits) = jax.lax.scan(step, (caches, first), keys[1:])
  tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
  if not return_logits:
    return tokens, None
  return tokens, jnp.concatenate([logits[:, None],
                                  rest_logits.swapaxes(0, 1)], axis=1)


class Generation(NamedTuple):
  """What :func:`generate` returns."""

  tokens: np.ndarray          # [batch, new_tokens]
  logits: np.ndarray | None   # [batch, new_tokens, vocab] (return_logits)
  prefill_s: float            # wall time of the prefill (first call: + jit)
  decode_s: float             # of the decode steps (first call: + jit)


def generate(params, cfg: model_lib.GPTConfig, prompts, prompt_lengths, *,
             new_tokens: int, attention: str = "jaxflash",
             page_size: int = 16, prefill_chunk: int = 64,
             temperature: float = 0.0, top_k: int | None = None,
             seed: int = 0, return_logits: bool = False) -> Generation:
  """``new_tokens`` tokens after each row's prompt.

  Args:
    params: the GPT's parameters (``GPT(cfg).init`` or a checkpoint's).
    cfg: the model; ``cfg.attention`` ("triton", "xla") picks the paged
      attention's implementation, ``cfg.interpret`` runs its kernel in
      the Pallas interpreter.
    prompts: ``[batch, max_prompt]`` integer tokens, row ``b`` valid in
      its first ``prompt_lengths[b]`` (at least 1).
    attention: "jaxflash" (paged cache, :func:`jaxflash.paged_attention`)
      or "jax-nn" (contiguous cache, ``jax.nn.dot_product_attention``).
    page_size: tokens per page of the paged cache.
    prefill_chunk: prompt tokens per prefill step (capped at the longest
      prompt); with ``kv_heads`` fewer than ``heads`` each step's query
      tile holds ``chunk x heads / kv_heads`` rows in the paged kernel.
    temperature, top_k: sampling (:func:`sample_tokens`).
    seed: the sampling's random key.
    return_logits: also return the logits of every drawn token.
  """
  prompts = np.asarray(prompts, np.int32)
  lengths = np.asarray(prompt_lengths, np.int32)
  batch, width = prompts.shape
  if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > width:
    raise ValueError(f"prompt_lengths {lengths.tolist()} must be {batch}"
                     f" lengths in [1, {width}]")
  if new_tokens < 1 or prefill_chunk < 1:
    raise ValueError(f"new_tokens={new_tokens} and prefill_chunk="
                     f"{prefill_chunk} must be at least 1")
  longest = int(lengths.max())
  chunk = min(prefill_chunk, longest)
  padded = math.ceil(longest / chunk) * chunk
  tokens = np.zeros((batch, padded), np.int32)
  tokens[:, :longest] = prompts[:, :longest]
  caches = make_caches(cfg, attention, lengths, padded, new_tokens,
                       page_size)
  t0 = time.perf_counter()
  caches, logits = prefill(params, caches, jnp.asarray(tokens),
                           jnp.asarray(lengths), cfg=cfg, chunk=chunk)
  logits = jax.block_until_ready(logits)
  t1 = time.perf_counter()
  out, out_logits = decode(
      params, caches, logits, jax.random.key(seed), cfg=cfg,
      new_tokens=new_tokens, temperature=float(temperature), top_k=top_k,
      return_logits=return_logits)
  out = np.asarray(out)
  t2 = time.perf_counter()
  return Generation(out, None if out_logits is None
                    else np.asarray(out_logits), t1 - t0, t2 - t1)


def load_params(ckpt_dir: str):
  """The parameters of the latest checkpoint that train.py wrote under
  ``ckpt_dir`` (its ``--out``/ckpt)."""
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(os.path.abspath(ckpt_dir))
  step = manager.latest_step()
  if step is None:
    raise ValueError(f"no checkpoint under {ckpt_dir!r}")
  state = manager.restore(step, args=ocp.args.StandardRestore())
  return jax.tree.map(jnp.asarray, state["params"])


def corpus_prompts(batch: int, prompt_len: int, rng, path=None):
  """``[batch, prompt_len]`` byte prompts cut from the corpus at random
  places, and their lengths, uniform in ``[prompt_len / 2,
  prompt_len]`` (at least 1)."""
  docs = data_lib.load_documents(path, limit_bytes=2 * batch * prompt_len
                                 + 100_000)
  blob = np.frombuffer(b"".join(docs), np.uint8)
  if blob.size < prompt_len:
    blob = np.resize(blob, prompt_len)
  starts = rng.integers(0, blob.size - prompt_len + 1, batch)
  prompts = np.stack([blob[s:s + prompt_len] for s in starts]).astype(
      np.int32)
  lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, batch)
  return prompts, lengths.astype(np.int32)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="tiny", choices=list(model_lib.PRESETS))
  ap.add_argument("--ckpt", default=None,
                  help="train.py's checkpoint folder (its --out/ckpt);"
                       " default: fresh parameters")
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--prompt-len", type=int, default=16,
                  help="longest prompt; each row's is uniform in"
                       " [prompt_len / 2, prompt_len]")
  ap.add_argument("--new-tokens", type=int, default=8)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--prefill-chunk", type=int, default=64)
  ap.add_argument("--temperature", type=float, default=0.8,
                  help="0: greedy")
  ap.add_argument("--top-k", type=int, default=40, help="0: no top-k")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--attention", default="both",
                  choices=[*ATTENTIONS, "both", "all"])
  ap.add_argument("--paged-implementation", default="jaxflash",
                  choices=["jaxflash", *paged.IMPLEMENTATIONS],
                  help="paged_attention's implementation: the kernel where"
                       " it serves the call, else XLA (jaxflash); or one")
  ap.add_argument("--interpret", action="store_true",
                  help="run the paged kernel in the Pallas interpreter"
                       " (CPU)")
  ap.add_argument("--data", default=None, help="prompt corpus (data.py)")
  args = ap.parse_args(argv)

  cfg = dataclasses.replace(model_lib.PRESETS[args.preset],
                            attention=args.paged_implementation,
                            interpret=args.interpret, remat=False)
  rng = np.random.default_rng(args.seed)
  prompts, lengths = corpus_prompts(args.batch, args.prompt_len, rng,
                                    args.data)
  if args.ckpt:
    params = load_params(args.ckpt)
  else:
    tok = jnp.zeros((1, 8), jnp.int32)
    params = jax.jit(model_lib.GPT(cfg).init)(jax.random.key(args.seed),
                                              tok, tok)["params"]
  attentions = {"both": ATTENTIONS[:2], "all": ATTENTIONS}.get(
      args.attention, (args.attention,))
  kw = dict(new_tokens=args.new_tokens, page_size=args.page_size,
            prefill_chunk=args.prefill_chunk, temperature=args.temperature,
            top_k=args.top_k or None, seed=args.seed)
  print(f"{args.preset}: batch {args.batch}, prompts of"
        f" {int(lengths.min())}-{int(lengths.max())} tokens,"
        f" {args.new_tokens} new tokens, page size {args.page_size},"
        f" {jax.devices()[0].device_kind}")
  results = {}
  for name in attentions:
    try:
      generate(params, cfg, prompts, lengths, attention=name, **kw)  # jit
    except RuntimeError as e:  # e.g. cuDNN without a GPU: the others run
      print(f"{name}: {str(e).splitlines()[0]}")
      continue
    results[name] = generate(params, cfg, prompts, lengths, attention=name,
                             **kw)
  # The first new token comes from the prefill; the decode steps make the
  # other new_tokens - 1 per row.
  steps = args.batch * (args.new_tokens - 1)
  print("\n| attention | prefill s | decode s | decode tokens/s"
        " (x jax-nn's) |")
  print("|---|---|---|---|")
  base = results.get("jax-nn")
  for name, r in results.items():
    tps = steps / r.decode_s if steps else float("nan")
    speed = ""
    if base is not None and name != "jax-nn" and steps:
      speed = f" ({base.decode_s / r.decode_s:.2f}x)"
    print(f"| {name} | {r.prefill_s:.3f} | {r.decode_s:.3f} |"
          f" {tps:,.0f}{speed} |")
  for name in results:
    if name != "jaxflash" and "jaxflash" in results:
      same = (results["jaxflash"].tokens == results[name].tokens).mean()
      print(f"\nthe same tokens from jaxflash and {name}: {same:.1%}")
  first = next(iter(results.values()))
  text = lambda t: bytes(np.asarray(t, np.uint8)).decode("utf-8",
                                                         errors="replace")
  print(f"\nrow 0's prompt: {text(prompts[0, :lengths[0]])!r}\n"
        f"and its new tokens: {text(first.tokens[0])!r}")
  return results


if __name__ == "__main__":
  main()
