"""Fingerprints of the Hopper kernels' default programs.

    [RULE_KV_LEN=1024] PYTHONPATH=. python3 tools/kernel_fingerprint.py
        [--against COMMIT]

Prints, per case, a hash of the traced program (``jax.make_jaxpr`` of the
forward, or of the gradient, with the tuned default config; no GPU
needed).  Equal hashes at two commits mean the same kernels were built,
so a GPU figure measured at one holds for the other.  The config's own
repr is left out (new config fields with defaults do not change a
kernel), and so is ``OpParams.deterministic``.  ``--against COMMIT``
runs the same cases in a worktree of that commit and compares;
``--against-overrides "field=value,..."`` applies MosaicConfig overrides
to that commit's defaults first (to show that a variant measured there,
``--mosaic-variants`` of the benchmark, is the kernel a later default
builds); a case whose default the overrides do not fit (a ValueError of
MosaicConfig) keeps its default and says so on stderr.  Every case has
``RULE_KV_LEN`` queries and keys (default 1024): the tuned default's
per-call rules (``kv_rules``, ``persistent_max_kv``) pick the config of
a call that long.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

CASES = [
    # name, head_dim, causal, segments, window, gradient
    ("d64-full-fwd", 64, False, False, None, False),
    ("d64-causal-fwd", 64, True, False, None, False),
    ("d128-full-fwd", 128, False, False, None, False),
    ("d128-causal-grad", 128, True, False, None, True),
    ("d128-full-grad", 128, False, False, None, True),
    ("d64-segments-causal-grad", 64, True, True, None, True),
    ("d96-window-grad", 96, False, False, (50, 0), True),
    ("d256-full-fwd", 256, False, False, None, False),
    ("d256-causal-fwd", 256, True, False, None, False),
    ("d256-causal-grad", 256, True, False, None, True),
]


def fingerprints(overrides: str = "") -> dict[str, str]:
  import jax
  import jax.numpy as jnp

  from jaxflash import masks, mosaic_gpu
  from jaxflash.masks import MaskArrays

  out = {}
  for name, d, causal, seg, window, grad in CASES:
    b, t, h, kh = 2, int(os.environ.get("RULE_KV_LEN", "1024")), 4, 2
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, d), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    spec = masks.MaskSpec(t, t, causal, None, *(window or (None, None)))
    try:  # the config the H200 gets for this call (per-call rules)
      cfg = mosaic_gpu.default_config("NVIDIA H200", -(-d // 64) * 64,
                                      causal=causal, kv_len=t)
    except TypeError:  # commits before the per-call rules
      cfg = mosaic_gpu.default_config("NVIDIA H200", -(-d // 64) * 64)
    if overrides:
      import dataclasses

      from jaxflash.mosaic_gpu.config import parse_overrides
      fields = parse_overrides(overrides)  # a bad field or value raises
      try:
        cfg = dataclasses.replace(cfg, **fields)
      except ValueError as e:  # not valid with this case's default
        print(f"{name}: overrides not applied ({e})", file=sys.stderr)

    def f(q, k, v, ids, spec=spec, seg=seg, grad=grad, cfg=cfg):
      arrays = MaskArrays(ids, ids) if seg else MaskArrays()
      attend = lambda q, k, v: mosaic_gpu.attention(
          q, k, v, mask=spec, arrays=arrays, softmax_scale=0.1, config=cfg)
      if not grad:
        return attend(q, k, v)
      loss = lambda q, k, v: attend(q, k, v)[0].astype(jnp.float32).sum()
      return jax.grad(loss, (0, 1, 2))(q, k, v)

    text = str(jax.make_jaxpr(f)(q, kv, kv, ids))
    text = re.sub(r"MosaicConfig\([^)]*\)", "MosaicConfig()", text)
    # OpParams' static switch (its effect, the config the backward
    # resolves, is in the traced kernels themselves).
    text = re.sub(r", deterministic=(True|False)", "", text)
    out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--against", default=None)
  ap.add_argument("--against-overrides", default="",
                  help="MosaicConfig overrides of the --against commit's"
                       " defaults")
  ap.add_argument("--overrides", default="", help=argparse.SUPPRESS)
  ap.add_argument("--json", action="store_true",
                  help="print the fingerprints as JSON (used internally)")
  args = ap.parse_args()
  here = fingerprints(args.overrides)
  if args.json:
    import json
    print(json.dumps(here))
    return 0
  if args.against is None:
    for name, h in here.items():
      print(f"{name:28s} {h}")
    return 0
  import json
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as tmp:
    wt = os.path.join(tmp, "wt")
    subprocess.run(["git", "worktree", "add", "-q", "--detach", wt,
                    args.against], cwd=root, check=True)
    try:
      res = subprocess.run(
          [sys.executable, os.path.abspath(__file__), "--json",
           "--overrides", args.against_overrides],
          cwd=wt, env={**os.environ, "PYTHONPATH": wt}, check=True,
          capture_output=True, text=True)
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", wt], cwd=root,
                     check=False)
  there = json.loads(res.stdout.strip().splitlines()[-1])
  same = True
  for name, h in here.items():
    mark = "same" if there.get(name) == h else "DIFFERENT"
    same &= mark == "same"
    print(f"{name:28s} {h}  {args.against}: {there.get(name)}  {mark}")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
