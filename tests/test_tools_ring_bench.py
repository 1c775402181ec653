"""tools/ring_bench.py's arguments, table and refusals on the CPU (its
--smoke run is in tests/test_ring.py)."""


import pytest


@pytest.fixture
def bench(tool):
  return tool("ring_bench")


def test_defaults(bench):
  args = bench.parse_args([])
  assert (args.causal, args.mode, args.batch, args.dtype) == (
      "on", "both", 1, "bfloat16")
  assert args.seqs is None and not args.smoke
  with pytest.raises(SystemExit):
    bench.parse_args(["--impl", "xla"])


def _row(**kw):
  r = dict(seq=4096, mode="fwd", causal=True, impl="triton", error=None,
           devices=2, ms_1=2.0, ms_n=1.25, speedup=1.6, efficiency=0.8,
           tflops_1=100.0, tflops_n=160.0, max_abs_diff=1e-3)
  r.update(kw)
  return r


def test_table_and_row_line(bench):
  rows = [_row(), _row(mode="fwd_bwd", max_abs_diff=None),
          _row(seq=8192, error="RESOURCE_EXHAUSTED: out of memory")]
  text = bench.table(rows, 2)
  lines = text.splitlines()
  assert "2-dev ms" in lines[0] and set(lines[1]) <= {"-", "+"}
  assert len(lines) == 2 + len(rows)
  assert "80.0%" in lines[2] and "1.60" in lines[2]
  assert "ERROR: RESOURCE_EXHAUSTED" in lines[4]
  assert bench.row_line(rows[0]) == (
      "seq    4096 fwd     causal triton: 1 dev 2.00 ms, 2 dev 1.25 ms,"
      " speedup 1.60, efficiency 80%")
  assert bench.row_line(rows[2]).endswith("ERROR RESOURCE_EXHAUSTED: out of"
                                          " memory")


def test_one_device_is_refused(bench, tmp_path, capsys):
  assert bench.main(["--smoke", "--devices", "1", "--out",
                     str(tmp_path)]) == 2
  assert "needs >= 2 devices" in capsys.readouterr().err
  assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_proxy_runs_device_0_alone(bench, tmp_path):
  """--proxy 2 on one device: device 0's share of a 2-device ring with
  local copies for transfers; the JSON says it is a proxy."""
  import json
  assert bench.main(["--smoke", "--proxy", "2", "--out", str(tmp_path),
                     "--name", "p"]) == 0
  data = json.loads((tmp_path / "p.json").read_text())
  assert "proxy" in data["meta"] and data["meta"]["device_count"] == 2
  assert [r["mode"] for r in data["results"]] == ["fwd", "fwd_bwd"]
  assert all(r["error"] is None and r["ms_n"] > 0 for r in data["results"])
