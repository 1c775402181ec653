"""tools/kernel_times.py runs each Hopper kernel of a call on its own (a
smoke run in the Mosaic GPU interpreter; its figures come from the GPU)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def test_kernel_times_interpret_variant(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT),
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  subprocess.run(
      [sys.executable, str(ROOT / "tools" / "kernel_times.py"),
       "--interpret", "--samples", "1", "--variants", "s3:bwd_stages=3",
       "--out", str(tmp_path)], check=True, env=env, capture_output=True,
      text=True, timeout=900)
  got = json.loads((tmp_path / "kernel_times.json").read_text())
  # Each config's passes in launch order, all timed in the same rounds.
  rows = [(r["variant"], r["kernel"]) for r in got["rows"]]
  passes = ["forward", "backward (whole)", "backward prep", "dq", "dkv"]
  assert rows == ([("default", k) for k in passes]
                  + [("s3", k) for k in passes])
  assert all(r["ms"] > 0 for r in got["rows"])
  assert got["interpret"] and "bwd_stages=3" in got["variants"]["s3"]
  assert "bwd_stages=3" not in got["config"]
