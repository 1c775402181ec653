"""Writers of benchmark results: terminal table, JSON, markdown, plots."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict

from jaxflash.bench.core import FLOP_FORMULA


def _key(r: dict):
  return (r["head_dim"], r["seq_q"], r["seq_k"], r["causal"], r["mode"],
          r["mask"], r["kv_heads"], r["heads"], r["dtype"], r["batch"])


def best_other(results: list[dict]) -> dict:
  """Per shape and mode, the best TFLOP/s of the non-jaxflash rows."""
  best = {}
  for r in results:
    if r["impl"].startswith("jaxflash") or r["tflops"] is None:
      continue
    k = _key(r)
    if k not in best or r["tflops"] > best[k][1]:
      best[k] = (r["impl"], r["tflops"])
  return best


def ratio(r: dict, best: dict) -> float | None:
  """A jaxflash row's TFLOP/s over the best other implementation's."""
  b = best.get(_key(r))
  if not r["impl"].startswith("jaxflash") or r["tflops"] is None or not b:
    return None
  return r["tflops"] / b[1]


def paired_rows(results: list[dict]) -> list[dict]:
  """Paired comparisons, round by round, of the rows that kept their
  samples (``samples_ms``, one per round of the interleaved timing).

  Each jaxflash row is compared with the shape's best other
  implementation (by median) and, for a variant ``NAME[V]``, with its
  base row ``NAME``, or with the row its ``paired_with`` names (the
  benchmark's ``--tuned-for`` runs: the first variant): per round the
  other call's time over this row's (above 1: this row is faster), then
  the median and the range of those ratios.  Two calls timed in one
  round share that round's clock and power state, so the median of the
  paired ratios moves less with the drift from round to round than the
  ratio of the two medians (at the H200's power cap a copy of the
  default read up to 6% off it by medians of 3 samples,
  docs/benchmarks/h200-2026-12-05-7f1ba8a-d128-default.md)."""
  best_impl = {k: name for k, (name, _) in best_other(results).items()}
  # Only rows of one run share rounds: merged records keep each row's
  # run (``merge`` numbers them).
  groups = defaultdict(dict)
  for r in results:
    if r.get("samples_ms") and r["error"] is None:
      groups[r.get("run"), _key(r)][r["impl"]] = r
  out = []
  for (_, key), rows in groups.items():
    best = rows.get(best_impl.get(key))  # the main table's best other
    for name, r in rows.items():
      if not name.startswith("jaxflash"):
        continue
      against = [best] if best is not None else []
      base = r.get("paired_with") or name.split("[", 1)[0]
      if base != name and base in rows:
        against.append(rows[base])
      for a in against:
        if len(a["samples_ms"]) != len(r["samples_ms"]):
          continue
        ratios = sorted(x / y for x, y in zip(a["samples_ms"],
                                              r["samples_ms"]))
        out.append(dict(head_dim=r["head_dim"], seq_q=r["seq_q"],
                        causal=r["causal"], mask=r["mask"], mode=r["mode"],
                        impl=name, against=a["impl"],
                        median=statistics.median(ratios), low=ratios[0],
                        high=ratios[-1], rounds=len(ratios)))
  return out


PAIRED_HEADER = ["head_dim", "seq", "causal", "mask", "mode", "impl",
                 "against", "paired ratio (median)", "range", "rounds"]


def paired_table_rows(results: list[dict]) -> list[list[str]]:
  return [[str(p["head_dim"]), str(p["seq_q"]), "y" if p["causal"] else "n",
           p["mask"] or "-", p["mode"], p["impl"], p["against"],
           f"{p['median']:.3f}", f"{p['low']:.3f}-{p['high']:.3f}",
           str(p["rounds"])] for p in paired_rows(results)]


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def table_rows(results: list[dict]) -> list[list[str]]:
  best = best_other(results)
  rows = []
  for r in results:
    rat = ratio(r, best)
    rows.append([
        _shape(r), str(r["head_dim"]), str(r["seq_q"]),
        "y" if r["causal"] else "n", _mask(r), r["mode"], r["impl"],
        _fmt(r["ms"], ".3f"),
        _fmt(r["tflops"], ".3g"),
        "-" if rat is None else f"{rat:.2f} vs {best[_key(r)][0]}",
        _fmt(r["peak_bytes"] and r["peak_bytes"] / 2**20, ".0f"),
        (r["error"] or "")[:60]])
  return rows


def _mask(r: dict) -> str:
  """The mask column: the pattern, and the fraction of tiles it empties."""
  if not r["mask"]:
    return "-"
  skipped = r.get("tiles_skipped")
  return r["mask"] + ("" if skipped is None else f" ({skipped:.0%} skip)")


def _where(r: dict) -> str:
  """``d128 s2048 causal fwd``: a row's shape and mode, short."""
  return (f"d{r['head_dim']} s{r['seq_q']}{' causal' if r['causal'] else ''}"
          f"{' ' + r['mask'] if r['mask'] else ''} {r['mode']}")


def row_line(r: dict) -> str:
  """One short line for a row as it lands (progress log)."""
  what = (f"{r['error'][:120]}" if r["error"] else
          f"{r['ms']:.3f} ms {r['tflops']:.1f} TFLOP/s")
  return f"{_where(r)} {r['impl']}: {what}"


def _shape(r: dict) -> str:
  """``gpt2-small b8 h12/12``: the model (where the row has one), batch,
  heads / key-value heads."""
  where = f"b{r['batch']} h{r['heads']}/{r['kv_heads']}"
  return f"{r['model']} {where}" if r.get("model") else where


HEADER = ["shape", "head_dim", "seq", "causal", "mask", "mode", "impl", "ms",
          "TFLOP/s", "ratio to best other", "MiB", "error"]


def _aligned(header: list[str], body: list[list[str]]) -> list[str]:
  rows = [header] + body
  widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
           for row in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return lines


SAME_PROGRAM = ("Same traced program as an earlier row (the overrides do"
                " not change this call's kernels, so the two rows time one"
                " kernel):")


def same_program_rows(results: list[dict]) -> list[str]:
  """``d128 s2048 fwd: jaxflash-mosaic_gpu[io] = jaxflash-mosaic_gpu``
  for each row the benchmark found to trace the same program as an
  earlier Hopper row of its shape and mode (``same_program_as``)."""
  return [f"{_where(r)}: {r['impl']} = {r['same_program_as']}"
          for r in results if r.get("same_program_as")]


def terminal_table(results: list[dict]) -> str:
  lines = _aligned(HEADER, table_rows(results))
  paired = paired_table_rows(results)
  if paired:
    lines += ["", "paired, round by round (other's time / this row's):"]
    lines += _aligned(PAIRED_HEADER, paired)
  same = same_program_rows(results)
  if same:
    lines += ["", SAME_PROGRAM] + ["  " + x for x in same]
  return "\n".join(lines + ["", FLOP_FORMULA])


def markdown(meta: dict, results: list[dict]) -> str:
  lines = [
      f"# Attention benchmark: {meta['device_kind']}, {meta['date']}", "",
      f"- device: {meta['device_kind']} x{meta['device_count']},"
      f" jax {meta['jax_version']}, commit `{meta['commit']}`",
      f"- {meta['flop_formula']}",
      "- ratio: a jaxflash row's TFLOP/s over the best other implementation"
      " at the same shape and mode; MiB: XLA's compiled memory (arguments,"
      " outputs and temporaries) of one call.", "",
      "| " + " | ".join(HEADER) + " |",
      "|" + "---|" * len(HEADER)]
  for row in table_rows(results):
    lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
  paired = paired_table_rows(results)
  if paired:
    lines += [
        "", "Paired, round by round: per round the other call's time over"
        " this row's (above 1: this row faster); the median and range over"
        " the rounds.", "",
        "| " + " | ".join(PAIRED_HEADER) + " |",
        "|" + "---|" * len(PAIRED_HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |"
              for row in paired]
  same = same_program_rows(results)
  if same:
    lines += ["", SAME_PROGRAM, ""]
    lines += [f"- {x}" for x in same]
  if meta.get("note"):
    lines += ["", meta["note"]]
  return "\n".join(lines) + "\n"


def write_json(path: str, meta: dict, results: list[dict]) -> None:
  with open(path, "w") as f:
    json.dump({**meta, "results": results}, f, indent=1)


def read_json(path: str) -> tuple[dict, list[dict]]:
  with open(path) as f:
    data = json.load(f)
  results = data.pop("results")
  return data, results


def merge(paths: list[str], mixed_commits: bool = False
          ) -> tuple[dict, list[dict]]:
  """One record from several runs of the same commit on the same card
  (a grid split across calls), each row tagged with its run's index in
  ``paths`` (``run``).  Refuses runs that differ in commit, device kind
  or jax version; with ``mixed_commits`` runs of several commits (whose
  kernels for those rows are the same: say why in the record) merge, the
  record lists them in order (``commits``; ``commit`` joins them with
  ", ") and each row keeps its run's (``commit``).  A setting the runs
  differ in (``samples``, ``tuned_for``, ...) moves into each row, the
  record's set to None."""
  fixed = {"date", "partial", "commit", "commits", "device_kind",
           "jax_version"}
  metas, runs = [], []
  for p in paths:
    meta, rows = read_json(p)
    metas.append(meta)
    runs.append(rows)
  differ = {k for m in metas for k in m
            if k not in fixed
            and len({json.dumps(n.get(k), sort_keys=True)
                     for n in metas}) > 1}
  for key in ("commit", "device_kind", "jax_version"):
    values = sorted({str(m.get(key)) for m in metas})
    if len(values) > 1 and not (key == "commit" and mixed_commits):
      raise ValueError(f"cannot merge runs with different {key}: {values}")
  results = []
  for i, (meta, rows) in enumerate(zip(metas, runs)):
    # Each row keeps its run (the paired ratios compare rows of one run
    # only): the file's index, before a merged file's own run numbers.
    own = {k: meta.get(k) for k in differ}
    if mixed_commits:
      own["commit"] = meta.get("commit")
    results += [{**own, **r, "run": f"{i}" if r.get("run") is None
                 else f"{i}.{r['run']}"} for r in rows]
  # Grid order (head_dim, seq, causal), each run's order kept within.
  results.sort(key=lambda r: (r["head_dim"], r["seq_q"], r["causal"]))
  meta = dict(metas[0])
  meta["date"] = max(m["date"] for m in metas)
  meta.update({k: None for k in differ})
  if mixed_commits:
    commits = [c for m in metas
               for c in (m.get("commits") or [str(m.get("commit"))])]
    meta["commits"] = list(dict.fromkeys(commits))
    meta["commit"] = ", ".join(meta["commits"])
  meta.pop("partial", None)
  if any(m.get("partial") for m in metas):
    meta["partial"] = True
  return meta, results


def main(argv=None) -> int:
  """``python -m jaxflash.bench.report [--mixed-commits] OUT_STEM
  RUN.json...``: merge runs into OUT_STEM.json/.md/.png (runs of several
  commits only with ``--mixed-commits``: see :func:`merge`)."""
  import sys
  args = list(sys.argv[1:] if argv is None else argv)
  mixed = "--mixed-commits" in args
  args = [a for a in args if a != "--mixed-commits"]
  if len(args) < 2:
    print(main.__doc__, file=sys.stderr)
    return 2
  meta, results = merge(args[1:], mixed_commits=mixed)
  write_json(args[0] + ".json", meta, results)
  with open(args[0] + ".md", "w") as f:
    f.write(markdown(meta, results))
  plot(args[0] + ".png", meta, results)
  print(terminal_table(results))
  return 0


def plot(path: str, meta: dict, results: list[dict]) -> bool:
  """TFLOP/s against sequence length, one panel per (mode, head_dim,
  causal).  Returns False when matplotlib is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  panels = sorted({(r["mode"], r["head_dim"], r["causal"]) for r in results})
  if not panels:
    return False
  ncol = min(4, len(panels))
  nrow = math.ceil(len(panels) / ncol)
  fig, axes = plt.subplots(nrow, ncol, figsize=(4 * ncol, 3.2 * nrow),
                           squeeze=False)
  # One colour per implementation across every panel (panels hold
  # different subsets when a grid was split across runs).
  impls = sorted({r["impl"] for r in results})
  cmap = plt.get_cmap("tab10")
  color = {impl: cmap(i % 10) for i, impl in enumerate(impls)}
  for ax, (mode, d, causal) in zip(axes.flat, panels):
    series = defaultdict(list)
    for r in results:
      if (r["mode"], r["head_dim"], r["causal"]) == (mode, d, causal) and \
          r["tflops"] is not None:
        series[r["impl"]].append((r["seq_q"], r["tflops"]))
    for impl, pts in sorted(series.items()):
      pts.sort()
      style = "-o" if impl.startswith("jaxflash") else "--."
      ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl,
              color=color[impl])
    ax.set_xscale("log", base=2)
    ax.set_title(f"{mode}, head_dim {d}, {'causal' if causal else 'full'}",
                 fontsize=9)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  handles, labels = axes.flat[0].get_legend_handles_labels()
  for ax in axes.flat:
    h, lab = ax.get_legend_handles_labels()
    for hh, ll in zip(h, lab):
      if ll not in labels:
        handles.append(hh)
        labels.append(ll)
  order = sorted(range(len(labels)), key=lambda i: labels[i])
  handles, labels = [handles[i] for i in order], [labels[i] for i in order]
  fig.legend(handles, labels, loc="lower center", ncol=min(7, len(labels)),
             fontsize=8)
  fig.suptitle(f"{meta['device_kind']} — {meta['date']} — {meta['commit']}",
               fontsize=10)
  fig.tight_layout(rect=(0, 0.06, 1, 0.96))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


if __name__ == "__main__":
  raise SystemExit(main())
