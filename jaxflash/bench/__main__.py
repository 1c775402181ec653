"""``python -m jaxflash.bench``: attention speed, side by side.

    python -m jaxflash.bench                       # the full grid, GPU
    python -m jaxflash.bench --head-dims 128 --seqs 4096,8192 --mode fwd
    python -m jaxflash.bench --kv-ratio 4 --mask segments:8
    python -m jaxflash.bench --cpu-smoke           # tiny run, no GPU needed

Writes ``<out>/<device>-<date>.{json,md,png}``; the JSON schema is in
docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import checks, reference
from jaxflash.bench import core, decode, impls, report
from jaxflash.flashmask import FlashMask

# Output-check tolerance, relative to max(1, max|ref|): a few units in the
# last place of each dtype; a wrong mask or tile shows as errors of 1e-1.
# FP8: the inputs are exact in e4m3 (rounded there), the kernels round P
# to e4m3 for the P V product (a few percent of an output).
CHECK_TOL = {"bfloat16": 2**-6, "float16": 2**-8, "float32": 1e-4,
             "float8_e4m3fn": 2**-4}
# --dtype fp8 names e4m3 (FlashAttention-3's forward format).
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
          "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxflash.bench",
                              description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="grid",
                 help="grid (the options below), models (attention calls"
                      " of released models: core.MODELS) or"
                      " models:NAME,...")
  p.add_argument("--head-dims", default="64,128,256")
  p.add_argument("--seqs", default="1024,2048,4096,8192,16384")
  p.add_argument("--causal", default="both", help="both, on or off")
  p.add_argument("--tokens", type=int, default=16384,
                 help="tokens per call (batch = tokens / seq)")
  p.add_argument("--width", type=int, default=2048,
                 help="model width (heads = width / head_dim)")
  p.add_argument("--kv-ratio", type=int, default=1,
                 help="query heads per key/value head (GQA)")
  p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                 help="fp8: float8_e4m3fn inputs with scale 1 (standard"
                      " normal values are exact e4m3 numbers once"
                      " rounded), forward only")
  p.add_argument("--mask", default=None,
                 help="none, segments:N, window:L, bias (a dense bias per"
                      " head, differentiated in fwd_bwd), dense-segments:N"
                      " (segments:N as a dense boolean mask) or a FlashMask"
                      " pattern (flashmask-doc:N, flashmask-prefix:N,"
                      " flashmask-question:N, flashmask-window:L; the"
                      " peers get its dense form; use --causal off)")
  p.add_argument("--mode", default="both",
                 choices=["fwd", "fwd_bwd", "both", "decode", "mla"],
                 help="decode: new queries over a paged KV cache, in"
                      " bandwidth (bench/decode.py; the --decode-*"
                      " options)")
  p.add_argument("--decode-batches", default="1,8,32,128")
  p.add_argument("--decode-kv-lens", default="1024,8192,32768,131072")
  p.add_argument("--decode-page-sizes", default="16,64")
  p.add_argument("--decode-q-lens", default="1")
  p.add_argument("--decode-heads", default="32:8",
                 help="query heads:key/value heads (head_dim from"
                      " --head-dims, first value)")
  p.add_argument("--impls", default=None,
                 help=f"comma-separated subset of {', '.join(impls.IMPLS)}")
  p.add_argument("--mosaic-variants", default="",
                 help="extra Hopper-kernel rows, each the tuned default"
                      " config with overrides, timed in the same rounds:"
                      " 'NAME:field=value,...;NAME2:...' (0/1 for booleans)")
  p.add_argument("--paged-variants", default="",
                 help="--mode decode: extra paged-kernel rows, each a"
                      " launch config, timed in the same rounds:"
                      " 'KERNEL/NAME:field=value,...;...' with KERNEL"
                      " triton (PagedConfig) or mosaic_gpu"
                      " (MosaicPagedConfig); rows jaxflash-paged[NAME],"
                      " jaxflash-paged-mosaic[NAME]")
  p.add_argument("--tuned-for", default=None, metavar="DEVICE_KIND",
                 help="the --mosaic-variants start from tuning.json's"
                      " entry for this device kind (e.g. 'NVIDIA H200')"
                      " instead of this device's: a Hopper part without"
                      " an entry can time the H200's configs, and"
                      " 'default' names the untuned entry (what an"
                      " aliased kind such as the H100 SXM ran before)."
                      " The jaxflash-mosaic_gpu row stays this device's"
                      " default; the other variants are paired with the"
                      " first one")
  p.add_argument("--out", default="docs/benchmarks")
  p.add_argument("--name", default=None, help="file stem of the outputs")
  p.add_argument("--samples", type=int, default=7)
  p.add_argument("--sample-seconds", type=float, default=0.02,
                 help="least time of one sample (back-to-back calls of"
                      " one implementation). The default's short bursts"
                      " leave the H200 below its sustained power cap;"
                      " 0.5 s or more reproduce the sustained regime of"
                      " training, which can rank kernels differently"
                      " (docs/benchmarks/README.md)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the rounds' call orders, with each shape's"
                      " own (give replicated runs different seeds)")
  p.add_argument("--cpu-smoke", action="store_true",
                 help="tiny CPU run (reference, interpret-mode kernels):"
                      " a smoke test, not a performance figure")
  return p


def _inputs(shape: core.Shape, seed: int = 0):
  ks = jax.random.split(jax.random.key(seed), 4)
  dt = shape.jnp_dtype
  if dt.itemsize == 1:  # FP8: drawn in bfloat16, rounded to it
    q, k, v, do = _inputs(dataclasses.replace(shape, dtype="bfloat16"), seed)
    return q.astype(dt), k.astype(dt), v.astype(dt), do
  q = jax.random.normal(ks[0], (shape.batch, shape.seq_q, shape.heads,
                                shape.head_dim), dt)
  k = jax.random.normal(ks[1], (shape.batch, shape.seq_k, shape.kv_heads,
                                shape.head_dim), dt)
  v = jax.random.normal(ks[2], k.shape, dt)
  do = jax.random.normal(ks[3], q.shape, dt)
  return q, k, v, do


# Query rows of the checked slice: the reference holds this many rows'
# logits against every key (at 32k keys and 7 query heads the whole of
# them would be 56 GiB).
SPOT_ROWS = 2048


def _spot(x, shape: core.Shape, kv: bool = False):
  """The slice whose output is checked: batch row 0, the first two
  key/value heads' query heads and the last :data:`SPOT_ROWS` queries
  (bounds the reference's N^2 memory; the masks align bottom-right, so
  the last rows keep their keys)."""
  n_kv = min(2, shape.kv_heads)
  if kv:
    return x[:1, :, :n_kv]
  return x[:1, -SPOT_ROWS:, :n_kv * (shape.heads // shape.kv_heads)]


def _reference_out(shape, q, k, v, mask_kw):
  kw = {}
  if "segment_ids" in mask_kw:
    seg = mask_kw["segment_ids"][:1]
    kw["segment_ids"] = (seg[:, -SPOT_ROWS:], seg)
  if "local_window_size" in mask_kw:
    kw["window"] = mask_kw["local_window_size"]
  if "dropout_rate" in mask_kw:
    # The spot's keep mask: batch row 0's seed, its rows' first position.
    rate, seeds = checks.dropout(mask_kw["dropout_rate"],
                                 mask_kw["dropout_rng"], False, shape.batch)
    first_row = max(shape.seq_q - SPOT_ROWS, 0)
    kw.update(dropout_rate=rate, dropout_seeds=seeds[:1].at[:, 2].set(
        first_row))
  heads = min(2, shape.kv_heads) * (shape.heads // shape.kv_heads)
  for name, ref_name in (("bias", "bias"), ("mask", "dense_mask")):
    if name in mask_kw:  # the spot slice (_spot) of the dense array
      x = mask_kw[name]
      if isinstance(x, FlashMask):
        x = impls.flashmask_dense(x, shape, rows=SPOT_ROWS)
      kw[ref_name] = x[:1, :heads, -SPOT_ROWS:]
  # FP8 inputs: the reference of their values in float32.
  def up(x):
    return x.astype(jnp.float32) if shape.jnp_dtype.itemsize == 1 else x
  f = jax.jit(lambda q, k, v: reference.attention(
      up(q), up(k), up(v), causal=shape.causal, **kw)[0])
  return f(_spot(q, shape), _spot(k, shape, True), _spot(v, shape, True))


def prepare(name: str, shape: core.Shape, modes, arrays, ref_out,
            mask_kw, *, interpret: bool, makers=None,
            fingerprints=None) -> dict:
  """Builds and checks one implementation in every mode: ``mode -> (fn,
  args, max_abs_err, peak_bytes)``, or ``mode -> row`` where it fails or
  answers wrongly.  Each (implementation, mode) is compiled once, ahead of
  time; that executable is timed and its memory analysis gives the peak.
  For the Hopper kernel and its variants, ``fingerprints[mode]`` gets the
  hash of the program traced for that compile
  (:func:`core.program_fingerprint`)."""
  q, k, v, do = arrays
  maker = (makers or impls.IMPLS)[name]
  # Dense bias and mask arrays (N x N) and FlashMask columns are arguments
  # of the timed program, never constants compiled into it; peers take a
  # FlashMask as the dense mask it stands for, made here, untimed.
  extra = {n: mask_kw[n] for n in ("bias", "mask") if n in mask_kw}
  if (isinstance(extra.get("mask"), FlashMask)
      and not name.startswith("jaxflash")):
    extra["mask"] = impls.flashmask_dense(extra["mask"], shape)
  names = tuple(extra)

  def attend(q, k, v, *dense):
    return maker(shape, dict(mask_kw, **dict(zip(names, dense))),
                 interpret)(q, k, v)

  dense = tuple(extra.values())
  try:
    traced_fwd = jax.jit(attend).trace(q, k, v, *dense)
    fwd = traced_fwd.lower().compile()
    got = np.asarray(_spot(fwd(q, k, v, *dense), shape), np.float32)
    want = np.asarray(ref_out, np.float32)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    tol = CHECK_TOL[shape.dtype] * max(1.0, float(np.max(np.abs(want))))
    if not np.isfinite(err) or err > tol:
      return {mode: core.record(shape, name, mode, max_abs_err=err,
                                error=f"wrong result: max_abs_err {err:.3g}"
                                      f" > tolerance {tol:.3g}")
              for mode in modes}
  except Exception as e:  # noqa: BLE001 - every failure is a reported row
    return {mode: core.record(shape, name, mode, error=_message(e))
            for mode in modes}

  def fwd_bwd(q, k, v, do, *dense):
    # A dense bias (first of the dense arguments) is differentiated too:
    # its gradient, dbias, is part of the backward measured.
    n = 4 if "bias" in names else 3
    primal = lambda *a: attend(*a[:n], *dense[n - 3:])
    _, vjp = jax.vjp(primal, q, k, v, *dense[:n - 3])
    return vjp(do)

  out = {}
  for mode in modes:
    try:
      if mode == "fwd":
        traced, fn, args = traced_fwd, fwd, (q, k, v, *dense)
      else:
        args = (q, k, v, do, *dense)
        traced = jax.jit(fwd_bwd).trace(*args)
        fn = traced.lower().compile()
      jax.block_until_ready(fn(*args))  # run errors are this row's
      out[mode] = (fn, args, err, core.compiled_bytes(fn))
      if fingerprints is not None and name.startswith(_HOPPER):
        fingerprints[mode] = core.program_fingerprint(traced.jaxpr)
    except Exception as e:  # noqa: BLE001 - every failure is a reported row
      out[mode] = core.record(shape, name, mode, error=_message(e))
  return out


def _message(e: Exception) -> str:
  return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# The Hopper kernel's rows (its tuned default and ``--mosaic-variants``).
_HOPPER = "jaxflash-mosaic_gpu"


def run_shape(shape: core.Shape, names, modes, *, interpret: bool,
              samples: int, progress=None, makers=None,
              seed: int = 0, sample_seconds: float = 0.02,
              pair_with=None) -> list[dict]:
  """Every implementation and mode at one shape: built and checked one by
  one, then timed together in interleaved rounds."""
  arrays = _inputs(shape)
  mask_kw = impls.mask_kwargs(shape)
  skipped = impls.tiles_skipped(shape, mask_kw)
  ref_out = _reference_out(shape, *arrays[:3], mask_kw)
  rows, calls, errs = {}, {}, {}
  # (mode, program hash) -> the first Hopper row that built it, so that a
  # variant whose overrides change nothing on this call is marked.
  first_with, same_as = {}, {}
  for name in names:
    if progress is not None:
      progress.set_description(
          f"d{shape.head_dim} s{shape.seq_q}"
          f"{' causal' if shape.causal else ''} {name}")
    prints = {}
    got = prepare(name, shape, modes, arrays, ref_out, mask_kw,
                  interpret=interpret, makers=makers, fingerprints=prints)
    for mode, h in prints.items():
      first = first_with.setdefault((mode, h), name)
      if first != name:
        same_as[name, mode] = first
    for mode, res in got.items():
      if isinstance(res, dict):
        rows[name, mode] = res
      else:
        calls[name, mode], errs[name, mode] = res[:2], res[2:]
    if progress is not None:
      progress.update(len(modes))
  # One seed per shape (from the run's and the shape's), so that shapes
  # with as many calls do not all get the same assignment of places.
  per_round = {}
  times = core.time_interleaved(calls, samples=samples,
                                min_sample_s=sample_seconds,
                                seed=f"{seed}:{shape}", samples_out=per_round)
  for key, secs in times.items():
    name, mode = key
    if isinstance(secs, Exception):
      rows[key] = core.record(shape, name, mode, error=_message(secs))
    else:
      err, peak = errs[key]
      rows[key] = core.record(
          shape, name, mode, ms=secs * 1e3, max_abs_err=err,
          peak_bytes=peak, samples_ms=[t * 1e3 for t in per_round[key]],
          same_program_as=same_as.get(key),
          paired_with=(pair_with or {}).get(name), tiles_skipped=skipped)
  return [rows[name, mode] for name in names for mode in modes]


def _impl_names(args, known: dict, cpu_names) -> list[str] | None:
  """The implementations to run: ``--impls``, else all of ``known`` (the
  CPU ones with ``--cpu-smoke``); None, with the error printed, for an
  unknown name."""
  if not args.impls:
    return list(cpu_names if args.cpu_smoke else known)
  names = [n.strip() for n in args.impls.split(",") if n.strip()]
  unknown = [n for n in names if n not in known]
  if unknown:
    print(f"error: unknown implementations {unknown}; known:"
          f" {list(known)}", file=sys.stderr)
    return None
  return names


def _run_meta(args, suffix: str, **fields) -> tuple[dict, str]:
  """A run's JSON header (device, jax, commit, date, timing settings and
  ``fields``) and its output path without extension:
  ``<out>/<name>``, by default ``<device>-<date><suffix>``."""
  dev = jax.devices()[0]
  meta = dict(jax_version=jax.__version__, device_kind=dev.device_kind,
              device_count=jax.device_count(), commit=core.commit(),
              date=datetime.date.today().isoformat(), **fields,
              samples=args.samples, seed=args.seed,
              sample_seconds=args.sample_seconds)
  if args.cpu_smoke:
    meta["note"] = ("CPU smoke run: kernels in Pallas interpret mode. NOT a"
                    " performance figure.")
  os.makedirs(args.out, exist_ok=True)
  stem = args.name or "{}-{}{}".format(
      dev.device_kind.lower().replace(" ", "-"), meta["date"], suffix)
  return meta, os.path.join(args.out, stem)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  args.dtype = DTYPES[args.dtype]
  on_gpu = jax.default_backend() == "gpu"
  if args.mode in (decode.MODE, decode.MLA_MODE):
    return _decode_main(args, on_gpu)
  if not args.sample_seconds >= 0:
    print(f"error: --sample-seconds={args.sample_seconds} must be >= 0",
          file=sys.stderr)
    return 2
  try:
    if args.cpu_smoke:
      shapes = core.grid(head_dims=[32], seqs=[64, 128],
                         causal=core.parse_causal(args.causal), tokens=128,
                         width=64, kv_ratio=args.kv_ratio, dtype=args.dtype,
                         mask=core.parse_mask(args.mask))
    else:
      shapes = core.parse_shapes(args.shapes, args.dtype) or core.grid(
          head_dims=core.parse_int_list(args.head_dims),
          seqs=core.parse_int_list(args.seqs),
          causal=core.parse_causal(args.causal), tokens=args.tokens,
          width=args.width, kv_ratio=args.kv_ratio, dtype=args.dtype,
          mask=core.parse_mask(args.mask))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not on_gpu and not args.cpu_smoke:
    print(f"No GPU here (JAX's default backend is {jax.default_backend()!r})."
          " The benchmark measures CUDA GPUs. For a smoke test of the"
          " reference and the interpret-mode kernels on this CPU (not a"
          " performance figure), run:\n  python -m jaxflash.bench"
          " --cpu-smoke")
    return 0
  names = _impl_names(args, impls.IMPLS, impls.CPU_IMPLS)
  if names is None:
    return 2
  makers = dict(impls.IMPLS)
  try:
    variants = impls.parse_mosaic_variants(args.mosaic_variants,
                                           args.tuned_for)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  makers.update(variants)
  names += list(variants)
  # --tuned-for: the base row is this device's own default, so the
  # variants are paired with the first of them (another kind's config,
  # e.g. "h200:stages=2") rather than with it.
  first = next(iter(variants), None)
  pair_with = ({v: first for v in variants if v != first}
               if args.tuned_for else {})
  modes = list(core.MODES) if args.mode == "both" else [args.mode]
  interpret = not on_gpu

  meta, base = _run_meta(args, "", flop_formula=core.FLOP_FORMULA,
                         tuned_for=args.tuned_for)

  from tqdm import tqdm
  results = []
  bar = tqdm(total=len(shapes) * len(names) * len(modes), unit="run",
             file=sys.stderr)
  for shape in shapes:
    rows = run_shape(shape, names, modes, interpret=interpret,
                     samples=args.samples, progress=bar, makers=makers,
                     seed=args.seed, sample_seconds=args.sample_seconds,
                     pair_with=pair_with)
    for row in rows:  # one line per row as it lands: a cut run still reports
      bar.write(report.row_line(row), file=sys.stderr)
    results += rows
    # The JSON so far after every shape: a run stopped by a time limit keeps
    # what it measured (marked partial until the grid is done).
    report.write_json(base + ".json", {**meta, "partial": True}, results)
    gc.collect()
  bar.close()

  report.write_json(base + ".json", meta, results)
  with open(base + ".md", "w") as f:
    f.write(report.markdown(meta, results))
  plotted = report.plot(base + ".png", meta, results)
  print(report.terminal_table(results))
  if args.cpu_smoke:
    print("\nCPU smoke run (interpret mode): NOT a performance figure.")
  print(f"\nwrote {base}.json, {base}.md" + (f", {base}.png" if plotted
                                              else ""))
  return 0


def _decode_main(args, on_gpu: bool) -> int:
  """``--mode decode`` (or ``mla``): the decode grid, its JSON, table and
  plot."""
  mla = args.mode == decode.MLA_MODE
  if mla:
    # FlashMLA's grid where the decode options keep their defaults:
    # 128 heads over one 576-wide latent vector per token, pages of 64.
    p = _parser()
    for name, value in (("decode_batches", "1,16,64,128"),
                        ("decode_kv_lens", "1024,4096,16384,65536"),
                        ("decode_page_sizes", "64"), ("decode_q_lens", "1,2"),
                        ("decode_heads", "128:1"), ("head_dims", "576")):
      if getattr(args, name) == p.get_default(name):
        setattr(args, name, value)
  if args.dtype == DTYPES["fp8"]:
    print("error: --mode decode takes --dtype bfloat16 or float16 (the"
          " queries' and cache's); its FP8 cache is the jaxflash-paged-fp8"
          " row", file=sys.stderr)
    return 2
  try:
    heads, _, kv_heads = args.decode_heads.partition(":")
    heads, kv_heads = int(heads), int(kv_heads or heads)
    head_dim = core.parse_int_list(args.head_dims)[0]
    if args.cpu_smoke:
      shapes = decode.grid(batches=[2], kv_lens=[160],
                           page_sizes=[16], q_lens=[1, 3], heads=4,
                           kv_heads=1 if mla else 2,
                           head_dim=80 if mla else 32, dtype="float32")
    else:
      shapes = decode.grid(
          batches=core.parse_int_list(args.decode_batches),
          kv_lens=core.parse_int_list(args.decode_kv_lens),
          page_sizes=core.parse_int_list(args.decode_page_sizes),
          q_lens=core.parse_int_list(args.decode_q_lens), heads=heads,
          kv_heads=kv_heads, head_dim=head_dim, dtype=args.dtype)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not on_gpu and not args.cpu_smoke:
    print("No GPU here; for a smoke test on this CPU run: python -m"
          " jaxflash.bench --mode decode --cpu-smoke")
    return 0
  names = (_impl_names(args, decode.MLA_IMPLS, decode.MLA_CPU_IMPLS)
           if mla else _impl_names(args, decode.IMPLS, decode.CPU_IMPLS))
  if names is None:
    return 2
  try:
    variants = decode.parse_paged_variants(args.paged_variants)
  except ValueError as e:
    print(f"error: --paged-variants: {e}", file=sys.stderr)
    return 2
  if variants and mla:
    print("error: --paged-variants apply to --mode decode",
          file=sys.stderr)
    return 2
  names += list(variants)
  meta, base = _run_meta(
      args, "-decode", bandwidth="gbytes_per_s = bytes of K and V of the"
      " valid tokens / median time / 1e9")
  results = []
  for shape in shapes:
    rows = decode.run_shape(shape, names, interpret=not on_gpu,
                            samples=args.samples, seed=args.seed,
                            sample_seconds=args.sample_seconds,
                            extra=variants)
    results += rows
    report.write_json(base + ".json", {**meta, "partial": True}, results)
    gc.collect()
  report.write_json(base + ".json", meta, results)
  print(decode.table(results))
  if args.cpu_smoke:
    print("\nCPU smoke run (interpret mode): NOT a performance figure.")
  plotted = decode.plot(base + ".png", results)
  print(f"\nwrote {base}.json" + (f", {base}.png" if plotted else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
