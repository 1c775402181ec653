"""What ptxas says about the Hopper kernels: registers, spills and
warnings (e.g. serialised ``wgmma``) per compiled kernel and config.

    [RULE_KV_LEN=8192] PYTHONPATH=. python3 tools/ptxas_report.py [--out DIR]
        [--cases "128:fwd:0:;128:fwd:0:named_barriers=0,persistent=0,\
intra_wg_overlap=1"]

A case is ``HEAD_DIM:MODE:CAUSAL:OVERRIDES`` (MODE fwd or fwd_bwd;
OVERRIDES are MosaicConfig fields on top of the H200's tuned default, as
``python -m jaxflash.bench --mosaic-variants`` takes them).  Each case
compiles and runs a small call in its own process with
``MOSAIC_GPU_DUMP_PTXAS=1`` (and ``MOSAIC_GPU_DUMP_TO`` a folder of its
own), so that ptxas' verbose report of that case alone is what is read
back.  Register counts and spills do not depend on the sequence length,
so one small shape per case suffices; the cases run a few at a time.
Kernels are told apart by order only (Mosaic GPU names them all
``anonymous_mosaic_gpu_kernel``): the forward first, then the backward's
kernels in the order their reports were written (tools/ptxas_cpu.py,
which needs no GPU, names each by its backward pass: dQ before dK/dV in
the lowering); a warning ptxas prints before an entry's name is listed
under ``?``.

This is the evidence the benchmark cannot give: a variant that runs at
half speed with spill stores, or with ptxas' "wgmma serialized" warning,
is slow for that reason.  Needs an sm90 GPU.
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

DEFAULT_CASES = ";".join([
    "64:fwd_bwd:0:", "64:fwd_bwd:1:",
    "128:fwd_bwd:0:", "128:fwd_bwd:1:",
    "256:fwd_bwd:0:", "256:fwd_bwd:1:",
])

# ptxas -v lines (CUDA 12): the entry being compiled, then its resources.
ENTRY = re.compile(r"Compiling entry function '([^']+)'")
REGS = re.compile(r"Used (\d+) registers")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
STACK = re.compile(r"(\d+) bytes stack frame")
# ptxas' performance notes are "info" lines, e.g. "(C7517) warpgroup.wait
# is injected in around line N by compiler to allow use of registers
# defined by GMMA" (a wgmma waited for earlier than the code asks) and
# C7515 (wgmma serialised): kept with the warnings.
PERF_NOTE = re.compile(r"\(C75\d\d\)")


def parse(text: str) -> list[dict]:
  """ptxas' verbose output -> one dict per entry function.  ptxas prints
  a kernel's warnings and notes before its "Compiling entry function"
  line, so those that come before an entry, or after an entry's report
  ended (its "Used N registers" line), go with the next entry; any left
  at the end form an entry named ``?``."""
  entries, cur, pending = [], None, []
  for line in text.splitlines():
    m = ENTRY.search(line)
    if m:
      cur = dict(entry=m.group(1), warnings=pending)
      pending = []
      entries.append(cur)
      continue
    if "warning" in line.lower() or PERF_NOTE.search(line):
      if cur is None or "registers" in cur:
        pending.append(line.strip()[:300])
      else:
        cur["warnings"].append(line.strip()[:300])
      continue
    if cur is None:
      continue
    if (m := REGS.search(line)):
      cur["registers"] = int(m.group(1))
    if (m := SPILL.search(line)):
      cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
    if (m := STACK.search(line)):
      cur["stack"] = int(m.group(1))
  if pending:
    entries.append(dict(entry="?", warnings=pending))
  return entries


def child(case: str) -> None:
  """Compile and run one case (in a process whose environment asks
  Mosaic GPU for ptxas' report)."""
  import dataclasses  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import jaxflash  # noqa: PLC0415
  from jaxflash.mosaic_gpu.config import parse_overrides  # noqa: PLC0415
  from jaxflash.triton.common import round_up  # noqa: PLC0415

  d, mode, causal, overrides = case.split(":", 3)
  d, causal = int(d), bool(int(causal))
  seq = 2048
  # The config the tuned rules give a call of RULE_KV_LEN keys (persistent
  # forward and kv_rules), compiled on a short call: registers, spills and
  # ptxas' notes do not depend on the sequence length.
  cfg = jaxflash.mosaic_gpu.default_config(
      jax.devices()[0].device_kind, round_up(d, 64), causal=causal,
      kv_len=int(os.environ.get("RULE_KV_LEN", "8192")))
  cfg = dataclasses.replace(cfg, **parse_overrides(overrides))
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (1, seq, 2, d), jnp.bfloat16) for kk in ks)

  def attend(q, k, v):
    return jaxflash.flash_attention(q, k, v, causal=causal, config=cfg,
                                    implementation="mosaic_gpu")
  if mode == "fwd":
    f = jax.jit(attend)
  else:
    f = jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](q))
  jax.block_until_ready(f(q, k, v))
  print("CONFIG", json.dumps(dataclasses.asdict(cfg)), flush=True)


def run_child(argv: list[str], env: dict, timeout: int,
              log: pathlib.Path) -> tuple[str, int | str]:
  """A case's process: its output as one stream, in the order it was
  written (ptxas' lines and warnings must stay with the entry they
  follow), also kept in ``log``; and its return code, or "timeout"."""
  try:
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, check=False)
    text, rc = proc.stdout, proc.returncode
  except subprocess.TimeoutExpired as e:
    out = e.stdout or b""
    text = out.decode() if isinstance(out, bytes) else out
    rc = "timeout"
  log.write_text(text)
  return text, rc


def child_error(text: str) -> str:
  """The last exception line of a failed case's output (or its tail)."""
  errs = re.findall(r"^\w*(?:Error|Exception)\b.*$", text, re.M)
  return (errs[-1] if errs else text.strip()[-300:])[:300]


def run_case(case: str, out: pathlib.Path, timeout: int) -> dict:
  name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", case)
  dump = out / name
  if dump.exists():  # a report of an earlier run would be read as this one's
    shutil.rmtree(dump)
  dump.mkdir(parents=True)
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1",
             MOSAIC_GPU_DUMP_TO=str(dump),
             XLA_PYTHON_CLIENT_PREALLOCATE="false")
  text, rc = run_child([sys.executable, __file__, "--child", case], env,
                       timeout, dump / "process.log")
  # The report goes to files under MOSAIC_GPU_DUMP_TO, or to the output:
  # read one of the two (the same report in both would count twice).
  # (Mosaic GPU writes one NAME.ptxas per kernel, beside its PTX and MLIR
  # when those are dumped too: read the reports alone.)
  files = [p for p in sorted(dump.iterdir())
           if p.is_file() and p.name != "process.log"]
  reports = [p for p in files if p.suffix == ".ptxas"] or files
  dumped = "\n".join(p.read_text(errors="replace") for p in reports)
  source = dumped if ENTRY.search(dumped) else text
  raw = [ln.rstrip() for ln in source.splitlines()
         if "ptxas" in ln or SPILL.search(ln)]
  row = dict(case=case, rc=rc, kernels=parse(source), ptxas_lines=raw)
  cfg = re.search(r"^CONFIG (.*)$", text, re.M)
  row["config"] = json.loads(cfg.group(1)) if cfg else None
  if rc != 0:
    row["error"] = child_error(text)
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--child", help=argparse.SUPPRESS)
  ap.add_argument("--cases", default=DEFAULT_CASES)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--jobs", type=int, default=6)
  ap.add_argument("--timeout", type=int, default=240)
  args = ap.parse_args()
  if args.child:
    child(args.child)
    return
  out = pathlib.Path(args.out) / "ptxas"
  cases = [c.strip() for c in args.cases.split(";") if c.strip()]
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    rows = list(pool.map(lambda c: run_case(c, out, args.timeout), cases))
  (pathlib.Path(args.out) / "ptxas_report.json").write_text(
      json.dumps(rows, indent=1))
  print(f"{'case':48s} {'kernel':34s} regs  spill st/ld  warnings")
  for row in rows:
    if not row["kernels"]:
      print(f"{row['case']:48s} (no ptxas report; rc={row['rc']}) "
            f"{row.get('error', '')[:120]}")
    for k in row["kernels"]:
      print(f"{row['case']:48s} {k['entry'][-34:]:34s} "
            f"{k.get('registers', '?'):>4} "
            f"{k.get('spill_stores', '?'):>5}/{k.get('spill_loads', '?'):<5} "
            f"{len(k['warnings'])}")
      for w in k["warnings"]:
        print(f"    {w[:160]}")


if __name__ == "__main__":
  main()
