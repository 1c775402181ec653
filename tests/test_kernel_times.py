"""tools/kernel_times.py runs each Hopper kernel of a call on its own (a
smoke run in the Mosaic GPU interpreter; its figures come from the GPU)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.slow  # a tool's smoke run (42 s on 2 cores): make test-all
def test_kernel_times_interpret_paired_backward(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT),
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  subprocess.run(
      [sys.executable, str(ROOT / "tools" / "kernel_times.py"),
       "--interpret", "--samples", "1", "--variants",
       "paired:bwd_paired_dkv=1",
       "--out", str(tmp_path)], check=True, env=env, capture_output=True,
      text=True, timeout=900)
  got = json.loads((tmp_path / "kernel_times.json").read_text())
  # Each config's passes in launch order, all timed in the same rounds.
  rows = [(r["variant"], r["kernel"]) for r in got["rows"]]
  common = ["forward", "backward (whole)", "backward prep", "dq"]
  assert rows == ([("default", k) for k in common + ["dkv"]]
                  + [("paired", k) for k in common + ["dkv-paired"]])
  assert all(r["ms"] > 0 for r in got["rows"])
  assert (got["interpret"]
          and "bwd_paired_dkv=True" in got["variants"]["paired"])
  assert "bwd_paired_dkv=False" in got["config"]
