"""tools/triton_sweep.py --smoke: one tiny shape in interpret mode on the
CPU, written as the GPU run writes its rows (not a figure)."""

import json

import pytest


@pytest.fixture
def sweep(tool):
  return tool("triton_sweep")


def test_configs_are_valid(sweep):
  import jaxflash
  for bq, bk, w, st in sweep.FWD_CFGS + sweep.SMOKE_FWD_CFGS:
    jaxflash.TritonConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
  for bqk, bkk, bqq, bkq, w, st in sweep.BWD_CFGS + sweep.SMOKE_BWD_CFGS:
    jaxflash.TritonConfig(block_q_dkv=bqk, block_k_dkv=bkk, block_q_dq=bqq,
                          block_k_dq=bkq, num_warps_bwd=w, num_stages_bwd=st)


def test_smoke_run_writes_rows(sweep, tmp_path, capsys):
  sweep.main(["--smoke", "--out", str(tmp_path)])
  got = json.loads((tmp_path / "sweep.json").read_text())
  assert got["smoke"] and got["interpret"]
  rows = got["rows"]
  n_fwd, n_bwd = len(sweep.SMOKE_FWD_CFGS), len(sweep.SMOKE_BWD_CFGS)
  assert len(rows) == 2 * (n_fwd + n_bwd)  # causal off and on
  for r in rows:
    assert "error" not in r, r
    assert r["ms"] > 0 and r["tflops"] > 0
    assert r["impl"].startswith("fwd" if r["mode"] == "fwd" else "bwd")
  assert {r["causal"] for r in rows} == {False, True}
  assert "impl" in capsys.readouterr().out  # the table
