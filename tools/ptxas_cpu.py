"""What ptxas says about the Hopper kernels, on a machine without a GPU:
registers, spills and ptxas' performance notes per kernel and config,
as tools/ptxas_report.py gives them on the GPU machine.

    PYTHONPATH=. python3 tools/ptxas_cpu.py HEAD_DIM {fwd|fwd_bwd}
        [OVERRIDES] [--causal] [--seq 2048] [--batch N]
        [--kv-len-rule 8192]
        [--device-kind "NVIDIA H200"] [--arch sm_90a] [--keep DIR]
        [--out DIR] [--loops]
    PYTHONPATH=. python3 tools/ptxas_cpu.py --cases \
"128:fwd:0:;128:fwd:1:block_kv=176,intra_wg_overlap=0"

OVERRIDES are MosaicConfig fields (``field=value,...``) on top of
``default_config(DEVICE_KIND, head_dim rounded up to 64, kv_len=RULE)``
(RULE from --kv-len-rule, default $RULE_KV_LEN or 8192); a case of
--cases is ``HEAD_DIM:MODE:CAUSAL:OVERRIDES`` as tools/ptxas_report.py
takes it, with --seq, --kv-len-rule, --device-kind and --arch for all.
The call has --batch batches of 2 heads.  A persistent forward with at
most 132 work items (2 heads x seq / 128 x batch) gives each program
one item, and LLVM, which knows the grid, folds the item loop to one
iteration, so the code between items (``prefetch_q``'s waits,
``item_overlap``'s last turn) would not be compiled.  The default batch
makes at least four 128-row items per SM (17 at 2048 keys: 544 items);
--batch 1 gives the one-item programs of the records before s33.
Each case runs in a process of its own (the kernels Mosaic GPU keeps and
the environment it reads are the process's), a few at a time (--jobs).

How: ``jit(f).trace(...).lower(lowering_platforms=("cuda",))`` runs on
the CPU and leaves the serialized kernel modules (the bytes the
mosaic_gpu custom call carries) in
``jax.experimental.mosaic.gpu.core.KNOWN_KERNELS``.  Each goes to
``MosaicGpuCompile``, which the CUDA PJRT plugin exports
(jax-cuda13-pjrt of the installed jax's version: downloaded once by
``pip download`` and unzipped, no install).  That function asks libcuda
only for the compute capability, to pick the PTX target: a fake
libcuda.so.1 (FAKE_SRC below, built once with gcc, loaded before the
plugin so that the plugin's dlopen finds it by its soname) answers 9.0
for sm_90a (--arch sm_100a would give 10.0: not tried).  With
``MOSAIC_GPU_DUMP_PTX=1`` the plugin prints the PTX on stdout (read back
here at the file-descriptor level), then fails to load the module ("JIT
session error: Symbols not found" on stderr): expected, and harmless.
The PTX then goes through the local ``ptxas -arch=ARCH -v``
(PTXAS=/path/to/ptxas, default the one on PATH; it must accept the PTX's
.version, 9.0 from jax 0.11.2: CUDA 13's ptxas).  The ptxas is therefore
this machine's (CUDA 13.0 here, 2026-12-03), not the GPU machine's; the
counts matched the H200's tools/ptxas_report.py for the cases compared:
the d128 forward (the non-causal 176-key rule at 8192 keys) 168
registers with 8/8 bytes of spill stores/loads, and
``128:fwd:1:block_kv=176,intra_wg_overlap=0,consumer_registers=232``
644/656 (docs/benchmarks/h200-2026-12-02-53563bb-ptxas-fa3-tiles.json).

Kernels are numbered in lowering order, which is the order of the traced
calls: kernel0 is the forward, then the backward's passes in
``backend.backward_passes`` order, dQ first (``dq`` or ``dq-paired``)
and then dK/dV (``dkv``, ``dv`` and ``dk``, ``dkv-paired``), or the one
``dkv+atomic-dq``.  (Checked 2026-12-03 on the d128 default: kernel1 has
one TMA store and 4 m64n128 wgmmas (dS K), kernel2 two TMA stores and 8
(P^T dO, dS^T Q).  tools/ptxas_report.py's docstring has "forward,
then dK/dV, then dQ": not the lowering's order, the one here.)  The pass
names printed beside them are read from ``backward_passes`` as the
backward calls it, and left out ("?") when the count does not match.

Setup is cached in ${JAXFLASH_PTX_CACHE:-~/.cache/jaxflash-ptx}: whl/
(the wheel), site/ (unzipped; replaced when jax's version changes) and
fakecuda/.  Needs pip (once), gcc (once) and ptxas; no GPU, no CUDA
driver.  --out DIR writes the rows to DIR/ptxas_cpu.json; --keep DIR
keeps each case's PTX and cubins in DIR/CASE/.  --loops adds each
kernel's tile loops from its SASS (tools/sass_loops.py: instructions per
trip, and with the largest inner forward branch taken), printed under
the kernel's row and kept, with their opcode counts, in the JSON.

``--tokamax`` lowers tokamax's sm90 forward instead of ours, for the
cases' head_dim, length and causal setting (MODE fwd, no OVERRIDES),
with the config its heuristics pick (the benchmark's
``tokamax-mosaic``): the same counts for the anchor's kernel.  It needs
tokamax importable (the wheels of ../shared/gpu/anchor-wheels.sh,
installed with ``pip install --no-deps --target DIR`` and DIR and
``.whl/stub`` on PYTHONPATH, plus ``jaxtyping``).  tokamax asks the
device whether Mosaic GPU runs and how many SMs it has; on the CPU its
``gpu_utils`` checks are answered as an sm90 device and its scheduler
is given --sms SMs (132, the H200's and H100 SXM's).
"""

import argparse
import concurrent.futures
import ctypes
import dataclasses
import importlib.metadata
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile

HERE = pathlib.Path(__file__).resolve().parent
PLUGIN_PACKAGE = "jax-cuda13-pjrt"
PLATFORMS = ("manylinux_2_27_x86_64", "manylinux_2_17_x86_64")
FAKE_SRC = r"""/* Just enough libcuda for MosaicGpuCompile to read the compute
   capability (FAKE_CUDA_CC_MAJOR/MINOR, default 9.0); the plugin's stubs
   report any other symbol as missing. */
#include <stdlib.h>
typedef int CUresult;
typedef int CUdevice;
static int env_int(const char* n, int d) {
  const char* s = getenv(n);
  return s ? atoi(s) : d;
}
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuCtxGetDevice(CUdevice* d) { *d = 0; return 0; }
CUresult cuDeviceGet(CUdevice* d, int o) { *d = 0; return 0; }
CUresult cuDeviceGetCount(int* c) { *c = 1; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
  if (attr == 75) { *v = env_int("FAKE_CUDA_CC_MAJOR", 9); return 0; }
  if (attr == 76) { *v = env_int("FAKE_CUDA_CC_MINOR", 0); return 0; }
  *v = 0;
  return 0;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = "fake libcuda: no GPU";
  return 0;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
  *s = "CUDA_ERROR_FAKE";
  return 0;
}
CUresult cuModuleLoadData(void** m, const void* img) { return 999; }
"""
# A case's result, written by its process (its stdout is the plugin's).
ROW_FILE = "row.json"


# -- setup (cached) -------------------------------------------------------

def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("JAXFLASH_PTX_CACHE")
                      or pathlib.Path.home() / ".cache" / "jaxflash-ptx")


def _pip_python() -> str:
  """An interpreter with pip: this one, else python3 on PATH."""
  for py in (sys.executable, shutil.which("python3")):
    if py and subprocess.run([py, "-m", "pip", "--version"],
                             capture_output=True, check=False).returncode == 0:
      return py
  raise SystemExit(
      f"ptxas_cpu: no pip ({sys.executable} -m pip and python3 -m pip both"
      f" failed); it is needed once, to download {PLUGIN_PACKAGE}")


def plugin_library(cache: pathlib.Path) -> pathlib.Path:
  """xla_cuda_plugin.so of the installed jax's version (downloaded and
  unzipped into the cache the first time)."""
  version = importlib.metadata.version("jax")
  site = cache / "site"
  dist = site / f"{PLUGIN_PACKAGE.replace('-', '_')}-{version}.dist-info"
  if dist.is_dir() and (found := sorted(site.rglob("xla_cuda_plugin.so"))):
    return found[0]
  whl = cache / "whl"
  pattern = f"{PLUGIN_PACKAGE.replace('-', '_')}-{version}-*.whl"
  if not sorted(whl.glob(pattern)):
    py, errors = _pip_python(), []
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    for platform in PLATFORMS:
      cmd = [py, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--python-version", pyver, "--implementation", "cp",
             "--platform", platform, "-d", str(whl),
             f"{PLUGIN_PACKAGE}=={version}"]
      print(f"ptxas_cpu: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
      p = subprocess.run(cmd, capture_output=True, text=True, check=False)
      if p.returncode == 0 and sorted(whl.glob(pattern)):
        break
      errors.append(f"--platform {platform}: rc={p.returncode}: "
                    + (p.stderr.strip().splitlines() or ["?"])[-1])
    else:
      raise RuntimeError(f"ptxas_cpu: pip download of {PLUGIN_PACKAGE}=="
                         f"{version} failed:\n  " + "\n  ".join(errors))
  wheel = sorted(whl.glob(pattern))[-1]
  # Unzipped beside the cache and renamed into place: an interrupted
  # unzip leaves no site/ that looks complete.
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="site.", dir=cache))
  with zipfile.ZipFile(wheel) as z:
    z.extractall(tmp)
  if site.exists():
    shutil.rmtree(site)
  tmp.rename(site)
  found = sorted(site.rglob("xla_cuda_plugin.so"))
  if not found:
    raise RuntimeError(f"ptxas_cpu: no xla_cuda_plugin.so in {wheel}")
  return found[0]


def fake_libcuda(cache: pathlib.Path) -> pathlib.Path:
  """The fake libcuda.so.1 (built with gcc if missing or out of date)."""
  d = cache / "fakecuda"
  so, src = d / "libcuda.so.1", d / "fakecuda.c"
  if so.exists() and src.exists() and src.read_text() == FAKE_SRC:
    return so
  cc = shutil.which(os.environ.get("CC", "gcc"))
  if not cc:
    raise SystemExit("ptxas_cpu: no gcc (or $CC) to build the fake"
                     f" libcuda.so.1 in {d}")
  d.mkdir(parents=True, exist_ok=True)
  src.write_text(FAKE_SRC)
  tmp = d / f"libcuda.so.1.{os.getpid()}"
  p = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(tmp),
                      str(src), "-Wl,-soname,libcuda.so.1"],
                     capture_output=True, text=True, check=False)
  if p.returncode:
    raise RuntimeError(f"ptxas_cpu: building {so} failed:\n{p.stderr}")
  tmp.replace(so)
  return so


def find_ptxas() -> tuple[str, str]:
  """ptxas ($PTXAS or PATH) and its version line."""
  ptxas = shutil.which(os.environ.get("PTXAS", "ptxas"))
  if not ptxas:
    raise SystemExit("ptxas_cpu: no ptxas on PATH (CUDA 13's, for PTX"
                     " .version 9.0; or PTXAS=/path/to/ptxas)")
  p = subprocess.run([ptxas, "--version"], capture_output=True, text=True,
                     check=False)
  lines = [ln for ln in p.stdout.splitlines() if "release" in ln]
  return ptxas, (lines[-1].strip() if lines else "?")


# -- one case (in its own process) ------------------------------------------

def lower_tokamax(spec: dict):
  """tokamax's Mosaic GPU forward for the case, as :func:`lower` gives
  ours (no config: tokamax picks its own)."""
  import types  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.experimental.pallas.mosaic_gpu  # noqa: F401, PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import tokamax  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import core as mgpu_core  # noqa: PLC0415
  from tokamax._src import config as tk_config  # noqa: PLC0415
  from tokamax._src import gpu_utils  # noqa: PLC0415
  from tokamax._src import mosaic_gpu as tk_mgpu  # noqa: PLC0415

  # The CPU answers as an sm90 GPU with spec["sms"] SMs (the persistent
  # kernel's grid); cross_compile skips tokamax's device check.
  gpu_utils.has_mosaic_gpu_support = lambda *a, **k: True
  gpu_utils.is_sm90 = lambda *a, **k: True
  gpu_utils.is_sm80 = gpu_utils.is_sm100 = lambda *a, **k: False
  device = types.SimpleNamespace(core_count=spec["sms"], platform="gpu",
                                 device_kind=spec["device_kind"])
  tk_mgpu.backend = types.SimpleNamespace(get_default_device=lambda: device)

  def attend(q, k, v):
    return tokamax.dot_product_attention(
        q, k, v, is_causal=spec["causal"], implementation="mosaic_gpu")
  d, seq = spec["head_dim"], spec["seq"]
  x = jax.ShapeDtypeStruct((spec.get("batch", 1), seq, 2, d), jnp.bfloat16)
  mgpu_core.KNOWN_KERNELS.clear()
  with tk_config.cross_compile(True):
    jax.jit(attend).trace(x, x, x).lower(lowering_platforms=("cuda",))
  modules = list(mgpu_core.KNOWN_KERNELS.values())
  return None, modules, ["tokamax"] * len(modules)


def lower(spec: dict):
  """The case's config, its Mosaic GPU kernel modules in lowering order,
  and their names (``forward`` and the backward's passes; None when the
  count does not match)."""
  if spec.get("tokamax"):
    return lower_tokamax(spec)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import core as mgpu_core  # noqa: PLC0415

  import jaxflash  # noqa: PLC0415
  from jaxflash import masks, op  # noqa: PLC0415
  from jaxflash.mosaic_gpu import backend  # noqa: PLC0415
  from jaxflash.mosaic_gpu.config import parse_overrides  # noqa: PLC0415
  from jaxflash.triton.common import round_up  # noqa: PLC0415

  d, seq, causal = spec["head_dim"], spec["seq"], spec["causal"]
  cfg = jaxflash.mosaic_gpu.default_config(
      spec["device_kind"], round_up(d, 64), causal=causal,
      kv_len=spec["kv_len_rule"])
  cfg = dataclasses.replace(cfg, **parse_overrides(spec["overrides"]))
  mask = masks.MaskSpec(seq, seq, causal, None, None, None)
  det = op.resolve_deterministic(None)

  def attend(q, k, v):
    return jaxflash.mosaic_gpu.attention(
        q, k, v, mask=mask, softmax_scale=1 / math.sqrt(d), config=cfg,
        deterministic=det)[0]
  if spec["mode"] == "fwd":
    f = attend
  else:
    f = lambda q, k, v: jax.vjp(attend, q, k, v)[1](q)

  passes, real = [], backend.backward_passes

  def named_passes(*args, **kwargs):
    out = real(*args, **kwargs)
    passes.extend(name for name, _ in out)
    return out
  x = jax.ShapeDtypeStruct((spec.get("batch", 1), seq, 2, d), jnp.bfloat16)
  mgpu_core.KNOWN_KERNELS.clear()
  backend.backward_passes = named_passes
  try:
    jax.jit(f).trace(x, x, x).lower(lowering_platforms=("cuda",))
  finally:
    backend.backward_passes = real
  modules = list(mgpu_core.KNOWN_KERNELS.values())
  names = ["forward"] + passes
  return cfg, modules, names if len(names) == len(modules) else None


def module_to_ptx(compile_fn, asm: bytes) -> str:
  """MosaicGpuCompile with the PTX printed on (captured) stdout."""
  sys.stdout.flush()
  with tempfile.TemporaryFile("w+b") as tmp:
    saved = os.dup(1)
    os.dup2(tmp.fileno(), 1)
    try:
      compile_fn(asm, len(asm))  # fails at module load: expected
    finally:
      os.dup2(saved, 1)
      os.close(saved)
    tmp.seek(0)
    text = tmp.read().decode(errors="replace")
  i = text.find("//\n// Generated by LLVM NVPTX")
  if i < 0:
    i = text.find(".version")
  if i < 0:
    raise RuntimeError("no PTX in MosaicGpuCompile's output:\n"
                       + text[-2000:])
  return text[i:]


def child(spec: dict) -> None:
  """Lower, compile to PTX, run ptxas; the row goes to DIR/row.json."""
  sys.path.insert(0, str(HERE))
  from ptxas_report import parse  # noqa: PLC0415

  from jaxflash.mosaic_gpu.config import MosaicConfig  # noqa: PLC0415

  out = pathlib.Path(spec["dir"])
  t0 = time.time()
  cfg, modules, names = lower(spec)
  t1 = time.time()
  ctypes.CDLL(spec["libcuda"], mode=ctypes.RTLD_GLOBAL)
  compile_fn = ctypes.CDLL(spec["plugin"]).MosaicGpuCompile
  compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
  compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
  os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
  paths = []
  for i, asm in enumerate(modules):
    p = out / f"kernel{i}.ptx"
    p.write_text(module_to_ptx(compile_fn, asm))
    paths.append(p)
  t2 = time.time()

  def ptxas(p):
    r = subprocess.run([spec["ptxas"], f"-arch={spec['arch']}", "-v", str(p),
                        "-o", str(p.with_suffix(".cubin"))],
                       capture_output=True, text=True, check=False)
    return r.returncode, r.stdout + r.stderr
  with concurrent.futures.ThreadPoolExecutor(max(len(paths), 1)) as pool:
    reports = list(pool.map(ptxas, paths))
  t3 = time.time()
  kernels = []
  for i, (rc, text) in enumerate(reports):
    # One entry per PTX file: its warnings and notes, wherever parse put
    # them (before or after the entry's report), are that kernel's.
    entries = parse(text)
    k = next((e for e in entries if e["entry"] != "?"), {})
    k = dict(k, kernel=f"kernel{i}", name=names[i] if names else "?",
             rc=rc, warnings=[w for e in entries for w in e["warnings"]],
             ptxas_lines=[ln.rstrip() for ln in text.splitlines()
                          if ln.strip() and "Compile time" not in ln])
    cubin = paths[i].with_suffix(".cubin")
    if spec.get("loops") and rc == 0 and cubin.exists():
      from sass_loops import loops, read_sass, tile_loops  # noqa: PLC0415
      k["loops"] = [l.as_row() for l in tile_loops(loops(read_sass(cubin)))]
    kernels.append(k)
  base = dataclasses.asdict(MosaicConfig())
  fields = dataclasses.asdict(cfg) if cfg is not None else {}
  (out / ROW_FILE).write_text(json.dumps(dict(
      config=fields,
      config_changed=({f: v for f, v in fields.items() if v != base[f]}
                      if cfg is not None else {"tokamax": "its own"}),
      kernels=kernels,
      seconds=dict(lower=round(t1 - t0, 1), ptx=round(t2 - t1, 1),
                   ptxas=round(t3 - t2, 1))), indent=1))


# -- driver -----------------------------------------------------------------

def default_batch(seq: int, sms: int = 132) -> int:
  """Batches of 2 heads that give a persistent forward at least four
  128-row work items per SM."""
  per_batch = 2 * -(-seq // 128)
  return -(-4 * sms // per_batch)


def case_spec(case: str, a) -> dict:
  d, mode, causal, overrides = (case.split(":", 3) + ["", ""])[:4]
  if mode not in ("fwd", "fwd_bwd"):
    raise SystemExit(f"ptxas_cpu: case {case!r}: MODE must be fwd or"
                     " fwd_bwd (HEAD_DIM:MODE:CAUSAL:OVERRIDES)")
  if a.tokamax and (mode != "fwd" or overrides):
    raise SystemExit(f"ptxas_cpu: case {case!r}: --tokamax takes MODE fwd"
                     " and no OVERRIDES (tokamax picks its own config)")
  return dict(case=case, head_dim=int(d), mode=mode,
              causal=bool(int(causal or 0)), overrides=overrides,
              seq=a.seq, batch=a.batch or default_batch(a.seq),
              kv_len_rule=a.kv_len_rule,
              device_kind=a.device_kind, arch=a.arch, loops=a.loops,
              tokamax=a.tokamax, sms=a.sms)


def run_case(spec: dict, work: pathlib.Path, timeout: int) -> dict:
  name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec["case"])
  d = work / name
  if d.exists():  # files of an earlier run would be read as this one's
    shutil.rmtree(d)
  d.mkdir(parents=True)
  spec = dict(spec, dir=str(d))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for v in [v for v in env if v.startswith("MOSAIC_GPU_DUMP")]:
    del env[v]  # MOSAIC_GPU_DUMP_TO would dump everything
  cc = re.fullmatch(r"sm_(\d+)(\d)a?", spec["arch"])
  if cc:
    env["FAKE_CUDA_CC_MAJOR"], env["FAKE_CUDA_CC_MINOR"] = cc.groups()
  from ptxas_report import child_error, run_child  # noqa: PLC0415

  text, rc = run_child([sys.executable, __file__, "--child", json.dumps(spec)],
                       env, timeout, d / "process.log")
  row = dict(case=spec["case"], rc=rc)
  if (d / ROW_FILE).exists():
    row.update(json.loads((d / ROW_FILE).read_text()))
  else:
    row.update(error=child_error(text), kernels=[])
  return row


def short(note: str) -> str:
  note = re.sub(r"^ptxas (info|warning)\s*:\s*", "", note)
  return re.sub(r" in function '[^']*'", "", note)


def report(rows: list[dict]) -> None:
  print(f"{'case':44s} {'kernel':22s} regs  spill st/ld  notes")
  for row in rows:
    if not row["kernels"]:
      print(f"{row['case']:44s} (no report; rc={row['rc']}) "
            f"{row.get('error', '')[:160]}")
      continue
    for k in row["kernels"]:
      notes = [w for w in k["warnings"] if "are spilled" not in w]
      label = f"{k['kernel']} {k['name']}"
      rc = "" if k["rc"] == 0 else f"  ptxas rc={k['rc']}"
      print(f"{row['case']:44s} {label:22s} "
            f"{k.get('registers', '?'):>4} "
            f"{k.get('spill_stores', '?'):>5}/{k.get('spill_loads', '?'):<5} "
            f"{len(notes):>3}{rc}")
      for w in notes:
        print(f"    {short(w)[:160]}")
      if k.get("loops"):
        print("    tile loops (instructions per trip; with the branch"
              " taken): " + ", ".join(
                  f"{l['count']}" + (f" ({l['taken']})" if l["skip"] else "")
                  for l in k["loops"]))
    changed = ", ".join(f"{f}={v}" for f, v in row["config_changed"].items())
    s = row["seconds"]
    print(textwrap.fill(changed, 78, initial_indent="    config (fields off"
                        " MosaicConfig()): ", subsequent_indent="      ",
                        break_on_hyphens=False))
    print(f"    time: lower {s['lower']}s, PTX {s['ptx']}s,"
          f" ptxas {s['ptxas']}s")


def main():
  ap = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--child", help=argparse.SUPPRESS)
  ap.add_argument("head_dim", nargs="?", type=int)
  ap.add_argument("mode", nargs="?", choices=("fwd", "fwd_bwd"))
  ap.add_argument("overrides", nargs="?", default="")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--cases", help="HEAD_DIM:MODE:CAUSAL:OVERRIDES;...")
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--batch", type=int, default=0,
                  help="batches of 2 heads (default: 4 items per SM)")
  ap.add_argument("--kv-len-rule", type=int,
                  default=int(os.environ.get("RULE_KV_LEN", "8192")))
  ap.add_argument("--device-kind", default="NVIDIA H200")
  ap.add_argument("--arch", default="sm_90a")
  ap.add_argument("--keep", help="keep each case's PTX and cubins here")
  ap.add_argument("--out", help="write ptxas_cpu.json here")
  ap.add_argument("--loops", action="store_true",
                  help="tile loops' instruction counts (tools/sass_loops.py)")
  ap.add_argument("--tokamax", action="store_true",
                  help="lower tokamax's forward instead of ours")
  ap.add_argument("--sms", type=int, default=132,
                  help="SMs that --tokamax's persistent grid is given")
  ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
  ap.add_argument("--timeout", type=int, default=600)
  a = ap.parse_args()
  if a.child:
    child(json.loads(a.child))
    return
  if a.cases:
    if a.head_dim is not None:
      ap.error("give HEAD_DIM MODE or --cases, not both")
    cases = [c.strip() for c in a.cases.split(";") if c.strip()]
  elif a.head_dim is None or a.mode is None:
    ap.error("HEAD_DIM and MODE (or --cases) are required")
  else:
    cases = [f"{a.head_dim}:{a.mode}:{int(a.causal)}:{a.overrides}"]
  specs = [case_spec(c, a) for c in cases]

  t0 = time.time()
  cache = cache_dir()
  cache.mkdir(parents=True, exist_ok=True)
  ptxas, ptxas_version = find_ptxas()
  setup = dict(plugin=str(plugin_library(cache)),
               libcuda=str(fake_libcuda(cache)), ptxas=ptxas)
  t1 = time.time()
  print(f"ptxas: {ptxas} ({ptxas_version}), -arch={a.arch}; setup"
        f" {t1 - t0:.1f}s ({cache})", flush=True)
  work = pathlib.Path(a.keep) if a.keep else pathlib.Path(
      tempfile.mkdtemp(prefix="ptxas_cpu."))
  try:
    with concurrent.futures.ThreadPoolExecutor(max(a.jobs, 1)) as pool:
      rows = list(pool.map(
          lambda s: run_case(dict(s, **setup), work, a.timeout), specs))
  finally:
    if not a.keep:
      shutil.rmtree(work, ignore_errors=True)
  for row in rows:
    row.update(ptxas=ptxas_version, arch=a.arch)
  report(rows)
  print(f"total {time.time() - t0:.1f}s"
        + (f"; PTX and cubins in {work}" if a.keep else ""))
  if a.out:
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ptxas_cpu.json").write_text(json.dumps(rows, indent=1))
  if any(row["rc"] != 0 or any(k["rc"] for k in row["kernels"])
         for row in rows):
    sys.exit(1)


if __name__ == "__main__":
  main()
