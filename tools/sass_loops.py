"""Per-step instruction counts of a kernel's tile loops, read from its SASS
on a machine without a GPU: how many instructions one trip of each inner
loop issues, by opcode, and how many a forward branch inside it can skip.

    python3 tools/sass_loops.py KERNEL.cubin|KERNEL.sass [--top 12]
        [--all] [--json OUT.json]

A cubin comes from ``tools/ptxas_cpu.py --keep DIR`` (DIR/CASE/kernel0.cubin)
or ``tools/sass_from_ptx.sh``; it is disassembled with ``nvdisasm`` from
NVIDIA's wheel (``NVDISASM=/path``, else the copy tools/sass_from_ptx.sh
caches in ``${SASS_TOOLS:-~/.cache/jaxflash-sass}/bin``, else PATH).

A loop is a backward branch and its target: the instructions from the
target's address to the branch.  Listed are the *inner tile loops*, the
loops that hold a tensor-core instruction (``HGMMA``) and enclose no
smaller such loop; ``--all`` lists every loop.  Spin-waits (a
``SYNCS.PHASECHK`` retried by a branch back) hold no HGMMA and are left
out.  The count is static: one trip with every instruction issued once.
A predicated forward branch whose target lies in the same loop (an
``scf.if`` such as the O rescale that ``MosaicConfig.rescale_threshold``
makes conditional) skips the instructions between it and its target;
``skip`` reports the largest such region, and ``taken`` the trip's count
when it is skipped.

Why: under the H200's power cap a kernel's clock follows its energy per
unit of work (docs/benchmarks/h200-2026-12-04-090b175-kv-multicast.md), and ncu counted
24% fewer instructions in cuDNN's head_dim 256 forward than in ours.  The
static count of the loop that runs once per key tile is the part of that
total a config can change, and it can be compared between configs
without a GPU.  It is not a time: issue order, stalls and the overlap
with the tensor cores are not modelled.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_\w+):")
_BRANCH = re.compile(  # BRA[.U] [!P2, ]`(.L_x_1)
    r"\bBRA(?:\.\w+)*\s+(?:!?U?P[T0-9]+,\s*)?(?:`\()?(\.L_\w+)")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclasses.dataclass(frozen=True)
class Loop:
  start: int  # address of the first instruction (the back edge's target)
  end: int  # address of the backward branch
  opcodes: dict[str, int]
  count: int
  skip: int  # instructions the largest inner forward branch skips

  def as_row(self) -> dict:
    return dict(start=hex(self.start), end=hex(self.end), count=self.count,
                skip=self.skip, taken=self.count - self.skip,
                opcodes=self.opcodes)


def opcode(text: str) -> str:
  """``@!P3 FMNMX.NAN R1, R2, R3, !PT`` -> ``FMNMX.NAN`` (``""`` for an
  empty line); tools/ncu_stalls.py reads ncu's SASS lines with it."""
  words = _PRED.sub("", text.strip()).split()
  return words[0] if words else ""


def parse(sass: str) -> tuple[dict[str, int], list[tuple[int, str]]]:
  """Labels (name -> address of the next instruction) and instructions
  (address, text without the trailing ``;``) of nvdisasm's listing."""
  labels, instrs, pending = {}, [], []
  for line in sass.splitlines():
    if m := _LABEL.match(line):
      pending.append(m.group(1))
    elif m := _INSTR.match(line):
      address = int(m.group(1), 16)
      for name in pending:
        labels[name] = address
      pending = []
      instrs.append((address, m.group(2).strip()))
  return labels, instrs


def loops(sass: str) -> list[Loop]:
  labels, instrs = parse(sass)
  out = []
  for address, text in instrs:
    m = _BRANCH.search(text)
    if not m or m.group(1) not in labels or labels[m.group(1)] > address:
      continue
    start = labels[m.group(1)]
    body = [(a, t) for a, t in instrs if start <= a <= address]
    skip = 0
    for a, t in body:
      b = _BRANCH.search(t)
      if b and _PRED.match(t) and b.group(1) in labels:
        target = labels[b.group(1)]
        if a < target <= address:
          skip = max(skip, sum(1 for x, _ in body if a < x < target))
    counts = collections.Counter(opcode(t) for _, t in body)
    out.append(Loop(start, address, dict(counts.most_common()), len(body),
                    skip))
  return out


def tile_loops(all_loops: list[Loop]) -> list[Loop]:
  """The loops with an HGMMA that enclose no smaller loop with one.

  A barrier wait's retry block sits after the kernel's code (a spin loop:
  ``SYNCS.PHASECHK.TRANS64.TRYWAIT``, ``NANOSLEEP``, branch back) and
  ends with a branch back to the wait's successor; that branch is not a
  loop and is left out (it ends one instruction after a spin loop)."""
  spin_ends = {l.end for l in all_loops if "NANOSLEEP.SYNCS" in l.opcodes}
  step = 16  # bytes per sm_90 instruction
  mma = [l for l in all_loops
         if any(k.startswith("HGMMA") for k in l.opcodes)
         and l.end - step not in spin_ends]
  return [l for l in mma
          if not any(o is not l and l.start <= o.start and o.end <= l.end
                     for o in mma)]


def nvdisasm() -> str:
  for path in (os.environ.get("NVDISASM"),
               str(pathlib.Path(os.environ.get(
                   "SASS_TOOLS", pathlib.Path.home() / ".cache/jaxflash-sass"))
                   / "bin/nvdisasm"),
               shutil.which("nvdisasm")):
    if path and os.access(path, os.X_OK):
      return path
  raise FileNotFoundError(
      "nvdisasm not found: set NVDISASM, or run tools/sass_from_ptx.sh once "
      "(it downloads NVIDIA's nvidia-cuda-nvdisasm wheel)")


def read_sass(path: pathlib.Path) -> str:
  if path.suffix == ".cubin":
    return subprocess.run([nvdisasm(), "-c", str(path)], check=True,
                          capture_output=True, text=True).stdout
  return path.read_text()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("kernel", type=pathlib.Path, help=".cubin or .sass")
  ap.add_argument("--top", type=int, default=12,
                  help="opcodes listed per loop (default 12)")
  ap.add_argument("--all", action="store_true", help="every loop")
  ap.add_argument("--json", type=pathlib.Path, help="write the rows here")
  args = ap.parse_args(argv)
  found = loops(read_sass(args.kernel))
  shown = found if args.all else tile_loops(found)
  for l in shown:
    top = list(l.opcodes.items())[:args.top]
    print(f"loop {l.start:#07x}-{l.end:#07x}: {l.count} instructions"
          + (f", {l.count - l.skip} with the largest branch taken"
             f" (skips {l.skip})" if l.skip else ""))
    print("   " + ", ".join(f"{k} {v}" for k, v in top))
  if args.json:
    args.json.write_text(json.dumps([l.as_row() for l in shown], indent=1))
  return 0 if shown else 1


if __name__ == "__main__":
  sys.exit(main())
