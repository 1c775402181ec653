"""Context-parallel throughput: ring attention over N devices against one.

    python3 tools/ring_bench.py                         # all GPUs, causal
    python3 tools/ring_bench.py --causal both --kv-heads 4 --impl triton
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python3 tools/ring_bench.py --smoke              # CPU, interpret mode
    python3 tools/ring_bench.py --proxy 2              # one GPU: a proxy

For each sequence length (batch 1, heads 16, head_dim 128, bf16 by
default): one device runs ``jaxflash.flash_attention`` over the whole
sequence; N devices run ``jaxflash.sharding.ring_attention`` under
``shard_map`` on a 1-D mesh ``("context",)``, the sequence split over it
(zig-zag token order when causal).  Both use the same kernel backend
(``--impl``; default: the one ``flash_attention`` picks on this device).
Per row: 1-device and N-device median ms, speedup = 1-device / N-device,
scaling efficiency = speedup / N, TFLOP/s (jaxflash.bench's convention;
N-device figures are the aggregate), and for forward rows the max |diff|
of the outputs.  Writes ``<out>/<name>.json``; the table prints last.

``--proxy N`` (one device): the N-device column is device 0's share of an
N-device ring run alone, with the ring's transfers replaced by local
copies (XLA may elide them), so its "efficiency" is the bound the kernels
and merges leave when every transfer is hidden behind them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflash
from jaxflash import ring, sharding
from jaxflash.bench import core

# CPU smoke run: interpret-mode Triton kernels with small tiles.
SMOKE_TILES = jaxflash.TritonConfig(block_q=16, block_k=16, block_q_dkv=16,
                                    block_k_dkv=16, block_q_dq=16,
                                    block_k_dq=16)


@dataclasses.dataclass(frozen=True)
class Setting:
  """What every row shares."""

  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str
  impl: str
  interpret: bool
  config: Any
  samples: int
  min_sample_s: float


def _kernel_kw(s: Setting) -> dict:
  return dict(implementation=s.impl, interpret=s.interpret, config=s.config)


def single_fns(s: Setting, causal: bool):
  """(forward, forward+backward) on one device, whole sequence."""
  attend = functools.partial(jaxflash.flash_attention, causal=causal,
                             **_kernel_kw(s))

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(attend, q, k, v)
    return vjp(do)
  return jax.jit(attend), jax.jit(fwd_bwd)


def ring_fns(s: Setting, causal: bool, mesh):
  """(forward, forward+backward) by ring attention, sequence split over
  the mesh axis ``context`` (tokens in zig-zag order when causal)."""
  spec = P(None, "context")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 3,
                     out_specs=spec, check_vma=False)
  def attend(q, k, v):
    return sharding.ring_attention(q, k, v, axis_name="context",
                                   causal=causal, zigzag=True,
                                   **_kernel_kw(s))

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(attend, q, k, v)
    return vjp(do)
  return jax.jit(attend), jax.jit(fwd_bwd)


def proxy_fns(s: Setting, causal: bool, n: int, device):
  """(forward, forward+backward) of device 0's blocks of an ``n``-device
  ring, on one device: the ring's loop as it runs there, each transfer a
  local copy (what the kernels and merges cost if it is hidden)."""
  from jaxflash import _context, backends, checks
  from jaxflash.masks import MaskArrays
  mesh = jax.make_mesh((1,), ("context",), axis_types=(AxisType.Auto,),
                       devices=[device])
  backend = backends.get(s.impl)
  params_for = lambda spec: backends.op_params(
      backend, mask=spec, softmax_scale=1.0 / s.head_dim ** 0.5,
      logits_soft_cap=None, config=s.config, interpret=s.interpret,
      deterministic=checks.resolve_deterministic(None))
  plan = _context.Ring("context", n, causal, True, params_for, (),
                       local_forward=ring._local_forward,
                       local_backward=ring._local_backward,
                       transfer=lambda xs: jax.tree.map(jnp.copy, xs))
  spec = P(None, "context")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 3,
                     out_specs=spec, check_vma=False)
  def attend(q, k, v):
    return _context.ring_attention(plan, q, k, v, *MaskArrays())[0]

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(attend, q, k, v)
    return vjp(do)
  return jax.jit(attend), jax.jit(fwd_bwd)


def _inputs(s: Setting, seq: int, device):
  ks = jax.random.split(jax.random.key(seq), 4)
  dt = jnp.dtype(s.dtype)
  q_shape = (s.batch, seq, s.heads, s.head_dim)
  kv_shape = (s.batch, seq, s.kv_heads, s.head_dim)
  make = lambda key, shape: jax.device_put(
      jax.random.normal(key, shape, dt), device)
  return (make(ks[0], q_shape), make(ks[1], kv_shape), make(ks[2], kv_shape),
          make(ks[3], q_shape))


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def run_case(s: Setting, seq: int, causal: bool, modes, devices,
             proxy: int = 0) -> list[dict]:
  """Rows of one (sequence length, causal): one per mode.  ``proxy``: the
  size of the ring whose device 0 one device stands for (0: a real ring
  over ``devices``)."""
  n = proxy or len(devices)
  order = (sharding.zigzag_indices(seq, n) if causal
           else np.arange(seq))
  shape = core.Shape(s.batch, seq, seq, s.heads, s.kv_heads, s.head_dim,
                     causal, s.dtype)
  one = _inputs(s, seq, devices[0])
  single_fwd, single_fb = single_fns(s, causal)
  if proxy:
    # Device 0's blocks: the first 1/n of the zig-zag order.
    ring = tuple(x[:, order[:seq // n]] for x in one)
    ring_fwd, ring_fb = proxy_fns(s, causal, n, devices[0])
  else:
    mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,),
                         devices=devices)
    split = NamedSharding(mesh, P(None, "context"))
    ring = tuple(jax.device_put(x[:, order], split) for x in one)
    ring_fwd, ring_fb = ring_fns(s, causal, mesh)
  fns = {"fwd": (single_fwd, ring_fwd, 3), "fwd_bwd": (single_fb, ring_fb,
                                                       4)}
  time = functools.partial(core.time_fn, samples=s.samples,
                           min_sample_s=s.min_sample_s)
  rows = []
  for mode in modes:
    f1, fn, nargs = fns[mode]
    row = dict(seq=seq, mode=mode, causal=causal, impl=s.impl,
               batch=s.batch, heads=s.heads, kv_heads=s.kv_heads,
               head_dim=s.head_dim, dtype=s.dtype, devices=n, ms_1=None,
               ms_n=None, speedup=None, efficiency=None, tflops_1=None,
               tflops_n=None, max_abs_diff=None, error=None)
    try:
      if mode == "fwd" and not proxy:
        # Ring output (zig-zag order) against the one-device output.
        diff = jax.jit(lambda a, b: jnp.max(jnp.abs(
            a[:, order].astype(jnp.float32) - b.astype(jnp.float32))))
        row["max_abs_diff"] = float(diff(
            f1(*one[:3]), jax.device_put(fn(*ring[:3]), devices[0])))
      row["ms_1"] = time(f1, *one[:nargs]) * 1e3
      row["ms_n"] = time(fn, *ring[:nargs]) * 1e3
      row["speedup"] = row["ms_1"] / row["ms_n"]
      row["efficiency"] = row["speedup"] / n
      f = core.flops(shape, mode)
      row["tflops_1"] = f / (row["ms_1"] * 1e-3) / 1e12
      row["tflops_n"] = f / (row["ms_n"] * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 - a failure is a reported row
      row["error"] = _error(e)
    rows.append(row)
    print(row_line(row), file=sys.stderr, flush=True)
  del one, ring
  gc.collect()
  return rows


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def row_line(r: dict) -> str:
  head = (f"seq {r['seq']:>7} {r['mode']:<7}"
          f" {'causal' if r['causal'] else 'full':<6} {r['impl']}")
  if r["error"]:
    return f"{head}: ERROR {r['error']}"
  return (f"{head}: 1 dev {_fmt(r['ms_1'], '.2f')} ms,"
          f" {r['devices']} dev {_fmt(r['ms_n'], '.2f')} ms, speedup"
          f" {_fmt(r['speedup'], '.2f')}, efficiency"
          f" {_fmt(r['efficiency'], '.0%')}")


def table(rows: list[dict], n: int) -> str:
  cols = ["seq", "mode", "causal", "impl", "1-dev ms", f"{n}-dev ms",
          "speedup", "efficiency", "1-dev TF/s", f"{n}-dev TF/s",
          "max|diff|"]
  lines = [cols]
  for r in rows:
    if r["error"]:
      lines.append([str(r["seq"]), r["mode"], str(r["causal"]), r["impl"],
                    "ERROR: " + r["error"][:80]])
      continue
    lines.append([str(r["seq"]), r["mode"], str(r["causal"]), r["impl"],
                  _fmt(r["ms_1"], ".2f"), _fmt(r["ms_n"], ".2f"),
                  _fmt(r["speedup"], ".2f"), _fmt(r["efficiency"], ".1%"),
                  _fmt(r["tflops_1"], ".1f"), _fmt(r["tflops_n"], ".1f"),
                  _fmt(r["max_abs_diff"], ".3g")])
  widths = [max(len(line[i]) for line in lines if i < len(line))
            for i in range(len(cols))]
  out = []
  for line in lines:
    out.append(" | ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    if line is cols:
      out.append("-+-".join("-" * w for w in widths))
  return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="tools/ring_bench.py",
                              description=__doc__.split("\n")[0])
  p.add_argument("--seqs", default=None,
                 help="comma-separated (default 32768,131072; smoke 256)")
  p.add_argument("--causal", default="on", help="on (default), off or both")
  p.add_argument("--mode", default="both", choices=["fwd", "fwd_bwd", "both"])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=None, help="default 16")
  p.add_argument("--kv-heads", type=int, default=None,
                 help="key/value heads, GQA (default: heads)")
  p.add_argument("--head-dim", type=int, default=None, help="default 128")
  p.add_argument("--dtype", default="bfloat16",
                 choices=["bfloat16", "float16", "float32"])
  p.add_argument("--impl", default=None, choices=["triton", "mosaic_gpu"],
                 help="kernel backend of both sides (default: what"
                      " flash_attention picks here)")
  p.add_argument("--devices", type=int, default=None,
                 help="ring over the first N devices (default: all)")
  p.add_argument("--samples", type=int, default=None,
                 help="timing samples (default 5; smoke 1)")
  p.add_argument("--out", default=os.environ.get("OUT") or ".")
  p.add_argument("--name", default=None, help="file stem of the JSON")
  p.add_argument("--proxy", type=int, default=0,
                 help="one device standing for device 0 of an N-device"
                      " ring, transfers replaced by copies (module doc)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny CPU run with interpret-mode Triton kernels: a"
                      " test of this script, not a performance figure")
  return p.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[dict, list[dict]]:
  """The rows of a run, and its metadata."""
  smoke = args.smoke
  seqs = core.parse_int_list(args.seqs or ("256" if smoke
                                           else "32768,131072"))
  causals = core.parse_causal(args.causal)
  modes = list(core.MODES) if args.mode == "both" else [args.mode]
  heads = args.heads or (2 if smoke else 16)
  head_dim = args.head_dim or (32 if smoke else 128)
  devices = jax.devices()
  if args.devices:
    devices = devices[:args.devices]
  if args.proxy:
    if args.proxy < 2:
      raise ValueError(f"--proxy {args.proxy}: a ring has >= 2 devices")
    devices = devices[:1]
  n = args.proxy or len(devices)
  if n < 2:
    raise ValueError(f"ring attention needs >= 2 devices, have {n}")
  impl = "triton" if smoke else (
      args.impl or ring.kernel_backend(
          jax.ShapeDtypeStruct((1, 1, 1, head_dim), jnp.dtype(args.dtype))))
  s = Setting(batch=args.batch, heads=heads,
              kv_heads=args.kv_heads or heads, head_dim=head_dim,
              dtype=args.dtype, impl=impl, interpret=smoke,
              config=SMOKE_TILES if smoke else None,
              samples=args.samples or (1 if smoke else 5),
              min_sample_s=0.0 if smoke else 0.02)
  rows = []
  for seq in seqs:
    for causal in causals:
      rows += run_case(s, seq, causal, modes, devices, args.proxy)
  dev = devices[0]
  meta = dict(jax_version=jax.__version__, device_kind=dev.device_kind,
              platform=dev.platform, device_count=n,
              date=datetime.date.today().isoformat(), commit=core.commit(),
              impl=impl, batch=s.batch, heads=s.heads, kv_heads=s.kv_heads,
              head_dim=s.head_dim, dtype=s.dtype, samples=s.samples,
              flop_formula=core.FLOP_FORMULA,
              definitions="speedup = ms_1 / ms_n; efficiency = speedup / N;"
                          " N-device TFLOP/s is the aggregate; ring inputs"
                          " are in zig-zag order when causal (the"
                          " permutation is not timed)")
  if args.proxy:
    meta["proxy"] = (f"one device runs device 0's share of a {n}-device"
                     " ring, transfers replaced by local copies: ms_n and"
                     " efficiency bound what hidden transfers allow")
  if smoke:
    meta["note"] = ("CPU smoke run: interpret-mode kernels. NOT a"
                    " performance figure.")
  return meta, rows


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    meta, rows = run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  name = args.name or "ring-{}{}-x{}-{}".format(
      "smoke-" if args.smoke else "",
      meta["device_kind"].lower().replace(" ", "-"), meta["device_count"],
      meta["date"])
  path = os.path.join(args.out, name + ".json")
  with open(path, "w") as f:
    json.dump(dict(meta=meta, results=rows), f, indent=1)
  print(f"\n{meta['device_count']} x {meta['device_kind']}, jax"
        f" {meta['jax_version']}, {meta['impl']}, batch {meta['batch']},"
        f" heads {meta['heads']}/{meta['kv_heads']}, head_dim"
        f" {meta['head_dim']}, {meta['dtype']}; commit {meta['commit']}")
  print(f"wrote {path}\n")
  print(table(rows, meta["device_count"]))
  if args.smoke:
    print("\nCPU smoke run (interpret mode): NOT a performance figure.")
  return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
