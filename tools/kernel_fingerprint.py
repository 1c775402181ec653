"""Fingerprints of the Hopper kernels' default programs (no GPU needed).

    PYTHONPATH=. python3 tools/kernel_fingerprint.py [--against COMMIT]
        [--json] [--quick]

For every tuned device kind of ``jaxflash/mosaic_gpu/tuning.json`` (its
entries and aliases), every head_dim class (64; 96 and 128, padded to 128;
192 and 256, padded to 256), causal or not, every mask class (none, packed
segments, a sliding window, right-padding lengths) and every key length at
which the per-call rules pick another config, it traces the forward, the
gradient and (where the default adds dQ by atomics) the deterministic
gradient with the tuned default config, and hashes the Pallas kernels in
the traced program: each kernel's body, grid and parameters, in order, and
the shapes it is called with.  The wrapper around the kernels (function
names, the op's static parameters) is left out, so a change of the Python
around the kernels keeps the fingerprints; any change of a kernel's program
changes them.

``--against COMMIT`` traces the same cases (chosen at this commit) in a
worktree of COMMIT and compares, exiting 1 when any kernel differs: equal
fingerprints mean the same kernels were built, so a GPU figure measured at
one commit holds for the other.  ``--quick`` traces one key length per
(device, head_dim, causal) class.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

# Key lengths probed for the per-call rules (kv_rules' ``min_kv`` and
# ``persistent_max_kv`` thresholds lie between them).
KV_LENS = (512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384, 32768)
HEAD_DIMS = (64, 96, 128, 192, 256)
MASKS = ("none", "segments", "window", "lengths")


def _device_kinds() -> list[str]:
  here = os.path.dirname(os.path.abspath(__file__))
  path = os.path.join(here, "..", "jaxflash", "mosaic_gpu", "tuning.json")
  with open(path) as f:
    tuning = json.load(f)
  kinds = [k for k in tuning["devices"] if k != "default"]
  kinds += list(tuning.get("aliases", {}))
  return ["default"] + kinds  # "default": a Hopper part with no entry


def _default_config(kind: str, d: int, causal: bool, kv_len: int):
  from jaxflash import mosaic_gpu
  dp = -(-d // 64) * 64
  return mosaic_gpu.default_config(None if kind == "default" else kind, dp,
                                   causal=causal, kv_len=kv_len)


def cases(quick: bool = False) -> list[dict]:
  """The cases to trace: one per distinct default config of each (device,
  head_dim, causal) class, times mask classes and modes."""
  out = []
  for kind in _device_kinds():
    for d in HEAD_DIMS:
      for causal in (False, True):
        seen = {}
        for t in KV_LENS:
          cfg = _default_config(kind, d, causal, t)
          seen.setdefault(repr(cfg), (t, cfg))
          if quick:
            break
        for t, cfg in seen.values():
          modes = ["fwd", "grad"]
          if getattr(cfg, "bwd_atomic_dq", False):
            modes.append("grad-deterministic")
          for mask in MASKS:
            for mode in modes:
              out.append(dict(kind=kind, d=d, causal=causal, kv_len=t,
                              mask=mask, mode=mode))
  return out


def _case_name(c: dict) -> str:
  return (f"{c['kind'].replace(' ', '_')}/d{c['d']}/"
          f"{'causal' if c['causal'] else 'full'}/kv{c['kv_len']}/"
          f"{c['mask']}/{c['mode']}")


def _attend(q, k, v, *, mask, arrays, config, deterministic):
  """The Mosaic GPU op (forward kernel, its VJP), without the device
  check: through the backend registry of the layered package, or the
  backend module of earlier commits."""
  import jaxflash
  layered = os.path.exists(
      os.path.join(os.path.dirname(jaxflash.__file__), "backends.py"))
  if not layered:
    from jaxflash.mosaic_gpu import backend
    return backend.attention(q, k, v, mask=mask, arrays=arrays,
                             softmax_scale=0.1, config=config,
                             deterministic=deterministic)
  from jaxflash import backends
  return backends.attention(
      backends.get("mosaic_gpu"), q, k, v, mask=mask, arrays=arrays,
      softmax_scale=0.1, logits_soft_cap=None, config=config,
      interpret=False, deterministic=deterministic)


def kernel_texts(jaxpr) -> list[str]:
  """The Pallas kernel calls of a traced program, in order, as text:
  their parameters except names and debug/source information."""
  skip = {"name", "name_and_src_info", "debug", "metadata"}
  texts = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name in ("pallas_call", "mpmd_map"):
        params = {k: v for k, v in eqn.params.items() if k not in skip}
        avals = [str(v.aval) for v in eqn.invars]
        texts.append(f"{eqn.primitive.name} {avals} {sorted(params.items())}")
        continue
      for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr.jaxpr)
  return texts


def fingerprint(c: dict) -> str:
  import jax
  import jax.numpy as jnp

  from jaxflash import masks
  from jaxflash.masks import MaskArrays

  b, h, kh, d, t = 2, 4, 2, c["d"], c["kv_len"]
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, kh, d), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  window = (100, 0) if c["mask"] == "window" else (None, None)
  spec = masks.MaskSpec(t, t, c["causal"], None, *window)
  cfg = _default_config(c["kind"], d, c["causal"], t)
  det = c["mode"] == "grad-deterministic"
  if det:  # what the backend resolves for deterministic=True
    import dataclasses
    cfg = dataclasses.replace(cfg, bwd_atomic_dq=False)

  def f(q, k, v, ids, lens):
    if c["mask"] == "segments":
      arrays = MaskArrays(ids, ids)
    elif c["mask"] == "lengths":
      arrays = MaskArrays(None, None, lens, lens)
    else:
      arrays = MaskArrays()
    attend = lambda q, k, v: _attend(q, k, v, mask=spec, arrays=arrays,
                                     config=cfg, deterministic=det)
    if c["mode"] == "fwd":
      return attend(q, k, v)
    loss = lambda q, k, v: attend(q, k, v)[0].astype(jnp.float32).sum()
    return jax.grad(loss, (0, 1, 2))(q, k, v)

  jaxpr = jax.make_jaxpr(f)(q, kv, kv, ids, lens)
  text = "\n".join(kernel_texts(jaxpr))
  if not text:
    raise RuntimeError(f"{_case_name(c)}: no kernel in the traced program")
  # Function reprs carry their addresses.
  text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprints(case_list: list[dict]) -> dict[str, str]:
  return {_case_name(c): fingerprint(c) for c in case_list}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--against", default=None,
                  help="a commit to compare with (traced in a worktree)")
  ap.add_argument("--quick", action="store_true",
                  help="one key length per (device, head_dim, causal)")
  ap.add_argument("--json", action="store_true",
                  help="print the fingerprints as JSON")
  ap.add_argument("--cases", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  case_list = (json.loads(args.cases) if args.cases
               else cases(quick=args.quick))
  here = fingerprints(case_list)
  if args.json:
    print(json.dumps(here))
    return 0
  if args.against is None:
    for name, h in here.items():
      print(f"{name:60s} {h}")
    return 0
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as tmp:
    wt = os.path.join(tmp, "wt")
    subprocess.run(["git", "worktree", "add", "-q", "--detach", wt,
                    args.against], cwd=root, check=True)
    try:
      res = subprocess.run(
          [sys.executable, os.path.abspath(__file__), "--json", "--cases",
           json.dumps(case_list)],
          cwd=wt, env={**os.environ, "PYTHONPATH": wt},
          capture_output=True, text=True)
      if res.returncode:
        print(res.stderr[-3000:], file=sys.stderr)
        return 2
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", wt], cwd=root,
                     check=False)
  there = json.loads(res.stdout.strip().splitlines()[-1])
  differ = [n for n, h in here.items() if there.get(n) != h]
  for name, h in here.items():
    mark = "same" if there.get(name) == h else "DIFFERENT"
    print(f"{name:60s} {h}  {args.against}: {there.get(name)}  {mark}")
  print(f"{len(here) - len(differ)} of {len(here)} cases trace to the same"
        f" kernels as {args.against}")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
