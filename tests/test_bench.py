"""The benchmark's FLOP counting, grid parsing, writers and error rows."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _timing
from jaxflash.bench import __main__ as bench_main
from jaxflash.bench import core, impls, report
from jaxflash.bench import decode as decode_bench


def test_flops_match_anchor_convention():
  # ANCHORS.md: 16384 tokens, width 2048, head_dim 128, seq 4096 -> batch 4,
  # heads 16; forward 4*B*H*S*S*D.
  s = core.Shape(4, 4096, 4096, 16, 16, 128, causal=False)
  assert core.flops(s, "fwd") == 4 * 4 * 16 * 4096 * 4096 * 128
  causal = core.Shape(4, 4096, 4096, 16, 16, 128, causal=True)
  assert core.flops(causal, "fwd") == core.flops(s, "fwd") / 2
  assert core.flops(causal, "fwd_bwd") == 3.5 * core.flops(causal, "fwd")
  with pytest.raises(ValueError, match="mode='bwd'"):
    core.flops(s, "bwd")


def test_grid_follows_tokens_and_width():
  shapes = core.grid(head_dims=[64, 256], seqs=[1024, 16384],
                     causal=[False, True], tokens=16384, width=2048,
                     kv_ratio=2)
  assert len(shapes) == 8
  first = shapes[0]
  assert (first.batch, first.seq_q, first.heads, first.kv_heads,
          first.head_dim) == (16, 1024, 32, 16, 64)
  last = shapes[-1]
  assert (last.batch, last.heads, last.kv_heads, last.causal) == (1, 8, 4,
                                                                  True)


@pytest.mark.parametrize("text,want", [("64,128", [64, 128]), ("256", [256]),
                                       (" 1, 2 ,", [1, 2])])
def test_parse_int_list(text, want):
  assert core.parse_int_list(text) == want


@pytest.mark.parametrize("bad", ["", "a,b", "0", "-4"])
def test_parse_int_list_rejects(bad):
  with pytest.raises(ValueError, match=repr(bad).replace("'", "")[:1]):
    core.parse_int_list(bad)


def test_parse_causal_and_mask():
  assert core.parse_causal("both") == [False, True]
  assert core.parse_causal("on") == [True]
  with pytest.raises(ValueError, match="causal='maybe'"):
    core.parse_causal("maybe")
  assert core.parse_mask("none") is None
  assert core.parse_mask("segments:8") == "segments:8"
  assert core.parse_mask("dropout:10") == "dropout:10"
  for bad in ("segments", "window:x", "blocks:2", "window:0",
              "flashmask-doc", "biases", "dropout:0", "dropout:100"):
    with pytest.raises(ValueError, match="must be none, segments:N"):
      core.parse_mask(bad)
  # The dense and FlashMask kinds: what each gives flash_attention.
  for kind, key, kind_of in (
      ("bias", "bias", jax.Array), ("dense-segments:4", "mask", jax.Array),
      *((f"{k}:4", "mask", jaxflash.FlashMask)
        for k in core.FLASHMASK_KINDS)):
    shape = core.Shape(2, 64, 64, 2, 2, 32, causal=False,
                       mask=core.parse_mask(kind))
    got = impls.mask_kwargs(shape)[key]
    assert isinstance(got, kind_of), kind
    if kind_of is jaxflash.FlashMask:
      assert impls.flashmask_dense(got, shape).shape[-2:] == (64, 64)
  with pytest.raises(ValueError, match="not a multiple of head_dim=96"):
    core.grid(head_dims=[96], seqs=[64], causal=[False], tokens=64,
              width=2048)


def _rows():
  s = core.Shape(4, 4096, 4096, 16, 16, 128, causal=True)
  return [
      core.record(s, "jaxflash-triton", "fwd", ms=0.5, peak_bytes=2**20),
      core.record(s, "cudnn", "fwd", ms=0.4),
      core.record(s, "tokamax-mosaic", "fwd", error="ImportError: nope"),
  ]


def test_records_and_ratio():
  rows = _rows()
  assert rows[0]["tflops"] == pytest.approx(
      core.flops(core.Shape(4, 4096, 4096, 16, 16, 128, True), "fwd")
      / 0.5e-3 / 1e12)
  assert rows[2]["tflops"] is None and rows[2]["ms"] is None
  best = report.best_other(rows)
  assert report.ratio(rows[0], best) == pytest.approx(0.4 / 0.5)
  assert report.ratio(rows[1], best) is None


def test_writers(tmp_path):
  rows = _rows()
  meta = dict(jax_version="0.11.2", device_kind="NVIDIA H200",
              device_count=1, commit="abc1234", date="2026-11-30",
              flop_formula=core.FLOP_FORMULA)
  path = tmp_path / "r.json"
  report.write_json(str(path), meta, rows)
  data = json.loads(path.read_text())
  for key in ("jax_version", "device_kind", "device_count", "commit", "date",
              "flop_formula", "results"):
    assert key in data
  assert set(data["results"][0]) == {
      "impl", "model", "batch", "seq_q", "seq_k", "heads", "kv_heads",
      "head_dim", "causal", "dtype", "mask", "mode", "ms", "tflops",
      "peak_bytes", "max_abs_err", "error", "samples_ms", "same_program_as",
      "paired_with", "tiles_skipped"}
  meta2, rows2 = report.read_json(str(path))
  assert rows2 == rows and meta2["commit"] == "abc1234"
  md = report.markdown(meta, rows)
  assert ("| b4 h16/16 | 128 | 4096 | y | - | fwd | jaxflash-triton | 0.500 |"
          in md)
  assert "0.80 vs cudnn" in md and "ImportError: nope" in md
  assert "ratio to best other" in report.terminal_table(rows)
  assert report.plot(str(tmp_path / "r.png"), meta, rows)
  assert (tmp_path / "r.png").stat().st_size > 1000


def _timed(impl, samples_ms, head_dim=128, causal=False):
  shape = core.Shape(4, 4096, 4096, 16, 16, head_dim, causal)
  ms = sorted(samples_ms)[len(samples_ms) // 2]
  return core.record(shape, impl, "fwd", ms=ms, samples_ms=samples_ms)


def test_paired_rows_compare_round_by_round():
  """Per round the other call's time over the row's, then the median and
  range: against the best anchor (by median) and, for a variant, its
  base row. Rows without samples, failed rows and lists of another
  length give no pair."""
  j = _timed("jaxflash-mosaic_gpu", [1.0, 2.0, 1.0])
  v = _timed("jaxflash-mosaic_gpu[v]", [0.5, 1.0, 1.25])
  cudnn = _timed("cudnn", [1.1, 2.2, 0.9])
  tok = _timed("tokamax-mosaic", [1.2, 2.4, 1.5])
  other_shape = _timed("cudnn", [1.0, 1.0, 1.0], head_dim=64)
  short = _timed("jaxflash-mosaic_gpu[s]", [1.0, 1.0])
  bare = core.record(core.Shape(4, 4096, 4096, 16, 16, 128, False),
                     "jaxflash-mosaic_gpu[b]", "fwd", ms=1.0)
  got = {(p["impl"], p["against"]): p for p in report.paired_rows(
      [j, v, cudnn, tok, other_shape, short, bare])}
  assert set(got) == {("jaxflash-mosaic_gpu", "cudnn"),
                      ("jaxflash-mosaic_gpu[v]", "cudnn"),
                      ("jaxflash-mosaic_gpu[v]", "jaxflash-mosaic_gpu")}
  p = got["jaxflash-mosaic_gpu", "cudnn"]  # ratios 1.1, 1.1, 0.9
  assert p["median"] == pytest.approx(1.1)
  assert (p["low"], p["high"], p["rounds"]) == (
      pytest.approx(0.9), pytest.approx(1.1), 3)
  p = got["jaxflash-mosaic_gpu[v]", "jaxflash-mosaic_gpu"]  # 2, 2, 0.8
  assert p["median"] == pytest.approx(2.0) and p["low"] == pytest.approx(0.8)
  # Even counts take the mean of the middle two.
  a = _timed("jaxflash-mosaic_gpu", [1.0, 1.0, 1.0, 1.0])
  b = _timed("cudnn", [1.0, 2.0, 3.0, 4.0])
  (p,) = report.paired_rows([a, b])
  assert p["median"] == pytest.approx(2.5)
  assert report.paired_rows(_rows()) == []  # no samples kept
  md = report.markdown(dict(jax_version="0.11.2", device_kind="NVIDIA H200",
                            device_count=1, commit="abc1234",
                            date="2026-12-05",
                            flop_formula=core.FLOP_FORMULA), [j, v, cudnn])
  assert ("| 128 | 4096 | n | - | fwd | jaxflash-mosaic_gpu[v] |"
          " jaxflash-mosaic_gpu | 2.000 | 0.800-2.000 | 3 |") in md
  assert "paired, round by round" in report.terminal_table([j, v, cudnn])


def test_paired_rows_follow_paired_with():
  """A variant row naming ``paired_with`` (--tuned-for runs) is paired
  with that row instead of its base row."""
  base = _timed("jaxflash-mosaic_gpu", [2.0, 2.0, 2.0])
  ref = _timed("jaxflash-mosaic_gpu[h200]", [1.0, 1.1, 1.2])
  v = dict(_timed("jaxflash-mosaic_gpu[io]", [0.5, 0.55, 0.6]),
           paired_with="jaxflash-mosaic_gpu[h200]")
  got = {(p["impl"], p["against"]): p["median"]
         for p in report.paired_rows([base, ref, v])}
  assert got[("jaxflash-mosaic_gpu[io]", "jaxflash-mosaic_gpu[h200]")] == (
      pytest.approx(2.0))
  assert ("jaxflash-mosaic_gpu[io]", "jaxflash-mosaic_gpu") not in got
  assert got[("jaxflash-mosaic_gpu[h200]", "jaxflash-mosaic_gpu")] == (
      pytest.approx(2.0 / 1.1))


def test_paired_rows_stay_within_a_run(tmp_path):
  """Merged runs of one shape (e.g. anchors in one call, a variant in
  another) share no rounds: no pair across them, and merging a merged
  file keeps its runs apart."""
  meta = dict(jax_version="0.11.2", device_kind="NVIDIA H200",
              device_count=1, commit="abc1234", date="2026-12-05",
              flop_formula=core.FLOP_FORMULA)
  a, b, m, n = (str(tmp_path / f"{x}.json") for x in "abmn")
  report.write_json(a, meta, [_timed("cudnn", [1.0, 1.0, 1.0])])
  report.write_json(b, meta, [_timed("jaxflash-mosaic_gpu", [0.5, 0.5, 0.5]),
                              _timed("jaxflash-mosaic_gpu[v]", [1.0] * 3)])
  _, merged = report.merge([a, b])
  pairs = report.paired_rows(merged)
  assert [(p["impl"], p["against"]) for p in pairs] == [
      ("jaxflash-mosaic_gpu[v]", "jaxflash-mosaic_gpu")]
  report.write_json(m, meta, merged)
  report.write_json(n, meta, [_timed("cudnn", [1.0, 1.0, 1.0])])
  _, again = report.merge([m, n])
  assert [r["run"] for r in again] == ["0.0", "0.1", "0.1", "1"]
  assert len(report.paired_rows(again)) == 1


class _Clock:
  """A fake ``time.perf_counter`` for core.time_interleaved: each call of
  a timed function advances it by that call's duration (seconds), so the
  timer's results are known exactly."""

  def __init__(self, monkeypatch):
    self.now = 1000.0
    self.count = {}
    monkeypatch.setattr(_timing, "time", self)

  def perf_counter(self):
    return self.now

  def call(self, name, durations):
    """``(fn, args)``: the i-th call of ``fn`` takes ``durations[i]``
    (the last one repeats)."""
    def fn(x):
      i = self.count[name] = self.count.get(name, -1) + 1
      self.now += durations[min(i, len(durations) - 1)]
      return x
    return fn, (jnp.ones(1),)


def test_interleaved_timing_keeps_aligned_samples(monkeypatch):
  """Samples in seconds per call, round by round (entry r of every list
  is round r), the median as the call's time; a failing call is left
  out of the samples."""
  clock = _Clock(monkeypatch)
  ms = lambda *xs: [x / 1000 for x in xs]
  # Two warm-up calls each (compile; one timed for the repetitions),
  # then one call per round (min_sample_s=0: one repetition).
  calls = {"ok": clock.call("ok", ms(50, 9, 3, 1, 4, 1, 5)),
           "also": clock.call("also", ms(50, 9, 2, 7, 1, 8, 2)),
           "bad": (lambda x: 1 / 0, (jnp.ones(4),))}
  per = {}
  got = core.time_interleaved(calls, samples=5, min_sample_s=0.0,
                              samples_out=per)
  assert set(per) == {"ok", "also"}
  assert per["ok"] == pytest.approx(ms(3, 1, 4, 1, 5))
  assert per["also"] == pytest.approx(ms(2, 7, 1, 8, 2))
  assert got["ok"] == pytest.approx(0.003)
  assert got["also"] == pytest.approx(0.002)
  assert isinstance(got["bad"], ZeroDivisionError)


def test_interleaved_timing_repeats_short_calls(monkeypatch):
  """A call shorter than min_sample_s is repeated within each sample
  (as many times as its timed warm-up call fits), and the sample is the
  time per call."""
  clock = _Clock(monkeypatch)
  calls = {"short": clock.call("short", [0.5, 0.002]),
           "long": clock.call("long", [0.5, 0.05])}
  per = {}
  got = core.time_interleaved(calls, samples=3, min_sample_s=0.01,
                              samples_out=per)
  assert got == pytest.approx({"short": 0.002, "long": 0.05})
  assert per["short"] == pytest.approx([0.002] * 3)
  # 2 warm-up calls, then 3 samples of 5 (short) and 1 (long) calls.
  assert clock.count["short"] + 1 == 2 + 3 * 5
  assert clock.count["long"] + 1 == 2 + 3


def test_merge_runs(tmp_path):
  rows = _rows()
  meta = dict(jax_version="0.11.2", device_kind="NVIDIA H200",
              device_count=1, commit="abc1234", date="2026-11-30",
              flop_formula=core.FLOP_FORMULA)
  a, b, c = (str(tmp_path / f"{n}.json") for n in "abc")
  report.write_json(a, meta, rows[:1])
  report.write_json(b, {**meta, "date": "2026-12-01"}, rows[1:])
  assert report.main([str(tmp_path / "m"), a, b]) == 0
  merged_meta, merged = report.read_json(str(tmp_path / "m.json"))
  assert [r.pop("run") for r in merged] == ["0", "1", "1"]
  assert merged == rows and merged_meta["date"] == "2026-12-01"
  assert (tmp_path / "m.md").exists()
  report.write_json(c, {**meta, "commit": "other"}, rows)
  with pytest.raises(ValueError, match="different commit"):
    report.merge([a, c])
  # Several commits merge only when asked, each row keeping its own.
  assert report.main(["--mixed-commits", str(tmp_path / "x"), a, c]) == 0
  mixed_meta, mixed = report.read_json(str(tmp_path / "x.json"))
  assert mixed_meta["commits"] == ["abc1234", "other"]
  assert mixed_meta["commit"] == "abc1234, other"
  assert sorted(r["commit"] for r in mixed) == (
      ["abc1234"] + ["other"] * len(rows))
  # A merged record merges again: its rows keep their commits.
  _, again = report.merge([str(tmp_path / "x.json"), b],
                          mixed_commits=True)
  assert sorted(r["commit"] for r in again) == (
      ["abc1234"] * len(rows) + ["other"] * len(rows))
  # A setting the runs differ in moves into the rows.
  e = str(tmp_path / "e.json")
  report.write_json(e, {**meta, "tuned_for": "NVIDIA H200"}, rows[1:])
  tuned_meta, tuned = report.merge([a, e])
  assert tuned_meta["tuned_for"] is None
  assert [r["tuned_for"] for r in tuned] == [None] + ["NVIDIA H200"] * (
      len(rows) - 1)
  d = str(tmp_path / "d.json")
  report.write_json(d, {**meta, "device_kind": "other"}, rows)
  with pytest.raises(ValueError, match="different device_kind"):
    report.merge([a, d], mixed_commits=True)


def test_failing_implementation_is_a_row(monkeypatch):
  def broken(shape, mask_kw, interpret):
    raise NotImplementedError("no such kernel here")

  def wrong(shape, mask_kw, interpret):
    return lambda q, k, v: q * 3.0

  monkeypatch.setitem(impls.IMPLS, "broken", broken)
  monkeypatch.setitem(impls.IMPLS, "wrong", wrong)
  shape = core.Shape(1, 32, 32, 2, 2, 16, causal=True, dtype="float32")
  rows = bench_main.run_shape(shape, ["broken", "wrong", "jaxflash-xla"],
                              ["fwd", "fwd_bwd"], interpret=True, samples=2)
  by = {(r["impl"], r["mode"]): r for r in rows}
  assert len(rows) == 6
  assert by["broken", "fwd"]["error"] == (
      "NotImplementedError: no such kernel here")
  assert by["broken", "fwd"]["tflops"] is None
  assert by["wrong", "fwd_bwd"]["error"].startswith(
      "wrong result: max_abs_err")
  for mode in ("fwd", "fwd_bwd"):
    row = by["jaxflash-xla", mode]
    assert row["error"] is None and row["tflops"] > 0 and row["peak_bytes"]


def test_interleaved_timing_with_no_call_left():
  """No call, or none that survives its warm-up: no times, no crash."""
  assert core.time_interleaved({}, samples=3, min_sample_s=0.0) == {}
  got = core.time_interleaved({"bad": (lambda x: 1 / 0, (jnp.ones(1),))},
                              samples=3, min_sample_s=0.0)
  assert isinstance(got["bad"], ZeroDivisionError)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_williams_orders_balance_places_and_predecessors(n):
  rows = core.williams_orders(n)
  assert len(rows) == (n if n % 2 == 0 else 2 * n)
  assert all(sorted(r) == list(range(n)) for r in rows)
  per = len(rows) // n  # rounds per (call, place)
  for place in range(n):
    assert sorted(r[place] for r in rows) == sorted(list(range(n)) * per)
  pairs = [(r[i - 1], r[i]) for r in rows for i in range(1, n)]
  want = len(pairs) // max(1, n * (n - 1))
  for a in range(n):
    for b in range(n):
      if a != b:
        assert pairs.count((a, b)) == want


def test_interleaved_timing_orders_rounds_by_the_design():
  """Every surviving call once per round, in the design's orders over a
  seeded shuffle: over 8 rounds of 4 calls every call takes every place
  twice; a seed repeats its orders, another seed changes them."""
  def run(seed, fail=None):
    seen = []

    def call(name):
      def fn(x):
        seen.append(name)
        if name == fail and len(seen) > 12:
          raise RuntimeError("gone")
        return x
      return fn, (jnp.ones(1),)

    calls = {n: call(n) for n in "abcd"}
    got = core.time_interleaved(calls, samples=8, min_sample_s=0.0,
                                seed=seed)
    # Two warm-up calls each (compile, then one timed for the
    # repetitions), then the rounds.
    assert seen[:8] == list("aabbccdd")
    return got, seen[8:]

  got, seen = run(0)
  assert set(got) == set("abcd") and all(t > 0 for t in got.values())
  rounds = [seen[4 * r:4 * r + 4] for r in range(8)]
  assert all(sorted(r) == list("abcd") for r in rounds)
  for place in range(4):
    assert sorted(r[place] for r in rounds) == sorted("abcd" * 2)
  assert run(0)[1] == seen
  assert run("1:shape")[1] != seen
  # A call that fails leaves the rounds to the other three.
  got, seen = run(0, fail="c")
  assert isinstance(got["c"], RuntimeError)
  assert set(got) == set("abcd") and all(
      got[n] > 0 for n in "abd")
  assert seen.count("a") == seen.count("b") == seen.count("d") == 8


def test_cpu_smoke_end_to_end(tmp_path, capsys, monkeypatch):
  if jax.default_backend() == "gpu":
    pytest.skip("CPU path")
  # The output check's slice: the last 16 query rows (with their segment
  # ids and the causal alignment) of the 64.
  monkeypatch.setattr(bench_main, "SPOT_ROWS", 16)
  assert bench_main.main(["--head-dims", "64"]) == 0  # no GPU: explains
  assert "--cpu-smoke" in capsys.readouterr().out
  rc = bench_main.main(["--cpu-smoke", "--out", str(tmp_path), "--name", "s",
                        "--mask", "segments:2", "--causal", "on",
                        "--samples", "1"])
  assert rc == 0
  out = capsys.readouterr().out
  assert "NOT a performance figure" in out
  meta, rows = report.read_json(str(tmp_path / "s.json"))
  assert {r["impl"] for r in rows} == set(impls.CPU_IMPLS)
  by = {(r["impl"], r["mode"], r["seq_q"]): r for r in rows}
  assert by[("jaxflash-triton", "fwd", 64)]["error"] is None
  assert len(by[("jaxflash-triton", "fwd", 64)]["samples_ms"]) == 1
  # jax.nn has no segment ids: a row with the reason, not a crash.
  assert "segment ids" in by[("xla", "fwd", 64)]["error"]
  assert (tmp_path / "s.md").exists() and (tmp_path / "s.png").exists()
  assert bench_main.main(["--impls", "nope", "--cpu-smoke"]) == 2


@pytest.mark.slow
def test_dropout_cpu_smoke(tmp_path, monkeypatch):
  """--mask dropout:P: jaxflash's rows pass the output check against the
  reference dropping the same probabilities in the checked slice (its
  rows' first position in the seeds); the peers sit it out, by name."""
  if jax.default_backend() == "gpu":
    pytest.skip("CPU path")
  monkeypatch.setattr(bench_main, "SPOT_ROWS", 16)
  rc = bench_main.main(["--cpu-smoke", "--out", str(tmp_path), "--name", "d",
                        "--mask", "dropout:20", "--causal", "on",
                        "--samples", "1"])
  assert rc == 0
  _, rows = report.read_json(str(tmp_path / "d.json"))
  by = {(r["impl"], r["mode"]): r for r in rows if r["seq_q"] == 64}
  for mode in ("fwd", "fwd_bwd"):
    assert by[("jaxflash-triton", mode)]["error"] is None, mode
  assert "no attention dropout" in by[("xla", "fwd")]["error"]


def test_sample_seconds_reaches_the_timer(tmp_path, monkeypatch):
  """--sample-seconds is each sample's least duration (longer samples:
  the sustained-load regime), passed to the timer and kept in the JSON;
  a negative one exits 2."""
  if jax.default_backend() == "gpu":
    pytest.skip("CPU path")
  seen = []
  timer = core.time_interleaved

  def spy(calls, **kw):
    seen.append(kw["min_sample_s"])
    return timer(calls, **kw)

  monkeypatch.setattr(core, "time_interleaved", spy)
  rc = bench_main.main(["--cpu-smoke", "--out", str(tmp_path), "--name", "t",
                        "--impls", "xla", "--mode", "fwd", "--causal", "off",
                        "--samples", "1", "--sample-seconds", "0.001"])
  assert rc == 0 and seen and set(seen) == {0.001}
  meta, _ = report.read_json(str(tmp_path / "t.json"))
  assert meta["sample_seconds"] == 0.001
  assert bench_main.main(["--cpu-smoke", "--sample-seconds", "-1"]) == 2


@pytest.mark.slow  # 15 s; make test-all
def test_mosaic_variants_are_rows_of_the_same_run(tmp_path, monkeypatch):
  """--mosaic-variants adds one row per named config override, timed with
  the others (here the interpretable config, on CPU); bad specs exit 2."""
  if jax.default_backend() == "gpu":
    pytest.skip("CPU path")
  seen = {}
  make = impls.mosaic_variant

  def spy(overrides, tuned_for=None):
    seen.update(overrides)
    return make(overrides, tuned_for)

  monkeypatch.setattr(impls, "mosaic_variant", spy)
  interpretable = ("compute_wgs=1,p_in_smem=1,schedule_barrier=0,"
                   "bwd_compute_wgs=1")
  # "same" adds a field at its default value (the same kernels), "rt" one
  # that changes the forward's loop (a rescale skip: another program).
  variants = (f"one:{interpretable};same:{interpretable},stages=2;"
              f"rt:{interpretable},rescale_threshold=8")
  rc = bench_main.main(["--cpu-smoke", "--out", str(tmp_path), "--name", "v",
                        "--impls", "jaxflash-xla", "--mode", "fwd",
                        "--causal", "off", "--samples", "1",
                        "--mosaic-variants", variants])
  assert rc == 0
  assert seen == dict(compute_wgs=1, p_in_smem=True, schedule_barrier=False,
                      bwd_compute_wgs=1, stages=2, rescale_threshold=8)
  _, rows = report.read_json(str(tmp_path / "v.json"))
  by_impl = lambda name: [r for r in rows
                          if r["impl"] == f"jaxflash-mosaic_gpu[{name}]"]
  variant = by_impl("one")
  assert len(variant) == 2 and all(r["error"] is None for r in variant)
  assert all(r["same_program_as"] is None for r in variant + by_impl("rt"))
  assert [r["same_program_as"] for r in by_impl("same")] == [
      "jaxflash-mosaic_gpu[one]"] * 2
  assert "jaxflash-mosaic_gpu[same] = jaxflash-mosaic_gpu[one]" in (
      report.markdown({"device_kind": "cpu", "date": "-", "device_count": 1,
                       "jax_version": "-", "commit": "-",
                       "flop_formula": "-"}, rows))
  for bad in ["noname", "x:not_a_field=1", "x:bwd_stages=three",
              "x:bwd_stages=3;x:bwd_stages=4"]:
    assert bench_main.main(["--cpu-smoke", "--mosaic-variants", bad]) == 2
  assert bench_main.main(["--cpu-smoke", "--mosaic-variants", "x:stages=2",
                          "--tuned-for", "NVIDIA H999"]) == 2


def test_variants_tuned_for_another_device_kind():
  """--tuned-for: the variants start from that kind's tuning.json entry
  (the H200's persistent, overlapped config at head_dim 128 with 2048
  non-causal keys), not from this device's."""
  shape = core.Shape(1, 2048, 2048, 2, 2, 128, False)
  seen = []

  class Seen(Exception):
    pass

  def spy(*args, config=None, **kwargs):
    seen.append(config)
    raise Seen  # the config is all this test needs

  x = jnp.zeros((1, 2048, 2, 128), jnp.bfloat16)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(jaxflash, "flash_attention", spy)
    for kind in ("NVIDIA H200", None, "NVIDIA H100 80GB HBM3", "default"):
      (make,) = impls.parse_mosaic_variants("io:item_overlap=1",
                                            kind).values()
      with pytest.raises(Seen):
        make(shape, {}, True)(x, x, x)
  h200, here, h100, untuned = seen
  assert h200.persistent and h200.prefetch_q and h200.intra_wg_overlap
  assert h200.item_overlap and here.item_overlap
  assert not here.persistent  # this machine's kind: the default entry
  assert h100 == h200  # the alias
  assert untuned == here  # "default": the untuned entry by name


def test_variant_values_none_only_for_optional_fields():
  """``none`` clears a field that may be None (the tuned
  ``consumer_registers``) and is refused for the others."""
  from jaxflash.mosaic_gpu.config import parse_overrides
  assert parse_overrides("consumer_registers=none,persistent=1") == dict(
      consumer_registers=None, persistent=True)
  with pytest.raises(ValueError, match="block_kv=none"):
    parse_overrides("block_kv=none")


@pytest.mark.parametrize("status,want", [
    ("", "abc1234"), (" M jaxflash/op.py", "abc1234+dirty")])
def test_commit_flags_a_tree_that_differs_from_head(monkeypatch, status,
                                                    want):
  """A tree copied with a stale .git (the GPU machine's) shows as +dirty;
  JAXFLASH_COMMIT wins over git."""
  import subprocess
  out = {"rev-parse": "abc1234", "status": status}

  def run(cmd, **kw):
    return subprocess.CompletedProcess(cmd, 0, stdout=out[cmd[1]] + "\n")

  monkeypatch.delenv("JAXFLASH_COMMIT", raising=False)
  monkeypatch.setattr(core.subprocess, "run", run)
  assert core.commit() == want
  monkeypatch.setenv("JAXFLASH_COMMIT", "def5678")
  assert core.commit() == "def5678"


def test_models_shape_set():
  """The "models" set: every entry a valid shape of its published heads,
  names unique, a subset by name in MODELS' order, unknown names and
  kinds refused; the rows carry the model, and the table names it."""
  shapes = core.models()
  assert len(shapes) == len(core.MODELS)
  names = [s.model for s in shapes]
  assert len(set(names)) == len(names)
  for s in shapes:
    assert s.heads % s.kv_heads == 0 and s.head_dim % 16 == 0
    assert 512 <= s.seq_q <= 32768 and 1 <= s.batch <= 32
  assert {s.head_dim for s in shapes} >= {64, 80, 96, 128, 256}
  assert any(s.kv_heads == 1 for s in shapes)  # a tensor-parallel MQA shard
  assert core.parse_shapes("grid") is None
  some = core.parse_shapes("models:phi2,gpt2-small")
  assert [s.model for s in some] == ["gpt2-small", "phi2"]
  assert some[1] == core.Shape(4, 2048, 2048, 32, 32, 80, True,
                               model="phi2")
  with pytest.raises(ValueError, match="unknown models.*'nope'"):
    core.parse_shapes("models:nope")
  with pytest.raises(ValueError, match="shapes='grids'"):
    core.parse_shapes("grids")
  row = core.record(some[0], "cudnn", "fwd", ms=1.0)
  assert row["model"] == "gpt2-small"
  assert report.table_rows([row])[0][0] == "gpt2-small b8 h12/12"


def test_decode_mode_cpu_smoke(tmp_path):
  """``--mode decode``: rows of mode "decode" with q_len, page_size and
  bandwidth for each implementation, each checked against the paged
  reference before it is timed; jax.nn's top-left causal mask is refused
  for q_len > 1, and the JSON and plot are written."""
  assert bench_main.main(["--mode", "decode", "--cpu-smoke", "--samples",
                          "1", "--out", str(tmp_path), "--name", "d"]) == 0
  data = json.loads((tmp_path / "d.json").read_text())
  rows = data["results"]
  assert {r["mode"] for r in rows} == {"decode"}
  assert {r["impl"] for r in rows} == {"jaxflash-paged",
                                       "jaxflash-paged-xla", "xla"}
  timed = [r for r in rows if r["error"] is None]
  assert timed and all(r["gbytes_per_s"] > 0 and r["max_abs_err"] < 1e-4
                       and r["page_size"] == 16 for r in timed)
  refused = [r for r in rows if r["error"]]
  assert refused and all(r["impl"] == "xla" and r["q_len"] == 3
                         for r in refused)
  assert (tmp_path / "d.png").stat().st_size > 1000


def test_decode_paged_variants(tmp_path):
  """``--paged-variants``: each variant a row of its kernel with its launch
  config (a float32 smoke call: the Triton row runs, the Hopper kernel's
  row records its refusal of float32), and malformed variants are
  refused."""
  from jaxflash.bench import decode
  assert bench_main.main([
      "--mode", "decode", "--cpu-smoke", "--samples", "1", "--out",
      str(tmp_path), "--name", "v", "--impls", "jaxflash-paged",
      "--paged-variants", "triton/sp1:splits=1,block_pages=1;"
      "mosaic_gpu/st1:stages=1,splits=none"]) == 0
  rows = json.loads((tmp_path / "v.json").read_text())["results"]
  by = {}
  for r in rows:
    by.setdefault(r["impl"], []).append(r)
  assert set(by) == {"jaxflash-paged", "jaxflash-paged[sp1]",
                     "jaxflash-paged-mosaic[st1]"}
  assert all(r["error"] is None and r["max_abs_err"] < 1e-4
             for r in by["jaxflash-paged[sp1]"])
  assert all("bfloat16 or float16" in r["error"]
             for r in by["jaxflash-paged-mosaic[st1]"])
  for bad in ("st1:stages=1", "cuda/x:splits=1", "triton/x:stages=2",
              "triton/x:splits=two", "triton/x:splits=1;triton/x:splits=2"):
    with pytest.raises(ValueError):
      decode.parse_paged_variants(bad)
  assert bench_main.main(["--mode", "decode", "--cpu-smoke",
                          "--paged-variants", "st1:stages=1"]) == 2


def test_decode_chained_timing(monkeypatch):
  """On a GPU each decode program chains calls (``decode._chained``): run
  here with XLA implementations (no interpreter), the chained program
  returns what one call's first output element is, and the rows' times
  are per call."""
  from jaxflash.bench import decode
  attend = lambda q, k: jnp.tanh(q @ k.T)
  q, k = jnp.ones((2, 3)) * 0.1, jnp.ones((4, 3))
  got = jax.jit(decode._chained(attend, 5))(jnp.zeros(()), q, ((k,),))
  np.testing.assert_allclose(got, attend(q, k)[0, 0], rtol=1e-6)
  # The calls take turns over copies of the cache (not of the small
  # arrays), ROTATE_BYTES of them together, at most one per call.
  cache = jnp.ones((1 << 18,), jnp.float32)  # 1 MiB
  sets = decode.rotation((cache, k), 5)
  assert len(sets) == 5 and all(s[1] is k for s in sets)
  assert len({id(s[0]) for s in sets}) == 5
  monkeypatch.setattr(decode, "ROTATE_BYTES", 8 << 20)
  assert len(decode.rotation((jnp.ones((3 << 18,), jnp.int32),), 16)) == 3
  assert len(decode.rotation((k,), 16)) == 1
  got = jax.jit(decode._chained(lambda q, c, k: attend(q, k) + c[0], 4))(
      jnp.zeros(()), q, sets)
  np.testing.assert_allclose(got, attend(q, k)[0, 0] + 1, rtol=1e-6)
  shape = decode.DecodeShape(2, 1, 32, 4, 2, 16, 16, "float32")
  rows = decode.run_shape(shape, ("jaxflash-paged-xla", "xla"),
                          interpret=False, samples=1, chain=3)
  assert all(r["error"] is None and r["ms"] > 0 for r in rows)


def test_fp8_cpu_smoke(tmp_path):
  """``--dtype fp8``: e4m3 inputs; the jaxflash kernel's forward rows are
  timed and checked (dtype ``float8_e4m3fn`` in the JSON), jax.nn's are
  error rows."""
  assert bench_main.main(["--cpu-smoke", "--dtype", "fp8", "--mode", "fwd",
                          "--impls", "jaxflash-triton,xla", "--samples", "1",
                          "--out", str(tmp_path), "--name", "f"]) == 0
  _, rows = report.read_json(str(tmp_path / "f.json"))
  assert {r["dtype"] for r in rows} == {"float8_e4m3fn"}
  ours = [r for r in rows if r["impl"] == "jaxflash-triton"]
  assert ours and all(r["error"] is None and r["ms"] > 0 for r in ours)
  assert all(r["error"] for r in rows if r["impl"] == "xla")


def test_decode_fp8_cache_row():
  """The FP8-cache row: checked against the dequantized pages' reference,
  its bandwidth counted in the bytes it reads (half of bf16's)."""
  from jaxflash.bench import decode
  shape = decode.DecodeShape(2, 1, 64, 4, 2, 32, 16, "bfloat16")
  rows = decode.run_shape(shape, ("jaxflash-paged", "jaxflash-paged-fp8"),
                          interpret=True, samples=1)
  assert all(r["error"] is None for r in rows), rows
  fp8 = rows[1]
  assert fp8["gbytes_per_s"] == pytest.approx(
      shape.kv_bytes / 2 / (fp8["ms"] * 1e-3) / 1e9)
  assert bench_main.main(["--mode", "decode", "--dtype", "fp8"]) == 2


def test_cudnn_paged_needs_a_gpu_and_one_query():
  """The cuDNN paged entry is a GPU row of q_len 1 (refused, with the
  reason, in the interpreter and for longer chunks)."""
  shape = decode_bench.DecodeShape(2, 1, 64, 8, 2, 64, 16)
  with pytest.raises(NotImplementedError, match="GPU only"):
    decode_bench.IMPLS["cudnn-paged"](shape, True)
  with pytest.raises(NotImplementedError, match="q_len 1 only"):
    decode_bench.IMPLS["cudnn-paged"](
        decode_bench.DecodeShape(2, 4, 64, 8, 2, 64, 16), False)


def test_mla_fp8_bytes_read():
  """FlashMLA's FP8 latent reads 656 bytes a token at DeepSeek's widths
  (512 e4m3, 4 float32 scales, 64 bf16), of the 2304 of a bf16 K and V."""
  assert decode_bench.mla_fp8_bytes_read(576) == 656 / 2304


@pytest.mark.slow  # 8 s; the MLA kernel is tested per commit (test_paged)
def test_mla_mode_cpu_smoke(tmp_path):
  """``--mode mla``: latent-attention rows (mode "mla", the kernel and the
  XLA path, each checked against the reference first) with TFLOP/s by
  FlashMLA's count and GB/s of the one latent cache."""
  assert bench_main.main(["--mode", "mla", "--cpu-smoke", "--samples", "1",
                          "--out", str(tmp_path), "--name", "m"]) == 0
  _, rows = report.read_json(str(tmp_path / "m.json"))
  assert {r["impl"] for r in rows} == {"jaxflash-mla", "jaxflash-mla-xla"}
  for r in rows:
    assert r["mode"] == "mla" and r["error"] is None and r["tflops"] > 0
    assert r["gbytes_per_s"] == pytest.approx(
        r["batch"] * r["seq_k"] * r["head_dim"] * 4 / (r["ms"] * 1e-3) / 1e9)


@pytest.mark.parametrize("mask,causal,want", [
    ("flashmask-doc:8", True, 56 / 64), ("segments:8", True, 56 / 64),
    ("dense-segments:8", False, 56 / 64), ("flashmask-block:8", False,
                                           56 / 64),
    ("window:128", True, 49 / 64),        # diagonal and the one below
    ("flashmask-prefix:4", False, 27 / 64),  # causal, 2 prefix tiles
    ("bias", False, None)])
def test_tiles_skipped(mask, causal, want):
  """The fraction of 128 x 128 tiles a mask empties (1024 tokens: 8 x 8
  tiles), as the benchmark reports it beside the speed."""
  from jaxflash.bench import impls
  shape = core.Shape(1, 1024, 1024, 2, 2, 64, causal, "bfloat16", mask=mask)
  got = impls.tiles_skipped(shape, impls.mask_kwargs(shape))
  assert got == want if want is None else got == pytest.approx(want)
