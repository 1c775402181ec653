"""Tokens/s, MFU and peak memory of the GPT example per attention and mesh.

    python examples/gpt/compare.py --presets gpt2-124m,gpt2-124m-8k,1b \\
        --attention jaxflash,cudnn,jax-xla --steps 40 --batch 8 --out DIR
    python examples/gpt/compare.py --presets 1b --attention jaxflash \\
        --meshes "data=1;data=2;context=2" --batch 4 --remat   # scaling

Each (preset, attention, mesh) trains in its own process, so memory
statistics start clean. Throughput is the median over the logged
intervals after the first (which includes compilation). With ``--meshes``
each run gets exactly the devices its mesh names (the first ones), the
global batch is ``--batch`` times its data x fsdp size (the same rows per
data-parallel replica), and a row's scaling efficiency is its tokens/s
over (devices x the one-device run's tokens/s). Writes
``gpt-compare.json`` and ``gpt-compare.md`` to ``--out`` and prints the
table; a run that fails is a row with its error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def mesh_sizes(text: str) -> dict[str, int]:
  """``"data=2,context=2"`` -> {"data": 2, "context": 2}."""
  return {name: int(val) for name, _, val in
          (part.partition("=") for part in text.split(",") if part)}


def mesh_devices(text: str) -> int | None:
  """Devices a mesh names (None when one size is -1: all of them)."""
  sizes = mesh_sizes(text).values()
  return None if -1 in sizes else math.prod(sizes)


def _device_env(n: int | None, backend: str) -> dict[str, str]:
  """The environment that gives a run exactly its first ``n`` devices."""
  env = dict(os.environ)
  if n is None:
    return env
  if backend == "gpu":
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(n)))
  else:
    flag = "--xla_force_host_platform_device_count"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if flag not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"{flag}={n}"])
  return env


# "SomeError: message" at the start of a line (a traceback's last frame).
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b.*:")


def error_line(text: str) -> str | None:
  """The telling lines of a failed run's output: the last two lines that
  name an exception (a chained error and its cause), skipping JAX's note
  about the frames it filtered, which comes last."""
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  named = [ln for ln in lines if _ERROR_LINE.match(ln)
           and "JAX has removed its internal frames" not in ln]
  if named:
    return " | ".join(ln[:200] for ln in named[-2:])
  return lines[-1][:300] if lines else None


def train_run(out: str, flags: list[str], *, args, devices, backend: str):
  """``train.py`` with ``flags`` (and the shared ones of ``args``:
  ``--limit-bytes``, ``--interpret``, ``--remat``) in its own process on
  ``devices`` devices, logging to ``out``.  Returns ``(records, error)``:
  the JSONL log's records, or the reason it has none (``--run-timeout``,
  the exception of a failed run, whose output goes to
  ``out/stderr.txt``)."""
  cmd = [sys.executable, os.path.join(HERE, "train.py"), *flags, "--out",
         out, "--eval-every", "0", "--sample-bytes", "0", "--limit-bytes",
         str(args.limit_bytes)]
  cmd += ["--interpret"] if args.interpret else []
  cmd += ["--remat"] if args.remat else []
  log = os.path.join(out, "log.jsonl")
  if os.path.exists(log):
    os.remove(log)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=_device_env(devices, backend),
                          timeout=args.run_timeout)
  except subprocess.TimeoutExpired:
    return None, f"stopped after --run-timeout {args.run_timeout} s"
  if proc.returncode != 0:
    text = (proc.stderr or proc.stdout).strip()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "stderr.txt"), "w") as f:
      f.write(text)
    return None, error_line(text) or f"exit {proc.returncode}"
  with open(log) as f:
    return [json.loads(line) for line in f], None


def run_one(preset: str, attention: str, mesh: str, args,
            backend: str) -> dict:
  devices = mesh_devices(mesh)
  sizes = mesh_sizes(mesh)
  batch = args.batch
  if args.meshes:  # the same rows per data-parallel replica
    batch *= max(1, sizes.get("data", 1)) * max(1, sizes.get("fsdp", 1))
  out = os.path.join(args.out, f"{preset}-{attention}-{mesh.replace(',', '_')}"
                     .replace("=", ""))
  row = dict(preset=preset, attention=attention, mesh=mesh, devices=devices,
             batch=batch, steps=args.steps, tokens_per_s=None, mfu=None,
             peak_bytes=None, final_loss=None, scaling_efficiency=None,
             wall_s=None, error=None)
  start = time.perf_counter()
  recs, row["error"] = train_run(
      out, ["--preset", preset, "--attention", attention, "--steps",
            str(args.steps), "--batch", str(batch), "--mesh", mesh],
      args=args, devices=devices, backend=backend)
  row["wall_s"] = round(time.perf_counter() - start, 1)
  if recs is None:
    return row
  steady = recs[1:] or recs
  row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
  mfus = [r["mfu"] for r in steady if r["mfu"] == r["mfu"]]
  row["mfu"] = statistics.median(mfus) if mfus else None
  row["peak_bytes"] = max((r.get("peak_bytes") or 0) for r in recs) or None
  row["final_loss"] = recs[-1]["loss"]
  return row


def add_scaling(rows: list[dict]) -> None:
  """Scaling efficiency of each row against the one-device run of the same
  (preset, attention), where there is one."""
  for r in rows:
    base = next((o for o in rows if o["preset"] == r["preset"]
                 and o["attention"] == r["attention"] and o["devices"] == 1
                 and o["tokens_per_s"]), None)
    if base and r["tokens_per_s"] and r["devices"]:
      r["scaling_efficiency"] = r["tokens_per_s"] / (
          r["devices"] * base["tokens_per_s"])


def markdown(meta: dict, rows: list[dict]) -> str:
  lines = [f"# GPT example: tokens/s per attention and mesh"
           f" ({meta['device_kind']} x{meta['device_count']},"
           f" {meta['date']})", "",
           f"commit `{meta['commit']}`, jax {meta['jax_version']}; median"
           " tokens/s after the first logged interval (compilation);"
           " ratio: against the fastest other attention on the same preset"
           " and mesh; scaling: tokens/s over (devices x the one-device"
           " run's).", "",
           "| preset | attention | mesh | batch | tokens/s | ratio to fastest"
           " other | scaling | MFU | peak GiB | final loss | error |",
           "|---" * 11 + "|"]
  fmt = lambda x, spec: "-" if x is None else format(x, spec)
  for r in rows:
    others = [o["tokens_per_s"] for o in rows if o["preset"] == r["preset"]
              and o["mesh"] == r["mesh"] and o["attention"] != r["attention"]
              and o["tokens_per_s"]]
    ratio = (f"{r['tokens_per_s'] / max(others):.2f}"
             if r["tokens_per_s"] and others else "-")
    lines.append(
        f"| {r['preset']} | {r['attention']} | `{r['mesh']}` | {r['batch']}"
        f" | {fmt(r['tokens_per_s'], ',.0f')} | {ratio} |"
        f" {fmt(r['scaling_efficiency'], '.0%')} | {fmt(r['mfu'], '.1%')} |"
        f" {fmt(r['peak_bytes'] and r['peak_bytes'] / 2**30, '.1f')} |"
        f" {fmt(r['final_loss'], '.3f')} | {r['error'] or ''} |")
  return "\n".join(lines) + "\n"


def _device_info() -> tuple[str, dict]:
  """JAX's backend and the run's metadata, asked of a short-lived process:
  this one must not hold the GPUs (nor preallocate their memory) while the
  training runs need them."""
  code = ("import json, jax; from jaxflash.bench import core; print(json.dumps("
          "[jax.default_backend(), dict(device_kind=jax.devices()[0]"
          ".device_kind, device_count=jax.device_count(), jax_version="
          "jax.__version__, commit=core.commit())]))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True).stdout
  backend, meta = json.loads(out.strip().splitlines()[-1])
  return backend, meta


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="gpt2-124m,gpt2-124m-8k,1b")
  ap.add_argument("--attention", default="jaxflash,cudnn,jax-xla")
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--mesh", default="data=-1")
  ap.add_argument("--meshes", default="",
                  help="';'-separated meshes, each run on exactly its"
                       " devices (scaling); replaces --mesh")
  ap.add_argument("--limit-bytes", type=int, default=4_000_000)
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--remat", action="store_true",
                  help="pass --remat to train.py (the 1B preset at seq 8192"
                       " on one GPU)")
  ap.add_argument("--run-timeout", type=float, default=None,
                  help="seconds one training run may take (a row with an"
                       " error after that)")
  ap.add_argument("--out", default=os.environ.get("OUT", "out/gpt-compare"))
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  backend, meta = _device_info()
  meta["date"] = datetime.date.today().isoformat()
  meshes = [m.strip() for m in args.meshes.split(";") if m.strip()] or [
      args.mesh]
  rows = []
  for preset in args.presets.split(","):
    for attention in args.attention.split(","):
      for mesh in meshes:
        row = run_one(preset, attention, mesh, args, backend)
        print(json.dumps(row), flush=True)
        rows.append(row)
        add_scaling(rows)
        # Written after every row: a run stopped by a time limit keeps what
        # it measured.
        with open(os.path.join(args.out, "gpt-compare.json"), "w") as f:
          json.dump({**meta, "results": rows}, f, indent=1)
        text = markdown(meta, rows)
        with open(os.path.join(args.out, "gpt-compare.md"), "w") as f:
          f.write(text)
  print(text)
  return 0 if all(r["error"] is None for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
