"""Timing of jitted calls: back-to-back samples, and interleaved rounds
in a balanced order (shared by the benchmark and ``jaxflash.autotune``)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import jax


def time_fn(fn: Callable, *args, min_sample_s: float = 0.02,
            samples: int = 7) -> float:
  """Median seconds per call: warm up (compile), then ``samples`` samples of
  back-to-back calls, each sample at least ``min_sample_s`` long."""
  jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = max(time.perf_counter() - t, 1e-6)
  reps = max(1, int(min_sample_s / once))
  times = []
  for _ in range(samples):
    t = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / reps)
  return statistics.median(times)


def williams_orders(n: int) -> list[list[int]]:
  """Round orders of ``n`` calls (lists of their indices) from a Williams
  design: over its rounds every call takes every place in a round equally
  often and follows every other call equally often.  ``n`` rounds for an
  even ``n``, ``2 n`` (the rows and their mirrors) for an odd one."""
  if n <= 0:
    return []
  first, lo, hi = [0], 1, n - 1
  while len(first) < n:
    first.append(lo)
    lo += 1
    if len(first) < n:
      first.append(hi)
      hi -= 1
  rows = [[(i + r) % n for i in first] for r in range(n)]
  if n % 2:
    rows += [row[::-1] for row in rows]
  return rows


def time_interleaved(calls: dict, *, min_sample_s: float = 0.02,
                     samples: int = 7, seed: int | str = 0,
                     samples_out: dict | None = None) -> dict:
  """Median seconds per call of each ``name -> (fn, args)``, sampled in
  rounds (one sample of every call per round) so that clock and thermal
  drift during a run touch every implementation alike.  The rounds'
  orders follow a Williams design (:func:`williams_orders`) over the
  calls in an order shuffled by ``seed``: with ``samples`` a multiple of
  the design's length every call takes every place and follows every
  other call equally often, and a different seed (the benchmark derives
  one per shape) gives a different assignment.  On the H200 the order
  mattered: with a fixed order the same kernel timed first in every
  round read slower than a copy of it timed later in 9 of 12 pairs (by
  0.3-1.8%;
  docs/benchmarks/h200-2026-12-04-c9b07cb-early-q-release.md), and
  with each round starting one call later (which keeps every call's
  predecessor) two copies of one kernel read 2.8% and 3.4% apart in two
  runs (docs/benchmarks/h200-2026-12-04-e43b4bb-persistent-pairs.md).
  A call that raises maps to the exception instead of a time (the design
  then continues over the others).

  ``samples_out``, where given, receives each surviving call's seconds
  per call round by round (``samples`` of them, aligned: entry ``r`` of
  every list is round ``r``), for paired comparisons
  (:func:`jaxflash.bench.report.paired_rows`)."""
  reps, out = {}, {}
  for name, (fn, args) in calls.items():
    try:
      jax.block_until_ready(fn(*args))  # compiled and warm
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      once = max(time.perf_counter() - t, 1e-6)
      reps[name] = max(1, int(min_sample_s / once))
    except Exception as e:  # noqa: BLE001 - reported as a row
      out[name] = e
  times = {name: [] for name in reps}
  base = list(times)
  random.Random(seed).shuffle(base)
  for r in range(samples):
    live = [name for name in base if name in times]
    if not live:  # every call failed (in warm-up or an earlier round)
      break
    rows = williams_orders(len(live))
    for name in (live[i] for i in rows[r % len(rows)]):
      fn, args = calls[name]
      try:
        t = time.perf_counter()
        for _ in range(reps[name]):
          res = fn(*args)
        jax.block_until_ready(res)
        times[name].append((time.perf_counter() - t) / reps[name])
      except Exception as e:  # noqa: BLE001 - reported as a row
        out[name] = e
        del times[name]
  out.update({name: statistics.median(ts) for name, ts in times.items()})
  if samples_out is not None:
    samples_out.update({name: list(ts) for name, ts in times.items()})
  return out
