"""Tokens/s, MFU and peak memory of the GPT example per attention.

    python examples/gpt/compare.py --presets gpt2-124m,gpt2-124m-8k,1b \\
        --attention jaxflash,cudnn,jax-xla --steps 40 --batch 8 --out DIR

Each (preset, attention) pair trains in its own process, so memory
statistics start clean. Throughput is the median over the logged
intervals after the first (which includes compilation). Writes
``gpt-compare.json`` and ``gpt-compare.md`` to ``--out`` and prints the
table; a run that fails is a row with its error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(preset: str, attention: str, args) -> dict:
  out = os.path.join(args.out, f"{preset}-{attention}")
  cmd = [sys.executable, os.path.join(HERE, "train.py"), "--preset", preset,
         "--attention", attention, "--steps", str(args.steps), "--batch",
         str(args.batch), "--mesh", args.mesh, "--out", out,
         "--eval-every", "0", "--sample-bytes", "0"]
  cmd += ["--interpret"] if args.interpret else []
  cmd += ["--remat"] if args.remat else []
  cmd += ["--limit-bytes", str(args.limit_bytes)]
  row = dict(preset=preset, attention=attention, batch=args.batch,
             steps=args.steps, tokens_per_s=None, mfu=None, peak_bytes=None,
             final_loss=None, error=None)
  if os.path.exists(os.path.join(out, "log.jsonl")):
    os.remove(os.path.join(out, "log.jsonl"))
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    row["error"] = (tail[-1] if tail else f"exit {proc.returncode}")[:300]
    return row
  with open(os.path.join(out, "log.jsonl")) as f:
    recs = [json.loads(line) for line in f]
  steady = recs[1:] or recs
  row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
  mfus = [r["mfu"] for r in steady if r["mfu"] == r["mfu"]]
  row["mfu"] = statistics.median(mfus) if mfus else None
  row["peak_bytes"] = max((r.get("peak_bytes") or 0) for r in recs) or None
  row["final_loss"] = recs[-1]["loss"]
  return row


def markdown(meta: dict, rows: list[dict]) -> str:
  lines = [f"# GPT example: tokens/s per attention ({meta['device_kind']}"
           f" x{meta['device_count']}, {meta['date']})", "",
           f"commit `{meta['commit']}`, jax {meta['jax_version']}, mesh"
           f" `{meta['mesh']}`; median tokens/s after the first logged"
           " interval (compilation).", "",
           "| preset | attention | tokens/s | ratio to fastest other | MFU |"
           " peak GiB | final loss | error |", "|---" * 8 + "|"]
  for r in rows:
    others = [o["tokens_per_s"] for o in rows if o["preset"] == r["preset"]
              and o["attention"] != r["attention"] and o["tokens_per_s"]]
    ratio = (f"{r['tokens_per_s'] / max(others):.2f}"
             if r["tokens_per_s"] and others else "-")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    lines.append(
        f"| {r['preset']} | {r['attention']} | {fmt(r['tokens_per_s'], ',.0f')}"
        f" | {ratio} | {fmt(r['mfu'], '.1%')} |"
        f" {fmt(r['peak_bytes'] and r['peak_bytes'] / 2**30, '.1f')} |"
        f" {fmt(r['final_loss'], '.3f')} | {r['error'] or ''} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="gpt2-124m,gpt2-124m-8k,1b")
  ap.add_argument("--attention", default="jaxflash,cudnn,jax-xla")
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--mesh", default="data=-1")
  ap.add_argument("--limit-bytes", type=int, default=4_000_000)
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--remat", action="store_true",
                  help="pass --remat to train.py (the 1B preset at seq 8192"
                       " on one GPU)")
  ap.add_argument("--out", default=os.environ.get("OUT", "out/gpt-compare"))
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  import jax

  from jaxflash.bench import core
  meta = dict(device_kind=jax.devices()[0].device_kind,
              device_count=jax.device_count(), jax_version=jax.__version__,
              commit=core.commit(),
              date=datetime.date.today().isoformat(), mesh=args.mesh)
  rows = []
  for preset in args.presets.split(","):
    for attention in args.attention.split(","):
      row = run_one(preset, attention, args)
      print(json.dumps(row), flush=True)
      rows.append(row)
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
