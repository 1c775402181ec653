"""Do jaxflash and another attention train the same model to the same loss?

    python examples/gpt/convergence.py --preset gpt2-124m --steps 300 \\
        --attention jaxflash,jax-xla --seeds 0,1 --batch 8 --out DIR

Each (attention, seed) trains in its own process (``train.py``, the same
flags otherwise), so for one seed the runs see the same initialisation and
the same batches in the same order and differ only in the attention's
floating-point rounding. Exact attention gives the same curve up to
rounding that grows chaotically over training, so the question is whether
the gap between attentions stays within the gap between seeds. The
summary reports both on the logged steps (every 10) after the first
``--skip`` (the start, where every run is near the uniform loss):

* attention gap: max over steps and seeds of |loss(a) - loss(first)|;
* seed gap: max over steps of |loss(seed) - loss(first seed)| for the
  first attention (the noise reference; needs two seeds or more).  The
  seed picks both the initialisation and the batch order, so this gap is
  mostly the loss's batch-to-batch spread: a loose bar;
* mean difference: the mean over the same steps and seeds of
  loss(a) - loss(first), signed, and the fraction of those steps where
  it is negative: a bias that the largest gap can hide (one attention
  always a little lower or higher) shows here.

Writes ``convergence.json``, ``convergence.md`` and ``convergence.png``
(the curves) to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare  # noqa: E402  (same folder: run as a script)


def run_one(attention: str, seed: int, args, backend: str) -> dict:
  flags = ["--preset", args.preset, "--attention", attention, "--steps",
           str(args.steps), "--batch", str(args.batch), "--mesh", args.mesh,
           "--seed", str(seed)] + (["--lr", str(args.lr)] if args.lr else [])
  recs, error = compare.train_run(
      os.path.join(args.out, f"{attention}-seed{seed}"), flags, args=args,
      devices=compare.mesh_devices(args.mesh), backend=backend)
  return dict(attention=attention, seed=seed, error=error,
              steps=[r["step"] for r in recs or []],
              losses=[r["loss"] for r in recs or []])


def gaps(rows: list[dict], skip: int) -> dict:
  """The attention gap and the seed gap (see the module docstring) over
  the logged steps >= ``skip`` that every compared pair shares."""
  ok = [r for r in rows if r["error"] is None]
  curve = {(r["attention"], r["seed"]): dict(zip(r["steps"], r["losses"]))
           for r in ok}
  attentions = list(dict.fromkeys(r["attention"] for r in ok))
  seeds = list(dict.fromkeys(r["seed"] for r in ok))

  def diffs(pairs) -> list[float]:
    """loss(y) - loss(x) at the steps >= ``skip`` that x and y share, over
    the pairs ``(x, y)`` of runs that both trained."""
    out = []
    for x, y in pairs:
      if x in curve and y in curve:
        cx, cy = curve[x], curve[y]
        out += [cy[s] - cx[s] for s in cx if s in cy and s >= skip]
    return out

  def worst(pairs):
    return max(map(abs, diffs(pairs)), default=None)

  first_a = attentions[0] if attentions else None
  same_seed = {a: [((first_a, s), (a, s)) for s in seeds]
               for a in attentions[1:]}
  attention_gap = {a: worst(pairs) for a, pairs in same_seed.items()}
  seed_gap = (worst([((first_a, seeds[0]), (first_a, s))
                     for s in seeds[1:]]) if len(seeds) > 1 else None)
  mean_difference, below = {}, {}
  for a, pairs in same_seed.items():
    d = diffs(pairs)
    mean_difference[a] = sum(d) / len(d) if d else None
    below[a] = sum(x < 0 for x in d) / len(d) if d else None
  return dict(reference=first_a, attention_gap=attention_gap,
              seed_gap=seed_gap, mean_difference=mean_difference,
              fraction_below=below, from_step=skip)


def markdown(meta: dict, args, rows: list[dict], summary: dict) -> str:
  fmt = lambda x: "-" if x is None else f"{x:.4g}"
  lines = [f"# GPT example: loss curves per attention ({meta['device_kind']}"
           f" x{meta['device_count']}, {meta['date']})", "",
           f"commit `{meta['commit']}`, jax {meta['jax_version']}; preset"
           f" `{args.preset}`, {args.steps} steps, batch {args.batch}, mesh"
           f" `{args.mesh}`; losses logged every 10 steps.", "",
           "| attention | seed | final loss | error |", "|---|---|---|---|"]
  for r in rows:
    final = r["losses"][-1] if r["losses"] else None
    lines.append(f"| {r['attention']} | {r['seed']} | {fmt(final)} |"
                 f" {r['error'] or ''} |")
  lines += ["", f"From step {summary['from_step']} on, largest |loss"
            f" difference| against `{summary['reference']}` at the same"
            " seed (attention gap) and between seeds of"
            f" `{summary['reference']}` (seed gap, the noise reference):",
            "", "| compared | largest gap | mean difference | steps below |",
            "|---|---|---|---|"]
  pct = lambda x: "-" if x is None else f"{x:.0%}"
  for a, g in summary["attention_gap"].items():
    lines.append(f"| `{a}` vs `{summary['reference']}` | {fmt(g)} |"
                 f" {fmt(summary['mean_difference'][a])} |"
                 f" {pct(summary['fraction_below'][a])} |")
  lines.append(f"| seeds of `{summary['reference']}` | "
               f"{fmt(summary['seed_gap'])} | | |")
  lines += ["", "Mean difference: loss(row's attention) - loss(reference),"
            " signed, over the same steps and seeds; steps below: how many"
            " of them have it negative."]
  return "\n".join(lines) + "\n"


def plot(path: str, rows: list[dict], title: str) -> str | None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, ax = plt.subplots(figsize=(7, 4))
  styles = ["-", "--", ":", "-."]
  attentions = list(dict.fromkeys(r["attention"] for r in rows))
  drawn = [r for r in rows if r["losses"]]
  for r in drawn:
    ax.plot(r["steps"], r["losses"],
            styles[attentions.index(r["attention"]) % len(styles)],
            label=f"{r['attention']}, seed {r['seed']}")
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.set_title(title)
  if drawn:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="gpt2-124m")
  ap.add_argument("--attention", default="jaxflash,jax-xla",
                  help="comma-separated; the first is the reference")
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--lr", type=float, default=None)
  ap.add_argument("--mesh", default="data=-1")
  ap.add_argument("--skip", type=int, default=20,
                  help="compare logged steps from this one on")
  ap.add_argument("--limit-bytes", type=int, default=4_000_000)
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--remat", action="store_true")
  ap.add_argument("--run-timeout", type=float, default=None)
  ap.add_argument("--out", default=os.environ.get("OUT", "out/convergence"))
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  backend, meta = compare._device_info()
  meta["date"] = datetime.date.today().isoformat()
  rows = []
  for attention in args.attention.split(","):
    for seed in (int(s) for s in args.seeds.split(",")):
      rows.append(run_one(attention, seed, args, backend))
      print(json.dumps({k: v for k, v in rows[-1].items()
                        if k not in ("steps", "losses")}), flush=True)
  summary = gaps(rows, args.skip)
  with open(os.path.join(args.out, "convergence.json"), "w") as f:
    json.dump({**meta, "args": vars(args), "summary": summary,
               "runs": rows}, f, indent=1)
  text = markdown(meta, args, rows, summary)
  with open(os.path.join(args.out, "convergence.md"), "w") as f:
    f.write(text)
  plot(os.path.join(args.out, "convergence.png"), rows,
       f"{args.preset}: training loss per attention")
  print(text)
  return 0 if all(r["error"] is None for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
