"""tools/mosaic_sweep.py on the CPU: its candidate configs, its variant
parsing and its --dry-run output (the timings themselves need a Hopper
GPU)."""

import json

import pytest

import jaxflash
from jaxflash.mosaic_gpu.config import SMEM_LIMIT, head_dim_problem


@pytest.fixture
def sweep(tool):
  return tool("mosaic_sweep")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_candidates_fit_shared_memory(sweep, head_dim):
  cfgs = list(sweep.candidates(head_dim))
  assert cfgs, "no forward candidate fits"
  assert len(set(cfgs)) == len(cfgs)
  for cfg in cfgs:
    assert isinstance(cfg, jaxflash.MosaicConfig)
    assert cfg.smem_bytes(head_dim) <= SMEM_LIMIT
  full = list(sweep.candidates(head_dim, full=True))
  assert set(cfgs) <= set(full)
  assert any(c.compute_wgs == 1 for c in full) or head_dim == 256


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bwd_candidates_serve_the_head_dim(sweep, head_dim):
  base = jaxflash.mosaic_gpu.default_config("NVIDIA H200", head_dim,
                                            causal=False, kv_len=None)
  cfgs = list(sweep.bwd_candidates(head_dim))
  assert cfgs
  for cfg in cfgs:
    assert cfg != base  # the default itself is timed apart
    assert head_dim_problem(cfg, head_dim) is None


def test_parse_variants(sweep):
  assert sweep.parse_variants("persistent=1;bwd_stages=3,stages=2") == [
      {"persistent": True}, {"bwd_stages": 3, "stages": 2}]
  assert sweep.parse_variants(" ; ") == []
  with pytest.raises(SystemExit):
    sweep.parse_variants("not_a_field=1")


def test_variant_configs_skip_what_cannot_serve(sweep, capsys):
  cfgs = list(sweep.variant_configs(
      128, [{"named_barriers": False}, {"block_q": 7}, {"stages": 4}],
      causal=True, kv_len=4096))
  base = jaxflash.mosaic_gpu.default_config("NVIDIA H200", 128, causal=True,
                                            kv_len=4096)
  assert cfgs[0] == base
  assert len(cfgs) == 2
  assert cfgs[1] == base.__class__(**dict(base.__dict__,
                                          named_barriers=False))
  out = capsys.readouterr().out
  assert "skip {'block_q': 7}" in out
  assert "skip {'stages': 4}" in out and "shared memory" in out


def test_dry_run_writes_the_candidates(sweep, tmp_path):
  sweep.main(["--dry-run", "--head-dims", "64,128", "--seqs", "2048",
              "--out", str(tmp_path), "--tag=-t"])
  rows = json.loads((tmp_path / "mosaic_sweep-t.json").read_text())
  keys = {(r["head_dim"], r["seq"], r["causal"]) for r in rows}
  assert keys == {(d, 2048, c) for d in (64, 128) for c in (False, True)}
  assert all(r["dry_run"] and r["mode"] == "fwd" for r in rows)
  assert not any("ms" in r or "error" in r for r in rows)
  n64 = sum(r["head_dim"] == 64 and not r["causal"] for r in rows)
  assert n64 == len(list(sweep.candidates(64)))
  # Each row's config rebuilds a valid MosaicConfig.
  for r in rows:
    jaxflash.MosaicConfig(**r["config"])


def test_dry_run_variants_start_from_the_default(sweep, tmp_path):
  sweep.main(["--dry-run", "--head-dims", "128", "--seqs", "8192",
              "--variants", "named_barriers=0", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "mosaic_sweep.json").read_text())
  assert len(rows) == 4  # (default, variant) x causal
  for causal in (False, True):
    base, var = [r["config"] for r in rows if r["causal"] == causal]
    assert base["named_barriers"] and var == dict(base, named_barriers=False)
