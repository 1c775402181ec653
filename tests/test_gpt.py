"""The GPT example: data packing, training on device meshes, checkpoints."""

import dataclasses
import functools
import os
import sys

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples",
                                "gpt"))
import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402
import train as train_lib  # noqa: E402

SMALL = dict(layers=1, d_model=64, heads=4, kv_heads=2, seq_len=64)


@settings(max_examples=50, deadline=None)
@given(docs=st.lists(st.binary(min_size=1, max_size=40), min_size=1,
                     max_size=30),
       seq_len=st.integers(2, 33))
def test_segments_never_cross_documents(docs, seq_len):
  total = sum(len(d) for d in docs)
  if total < seq_len + 1:
    return
  tokens, seg = data_lib.pack(docs, seq_len)
  doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
  doc_of = doc_of[:tokens.size].reshape(tokens.shape)
  stream = np.frombuffer(b"".join(docs), np.uint8)[:tokens.size]
  np.testing.assert_array_equal(tokens.reshape(-1), stream)
  for r in range(len(tokens)):
    # Same segment id <=> same document, within a row.
    same_seg = seg[r][:, None] == seg[r][None, :]
    same_doc = doc_of[r][:, None] == doc_of[r][None, :]
    np.testing.assert_array_equal(same_seg, same_doc)
    assert seg[r].min() >= 1


def test_split_and_batches_are_deterministic():
  docs = [bytes([i]) * 50 for i in range(40)]
  train, val = data_lib.split(docs)
  assert len(val) == 2 and val[0] == docs[19]
  tokens, seg = data_lib.pack(train, 31)
  b = data_lib.Batches(tokens, seg, 4, seed=3)
  np.testing.assert_array_equal(b.get(5)[0], b.get(5)[0])
  halves = [data_lib.Batches(tokens, seg, 4, 3, i, 2).get(5)[0]
            for i in range(2)]
  np.testing.assert_array_equal(np.concatenate(halves), b.get(5)[0])


def test_rechunk_cuts_the_joined_corpus():
  docs = [b"abc", b"defgh", b"ij"]
  assert data_lib.rechunk(docs, 4) == [b"abcd", b"efgh", b"ij"]
  assert data_lib.rechunk(docs, 100) == [b"abcdefghij"]
  # Packed at seq_len 3 (rows of 4 bytes), each row is one document.
  _, seg = data_lib.pack(data_lib.rechunk(docs, 4), 3)
  assert (seg == 1).all()
  with pytest.raises(ValueError, match="got 0"):
    data_lib.rechunk(docs, 0)


def test_doc_bytes_flag_rechunks_the_corpus(tmp_path, monkeypatch):
  """train.py --doc-bytes packs documents of that size."""
  sizes = []
  real_pack = data_lib.pack

  def spy(docs, seq_len):
    sizes.append([len(d) for d in docs])
    return real_pack(docs, seq_len)

  monkeypatch.setattr(train_lib.data_lib, "pack", spy)
  train_lib.main(["--steps", "1", "--batch", "8", "--seq-len", "64",
                  "--limit-bytes", "200000", "--eval-every", "0",
                  "--sample-bytes", "0", "--mesh", "data=-1",
                  "--doc-bytes", "1000", "--out", str(tmp_path)])
  train_sizes, val_sizes = sizes
  assert set(train_sizes[:-1]) == {1000} and val_sizes[0] == 1000


def test_parse_mesh():
  assert train_lib.parse_mesh("data=2,tensor=-1", 8) == dict(
      data=2, fsdp=1, tensor=4, context=1)
  with pytest.raises(ValueError, match="does not cover 8 devices"):
    train_lib.parse_mesh("data=3", 8)
  with pytest.raises(ValueError, match="'pipe' is not one of"):
    train_lib.parse_mesh("pipe=2", 8)


def _trainer(mesh_text, attention="jaxflash"):
  # A context axis: the kernels (interpreted on a CPU) run context
  # parallelism by themselves; the one-device run is XLA's.
  cfg = dataclasses.replace(model_lib.GPTConfig(**SMALL), attention=attention,
                            interpret="context" in mesh_text)
  mesh = train_lib.make_mesh(train_lib.parse_mesh(mesh_text,
                                                  jax.device_count()))
  import optax
  return train_lib.Trainer(cfg, mesh, optax.adam(3e-3))


def _run_steps(trainer, steps=4, batch=8):
  docs = data_lib.load_documents(limit_bytes=200_000)
  tokens, seg = data_lib.pack(docs, trainer.cfg.seq_len)
  batches = data_lib.Batches(tokens, seg, batch)
  state, shardings = trainer.init_state(batch, seed=0)
  step = trainer.make_step(shardings)
  losses = []
  for i in range(steps):
    state, loss = step(state, *trainer.global_batch(*batches.get(i)))
    losses.append(float(loss))
  return losses, state


@functools.cache
def _one_device_run(steps=4):
  """The steps on one device (the comparison of every mesh), run once."""
  t = _trainer("data=8")
  one = train_lib.Trainer(t.cfg, jax.make_mesh(
      (1,) * len(train_lib.AXES), train_lib.AXES, devices=jax.devices()[:1],
      axis_types=(jax.sharding.AxisType.Auto,) * len(train_lib.AXES)), t.tx)
  return _run_steps(one, steps=steps)


@functools.cache
def _data_parallel_losses(steps=3):
  """Losses of the default attention on ``data=8`` (the comparison of
  --remat and --attention jax-xla), run once."""
  return _run_steps(_trainer("data=8"), steps=steps)[0]


@pytest.mark.parametrize("mesh", [
    "data=2,fsdp=2,tensor=2",
    # Data parallelism alone (also above), the context axis (its attention
    # per commit in test_context.py) and every axis at once: `slow`.
    pytest.param("data=4,context=2", marks=pytest.mark.slow),
    pytest.param("data=8", marks=pytest.mark.slow),
    pytest.param("fsdp=2,tensor=2,context=2", marks=pytest.mark.slow)])
def test_mesh_training_matches_one_device(mesh):
  """Data, FSDP, tensor and context (flash_attention's own context
  parallelism under the trainer's jit) parallel steps equal the
  one-device steps."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  losses, state = _run_steps(_trainer(mesh))
  assert losses[-1] < losses[0]
  losses1, state1 = _one_device_run()
  np.testing.assert_allclose(losses, losses1, rtol=2e-5)
  for a, b in zip(jax.tree.leaves(state["params"]),
                  jax.tree.leaves(state1["params"])):
    # Adam divides by sqrt(v): reduction-order differences of the sharded
    # gradients grow to ~1e-5 in the weights after a few steps.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4,
                               rtol=1e-3)


@pytest.mark.slow
def test_checkpoint_resume_continues_the_curve(tmp_path):
  args = ["--steps", "4", "--batch", "8", "--seq-len", "64",
          "--limit-bytes", "200000", "--eval-every", "0",
          "--sample-bytes", "4", "--mesh", "data=-1"]
  straight = train_lib.main(args + ["--out", str(tmp_path / "a")])
  train_lib.main(args[:1] + ["2"] + args[2:] + [
      "--out", str(tmp_path / "b"), "--ckpt-every", "2"])
  resumed = train_lib.main(args + ["--out", str(tmp_path / "b"),
                                   "--ckpt-every", "2"])
  want = {h["step"]: h["loss"] for h in straight}
  got = {h["step"]: h["loss"] for h in resumed}
  assert 3 in got and 0 not in got  # resumed at step 2
  np.testing.assert_allclose(got[3], want[3], rtol=1e-5)
  assert (tmp_path / "b" / "loss.png").exists()


def _free_port():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # (two processes: the longest CPU test)
def test_two_processes_match_one(tmp_path):
  """Two processes of 4 CPU devices each (gloo, local coordinator) train
  the same losses as one process of 8 devices."""
  import json
  import subprocess
  script = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt",
                        "train.py")
  common = ["--steps", "3", "--batch", "8", "--seq-len", "64",
            "--limit-bytes", "200000", "--eval-every", "0",
            "--sample-bytes", "2", "--mesh", "data=-1"]
  root = os.path.join(os.path.dirname(__file__), "..")
  env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
  port = _free_port()
  procs = []
  for i in range(2):
    e = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs.append(subprocess.Popen(
        [sys.executable, script, *common, "--out", str(tmp_path / f"p{i}"),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i), "--losses-to", str(tmp_path / "multi")],
        env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs[0][-2000:]
  e = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  single = subprocess.run(
      [sys.executable, script, *common, "--out", str(tmp_path / "single"),
       "--losses-to", str(tmp_path / "single")], env=e, capture_output=True,
      text=True, timeout=600)
  assert single.returncode == 0, single.stderr[-2000:]
  multi = json.load(open(tmp_path / "multi.0"))
  one = json.load(open(tmp_path / "single.0"))
  np.testing.assert_allclose([h["loss"] for h in multi],
                             [h["loss"] for h in one], rtol=1e-5)


@pytest.mark.slow
def test_pmap_script_runs():
  import train_pmap
  if jax.local_device_count() < 2:
    pytest.skip("needs several devices")
  losses = train_pmap.main(["--steps", "4", "--batch", "8", "--seq-len",
                            "64", "--limit-bytes", "200000"])
  assert len(losses) == 4 and np.isfinite(losses).all()
  assert losses[-1] < losses[0]


def test_remat_trains_the_same_losses():
  """--remat recomputes block activations in the backward: same losses."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  a = _data_parallel_losses()
  t = _trainer("data=8")
  t = train_lib.Trainer(dataclasses.replace(t.cfg, remat=True), t.mesh, t.tx)
  b, _ = _run_steps(t, steps=3)
  np.testing.assert_allclose(a, b, rtol=1e-5)


def test_context_axis_needs_whole_blocks():
  with pytest.raises(ValueError, match="multiple of context=4"):
    train_lib.Trainer(dataclasses.replace(model_lib.GPTConfig(**SMALL),
                                          seq_len=62),
                      train_lib.make_mesh(train_lib.parse_mesh(
                          "data=2,context=4", 8)), None)


def test_jax_nn_attention_path_matches():
  """--attention jax-xla (jax.nn with a dense segment mask) trains the same
  losses as jaxflash (the comparison path of the benchmarks)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  a = _data_parallel_losses()
  b, _ = _run_steps(_trainer("data=8", attention="jax-xla"), steps=3)
  np.testing.assert_allclose(a, b, rtol=1e-4)


@pytest.mark.slow  # 15 s; make test-all
def test_compare_script_reports_rows(tmp_path):
  """examples/gpt/compare.py: one row per (preset, attention), a failing
  attention (cuDNN without a GPU) is a row with its error."""
  import compare
  attention = "xla,cudnn" if jax.default_backend() != "gpu" else "xla"
  rc = compare.main(["--presets", "tiny", "--attention", attention,
                     "--steps", "11", "--batch", "8", "--limit-bytes",
                     "100000", "--out", str(tmp_path)])
  rows = {r["attention"]: r for r in
          __import__("json").load(open(tmp_path / "gpt-compare.json"))[
              "results"]}
  assert rows["xla"]["error"] is None and rows["xla"]["tokens_per_s"] > 0
  if "cudnn" in rows:
    assert rc == 1 and rows["cudnn"]["error"]
  assert "| tiny | xla |" in (tmp_path / "gpt-compare.md").read_text()


@pytest.mark.slow  # 21 s; test_compare_script_reports_rows runs per commit
def test_compare_script_scaling(tmp_path):
  """--meshes: each mesh runs on exactly its devices, the batch grows with
  data parallelism, and efficiency is against the one-device run."""
  import compare
  rc = compare.main(["--presets", "tiny", "--attention", "xla", "--meshes",
                     "data=1;data=2", "--steps", "11", "--batch", "4",
                     "--limit-bytes", "100000", "--out", str(tmp_path)])
  assert rc == 0
  one, two = __import__("json").load(open(tmp_path / "gpt-compare.json"))[
      "results"]
  assert (one["devices"], one["batch"]) == (1, 4)
  assert (two["devices"], two["batch"]) == (2, 8)
  assert one["scaling_efficiency"] == 1.0
  assert two["scaling_efficiency"] == two["tokens_per_s"] / (
      2 * one["tokens_per_s"])


def test_compare_script_run_timeout(tmp_path):
  """--run-timeout: a run past it is a row with the error, not a hang."""
  import compare
  rc = compare.main(["--presets", "tiny", "--attention", "xla", "--steps",
                     "11", "--batch", "4", "--run-timeout", "0.5",
                     "--out", str(tmp_path)])
  (row,) = __import__("json").load(open(tmp_path / "gpt-compare.json"))[
      "results"]
  assert rc == 1 and "--run-timeout 0.5" in row["error"]
  assert row["tokens_per_s"] is None and row["wall_s"] >= 0.5


def test_compare_error_line_skips_jax_notes():
  import compare
  text = """Traceback (most recent call last):
  File "train.py", line 3, in <module>
ValueError: Cannot lower jaxpr with effects: {InternalMutableArrayEffect}

The above exception was the direct cause of the following exception:

jax.errors.JaxRuntimeError: INTERNAL: custom_partitioner: Traceback
--------------------
""" + ("For simplicity, JAX has removed its internal frames from the"
       " traceback of the following exception.")
  line = compare.error_line(text)
  assert line.startswith("ValueError: Cannot lower jaxpr with effects")
  assert line.endswith("JaxRuntimeError: INTERNAL: custom_partitioner:"
                       " Traceback")
  assert compare.error_line("just one line") == "just one line"
  assert compare.error_line("") is None


def test_every_preset_has_a_learning_rate():
  assert set(train_lib.PEAK_LR) == set(model_lib.PRESETS)
  assert train_lib.PEAK_LR["tiny"] == 3e-3  # what `make demo` was tuned on


def test_mfu_counts_every_device(monkeypatch):
  """MFU is the fraction of all devices' peak: twice the devices at the
  same global tokens/s is half the utilisation."""
  class Dev:
    device_kind = "NVIDIA H200"
  monkeypatch.setattr(train_lib.jax, "devices", lambda: [Dev()])
  monkeypatch.setattr(train_lib.jax, "device_count", lambda: 1)
  one = train_lib._mfu(1e5, 1e9)
  np.testing.assert_allclose(one, 1e14 / 989e12)
  monkeypatch.setattr(train_lib.jax, "device_count", lambda: 2)
  np.testing.assert_allclose(train_lib._mfu(1e5, 1e9), one / 2)
  Dev.device_kind = "cpu"
  assert np.isnan(train_lib._mfu(1e5, 1e9))


def test_convergence_gaps():
  """The attention gap compares attentions at the same seed, the seed gap
  the reference attention's seeds, both from --skip on."""
  import convergence
  row = lambda a, s, losses: dict(attention=a, seed=s, error=None,
                                  steps=[0, 10, 20], losses=losses)
  rows = [row("jaxflash", 0, [5.5, 3.0, 2.0]),
          row("jaxflash", 1, [5.5, 3.2, 2.1]),
          row("xla", 0, [5.5, 3.05, 1.9]),
          row("xla", 1, [9.0, 3.2, 2.1]),
          dict(attention="cudnn", seed=0, error="no GPU", steps=[],
               losses=[])]
  got = convergence.gaps(rows, skip=10)
  assert got["reference"] == "jaxflash" and got["from_step"] == 10
  np.testing.assert_allclose(got["attention_gap"]["xla"], 0.1)
  np.testing.assert_allclose(got["seed_gap"], 0.2)
  # xla - jaxflash at steps 10 and 20: seed 0 +0.05, -0.1; seed 1 0, 0.
  np.testing.assert_allclose(got["mean_difference"]["xla"], -0.0125)
  np.testing.assert_allclose(got["fraction_below"]["xla"], 0.25)
  assert "cudnn" not in got["attention_gap"]  # failed runs are left out
  assert "cudnn" not in got["mean_difference"]
  assert convergence.gaps(rows[:1], skip=0)["seed_gap"] is None


@pytest.mark.slow  # 84 training steps; test_convergence_run_timeout and
# test_convergence_gaps run the script and its summary every commit.
def test_convergence_script_end_to_end(tmp_path):
  """examples/gpt/convergence.py trains each (attention, seed), writes the
  curves, the summary and the plot."""
  import json

  import convergence
  rc = convergence.main(["--preset", "tiny", "--attention", "xla,jax-xla",
                         "--seeds", "0,1", "--steps", "21", "--batch", "8",
                         "--skip", "0", "--limit-bytes", "100000",
                         "--out", str(tmp_path)])
  assert rc == 0
  got = json.load(open(tmp_path / "convergence.json"))
  assert [(r["attention"], r["seed"]) for r in got["runs"]] == [
      ("xla", 0), ("xla", 1), ("jax-xla", 0), ("jax-xla", 1)]
  assert all(r["steps"] == [0, 10, 20] for r in got["runs"])
  # The same seed: the same data and init; the attentions differ only by
  # rounding, far below the seed-to-seed difference.
  gap = got["summary"]["attention_gap"]["jax-xla"]
  assert gap < 1e-2 < got["summary"]["seed_gap"]
  assert (tmp_path / "convergence.png").exists()
  assert "| `jax-xla` vs `xla` |" in (tmp_path / "convergence.md").read_text()


def test_convergence_run_timeout(tmp_path):
  """--run-timeout: a run past it is a row with the error; the summary and
  the files are still written."""
  import json

  import convergence
  rc = convergence.main(["--preset", "tiny", "--attention", "xla",
                         "--seeds", "0", "--steps", "11", "--batch", "8",
                         "--run-timeout", "0.5", "--out", str(tmp_path)])
  (row,) = json.load(open(tmp_path / "convergence.json"))["runs"]
  assert rc == 1 and "--run-timeout 0.5" in row["error"]
  assert (tmp_path / "convergence.md").exists()


def _full_forward_logits(params, cfg, prompts, lengths, tokens):
  """Logits of the training forward over each row's prompt and new
  tokens (right-padded; causal, so the padding after a row changes
  nothing before it), at the positions that drew the new tokens."""
  batch, new = tokens.shape
  seq = np.zeros((batch, int(lengths.max()) + new), np.int32)
  for b in range(batch):
    seq[b, :lengths[b]] = prompts[b, :lengths[b]]
    seq[b, lengths[b]:lengths[b] + new] = tokens[b]
  logits = model_lib.GPT(cfg).apply({"params": params}, seq,
                                    np.ones_like(seq))
  at = lengths[:, None] - 1 + np.arange(new)
  return np.take_along_axis(np.asarray(logits), at[:, :, None], axis=1)


# Slow (11 s): test_generate_script_runs compares the paths per commit.
@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 8])
def test_generation_matches_the_full_forward(window):
  """Greedy generation through the paged cache (the Triton kernel in the
  interpreter, GQA 4:2, pages of 16 with prompts of 37, 20 and 29 tokens
  prefilled 16 at a time) gives the tokens of the contiguous jax.nn path,
  and the logits of the training forward recomputed over the grown
  sequences (tokens: its argmax); also with a sliding window shorter
  than the prompts."""
  import generate
  cfg = dataclasses.replace(model_lib.GPTConfig(**SMALL), layers=2,
                            window=window, interpret=True)
  tok = np.zeros((1, 8), np.int32)
  params = model_lib.GPT(cfg).init(jax.random.key(0), tok, tok)["params"]
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab, (3, 37)).astype(np.int32)
  lengths = np.array([37, 20, 29], np.int32)
  kw = dict(new_tokens=6, page_size=16, prefill_chunk=16,
            return_logits=True)
  got = generate.generate(params, cfg, prompts, lengths,
                          attention="jaxflash", **kw)
  contiguous = generate.generate(params, cfg, prompts, lengths,
                                 attention="jax-nn", **kw)
  np.testing.assert_array_equal(got.tokens, contiguous.tokens)
  np.testing.assert_allclose(got.logits, contiguous.logits, atol=1e-5)
  full = _full_forward_logits(
      params, dataclasses.replace(cfg, interpret=False), prompts, lengths,
      got.tokens)
  np.testing.assert_allclose(got.logits, full, atol=1e-5)
  np.testing.assert_array_equal(got.tokens, full.argmax(-1))


def test_sample_tokens():
  """Temperature 0 is the argmax; top-k draws only among the k largest
  logits, and top-k 1 is the argmax at any temperature."""
  import generate
  logits = jax.random.normal(jax.random.key(0), (4, 256))
  greedy = np.asarray(logits).argmax(-1)
  key = jax.random.key(1)
  np.testing.assert_array_equal(
      generate.sample_tokens(logits, key, 0.0, None), greedy)
  np.testing.assert_array_equal(
      generate.sample_tokens(logits, key, 5.0, 1), greedy)
  draws = jax.vmap(lambda k: generate.sample_tokens(logits, k, 5.0, 3))(
      jax.random.split(key, 64))
  top3 = np.argsort(np.asarray(logits), -1)[:, -3:]
  for b in range(4):
    assert set(np.asarray(draws[:, b]).tolist()) <= set(top3[b].tolist())


def test_generate_script_runs(capsys):
  """examples/gpt/generate.py at a tiny size on CPU (the paged kernel in
  the interpreter): both attentions, sampled with temperature and top-k
  from the same keys, draw the same tokens; tokens/s printed for each."""
  import generate
  results = generate.main(["--batch", "2", "--prompt-len", "16",
                           "--new-tokens", "4", "--interpret"])
  assert set(results) == {"jaxflash", "jax-nn"}
  assert results["jaxflash"].tokens.shape == (2, 4)
  np.testing.assert_array_equal(results["jaxflash"].tokens,
                                results["jax-nn"].tokens)
  out = capsys.readouterr().out
  assert "| jaxflash |" in out and "| jax-nn |" in out


@pytest.mark.slow  # the kernels' dropout is tested per commit (test_dropout)
def test_attention_dropout_trains():
  """--attn-dropout: the training steps drop attention probabilities in
  the kernels (a loss unlike the run without dropout, and finite), the
  evaluation does not (the same loss as the model without dropout)."""
  t = _trainer("data=8")
  base, state = _run_steps(t, steps=2)
  t_drop = train_lib.Trainer(dataclasses.replace(t.cfg, attn_dropout=0.1),
                             t.mesh, t.tx)
  drop, state_d = _run_steps(t_drop, steps=2)
  assert np.isfinite(drop).all() and not np.allclose(drop, base)
  docs = data_lib.load_documents(limit_bytes=50_000)
  tokens, seg = data_lib.pack(docs, t.cfg.seq_len)
  batch = t.global_batch(tokens[:8], seg[:8])
  ev = t.make_eval(jax.tree.map(lambda x: x.sharding, state))
  ev_d = t_drop.make_eval(jax.tree.map(lambda x: x.sharding, state_d))
  np.testing.assert_allclose(ev_d(state_d["params"], *batch),
                             ev(state_d["params"], *batch), rtol=1e-6)
