"""Summarise an ncu source page (stall samples per SASS instruction).

    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 tools/ncu_stalls.py rep.csv [--kernel K] [--top 20] \
        [--range LO:HI] [--item-execs N]

Prints the instructions with the most warp-stall samples (share of the
kernel's samples and the two largest stall reasons), then the kernel's
synchronisation skeleton: every wgmma (``HGMMA``), wgmma wait
(``WARPGROUP.DEPBAR``), named barrier (``BAR``), mbarrier operation
(``SYNCS``) and branch, with its sample share and execution count, which
shows what a warpgroup waits on between two tensor-core turns.  Indices
are rows of the source page (``--range`` limits the skeleton to them);
``--kernel`` picks one launch of a report that profiled several.
First come the kernel's totals by stall reason and by instruction class
(``CLASSES``).  ``--item-execs N`` also splits the mbarrier waits by how
often each ran: at most N executions (a wait once per warp per work item,
Q and the first tiles, when N is about warps x items) against more (the
K/V ring's, once per warp per key step).

``--opcodes N`` prints instead the N opcodes that ran most (warp-level
instructions executed, summed over the SASS lines of each opcode
mnemonic, modifiers dropped: ``FMUL``, ``MUFU``, ...), with ``--per D``
dividing the counts by D (e.g. the warp-steps of the call, to compare
kernels of different tilings per unit of work).  It names what
``sass__inst_executed_per_opcode`` counts without names.
"""

import argparse
import csv
import re

from sass_loops import opcode  # this folder (run as tools/ncu_stalls.py)

SKELETON = re.compile(r"HGMMA|DEPBAR|WARPGROUP|BAR\.|SYNCS|BRA")

# Instruction classes for the kernel-wide summary, first match wins.  A
# spin on an mbarrier is a SYNCS.PHASECHK try-wait and the branch that
# retries it, so branches count with the mbarrier waits.
CLASSES = (
    ("wgmma wait", re.compile(r"WARPGROUP\.DEPBAR")),
    ("wgmma issue", re.compile(r"HGMMA|WARPGROUP\.ARRIVE")),
    ("mbarrier wait", re.compile(r"SYNCS\.PHASECHK|\bBRA\b")),
    ("mbarrier arrive/expect", re.compile(r"SYNCS\.")),
    ("named barrier", re.compile(r"\bBAR\.")),
    ("TMA", re.compile(r"UTMA|UBLKCP")),
    ("exp2 (MUFU)", re.compile(r"MUFU")),
    ("fence", re.compile(r"FENCE|MEMBAR")),
    ("float math", re.compile(
        r"^\s*(@!?U?P\w+\s+)?(F[A-Z0-9]+|HADD2|HMUL2|HFMA2)\b")),
    ("shared/global memory", re.compile(
        r"\b(LD|ST|LDS|STS|LDSM|STSM|LDG|STG|RED|ATOM)\b")),
    ("uniform/integer/other", re.compile(r".")),
)


def load(path, kernel=0):
  """The header and rows of the ``kernel``-th kernel in the page (a report
  of several launches holds one section per launch, each opened by a
  "Kernel Name" row and a header row)."""
  rows = list(csv.reader(open(path, newline="")))
  starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"]
  if not starts:
    starts = [-1]
  if not -len(starts) <= kernel < len(starts):
    raise ValueError(f"--kernel {kernel}: the page holds {len(starts)} "
                     "kernel(s)")
  begin = starts[kernel]
  end = starts[kernel + 1] if kernel + 1 < len(starts) else len(rows)
  header = rows[begin + 1]
  return header, [dict(zip(header, r)) for r in rows[begin + 2:end]
                  if len(r) == len(header)]


def opcode_counts(rows) -> dict[str, int]:
  """Warp-level instructions executed per opcode mnemonic (the first
  word of each SASS line after its predicate, modifiers dropped)."""
  out: dict[str, int] = {}
  for r in rows:
    op = opcode(r["Source"]).split(".")[0]
    ran = int(r["Instructions Executed"] or 0)
    if op and ran:
      out[op] = out.get(op, 0) + ran
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("csv")
  ap.add_argument("--kernel", type=int, default=0,
                  help="which launch of a multi-launch report (0-based)")
  ap.add_argument("--top", type=int, default=20)
  ap.add_argument("--range", default=None, help="LO:HI rows for the skeleton")
  ap.add_argument("--item-execs", type=int, default=None,
                  help="split the mbarrier waits at this execution count")
  ap.add_argument("--min-share", type=float, default=0.4,
                  help="also list any instruction above this %% of samples")
  ap.add_argument("--opcodes", type=int, default=None,
                  help="print the N opcodes executed most, and stop")
  ap.add_argument("--per", type=float, default=1.0,
                  help="with --opcodes: divide the counts by this")
  args = ap.parse_args(argv)
  header, rows = load(args.csv, args.kernel)
  if args.opcodes is not None:
    counts = opcode_counts(rows)
    total = sum(counts.values()) or 1
    print(f"{total} warp-level instructions executed"
          + (f", {total / args.per:.1f} per {args.per:g}" if args.per != 1
             else ""))
    for op, n in sorted(counts.items(), key=lambda kv: -kv[1])[:args.opcodes]:
      print(f"{op:12s} {n / args.per:14.1f} {100 * n / total:5.1f}%")
    return
  samples = "Warp Stall Sampling (All Samples)"
  reasons = [h for h in header
             if h.startswith("stall_") and "Not Issued" not in h]
  total = sum(int(r[samples] or 0) for r in rows) or 1
  print(f"{len(rows)} instructions, {total} stall samples")
  by_reason = {h[6:]: sum(int(r[h] or 0) for r in rows) for h in reasons}
  print("by reason: " + ", ".join(
      f"{k} {100 * v / total:.1f}%" for k, v in sorted(
          by_reason.items(), key=lambda kv: -kv[1])[:8] if v))
  by_class, by_execs = {}, [0, 0]
  for r in rows:
    name = next(n for n, pat in CLASSES if pat.search(r["Source"]))
    by_class[name] = by_class.get(name, 0) + int(r[samples] or 0)
    if name == "mbarrier wait" and args.item_execs is not None:
      ran = int(r["Instructions Executed"] or 0)
      by_execs[ran > args.item_execs] += int(r[samples] or 0)
  print("by instruction class: " + ", ".join(
      f"{k} {100 * v / total:.1f}%" for k, v in sorted(
          by_class.items(), key=lambda kv: -kv[1]) if v))
  if args.item_execs is not None:
    print(f"mbarrier waits run at most {args.item_execs} times (item start)"
          f" {100 * by_execs[0] / total:.1f}%, more often (key steps)"
          f" {100 * by_execs[1] / total:.1f}%")
  print(f"\ntop {args.top} by stall samples:")
  for i in sorted(range(len(rows)), key=lambda i: -int(rows[i][samples] or 0)
                  )[:args.top]:
    r = rows[i]
    top2 = sorted(((int(r[h] or 0), h[6:]) for h in reasons), reverse=True)[:2]
    why = ", ".join(f"{name} {n}" for n, name in top2 if n)
    print(f"{i:6d} {100 * int(r[samples] or 0) / total:5.1f}%  "
          f"{r['Source'].strip()[:64]:64s} {why}")
  lo, hi = 0, len(rows)
  if args.range:
    lo, hi = (int(x) for x in args.range.split(":"))
  print("\nskeleton (row, share, times executed, instruction):")
  for i in range(lo, min(hi, len(rows))):
    r = rows[i]
    share = 100 * int(r[samples] or 0) / total
    src = r["Source"].strip()
    if (SKELETON.search(src) or share >= args.min_share) and int(
        r["Instructions Executed"] or 0):
      print(f"{i:6d} {share:5.1f}% x{int(r['Instructions Executed']):>9d}  "
            f"{src[:90]}")


if __name__ == "__main__":
  main()
