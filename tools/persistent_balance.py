"""Load balance of the forward's work items over the SMs, by model.

    python3 tools/persistent_balance.py [--sms 132] [--overhead 0.5]

A work item is one (batch, head, query group of 128 rows); its cost is
the key tiles it streams (128 keys each: ``G - g`` for the ``g``-th
longest of ``G`` groups on a causal call) plus ``--overhead`` tiles for
its start and epilogue.  For the benchmark grid's causal shapes (16,384
tokens, width 2048) it prints the makespan over the ideal (total cost /
SMs) of four schedules:

* ``round robin``: the persistent grid's static order (program ``sm``
  takes items ``sm, sm + n, ...``; heads fastest, then query groups
  longest first, then batch: ``forward.for_each_item``);
* ``greedy``: each item, in the plain grid's launch order (Mosaic GPU
  launches the last grid axis fastest: batch, then query groups longest
  first, then heads), to the SM that frees first (the hardware's block
  scheduler on the plain grid);
* ``pairs``: query groups ``g`` and ``G-1-g`` of one (batch, head) as one
  unit of equal cost, units dealt round robin;
* ``slowest``: greedy, in the plain grid's launch order with
  ``groups_slowest`` (batch fastest, then heads, then query groups
  longest first: every (batch, head)'s longest group before any second
  longest).

A model, not a measurement: it ignores L2 reuse and that items differ in
per-tile time (masked diagonal tiles).
"""

from __future__ import annotations

import argparse
import heapq


def items(batch, heads, groups):
  return [groups - g for _ in range(batch) for g in range(groups)
          for _ in range(heads)]


def launch_order(batch, heads, groups):
  """The plain grid's items as the hardware launches them."""
  return [groups - g for _ in range(heads) for g in range(groups)
          for _ in range(batch)]


def slowest_order(batch, heads, groups):
  """The plain grid's items as launched with ``groups_slowest``."""
  return [groups - g for g in range(groups) for _ in range(heads)
          for _ in range(batch)]


def round_robin(costs, n):
  t = [0.0] * n
  for w, c in enumerate(costs):
    t[w % n] += c
  return max(t)


def greedy(costs, n):
  heap = [0.0] * n
  for c in costs:
    heapq.heappush(heap, heapq.heappop(heap) + c)
  return max(heap)


def pairs(batch, heads, groups, n, overhead):
  units = []
  for _ in range(batch):
    for p in range((groups + 1) // 2):
      q = groups - 1 - p
      cost = (groups - p) + overhead + ((groups - q) + overhead if q != p
                                        else 0)
      units += [cost] * heads
  return round_robin(units, n)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--sms", type=int, default=132)
  ap.add_argument("--overhead", type=float, default=0.5)
  args = ap.parse_args(argv)
  n, ov = args.sms, args.overhead
  print("head_dim  seq    items  round robin  greedy  pairs  slowest")
  for d in (64, 128, 256):
    for s in (1024, 2048, 4096, 8192, 16384):
      b, h, g = 16384 // s, 2048 // d, s // 128
      costs = [c + ov for c in items(b, h, g)]
      launched = [c + ov for c in launch_order(b, h, g)]
      slow = [c + ov for c in slowest_order(b, h, g)]
      ideal = sum(costs) / n
      print(f"{d:<9} {s:<6} {len(costs):<6} "
            f"{round_robin(costs, n) / ideal:<12.3f} "
            f"{greedy(launched, n) / ideal:<7.3f} "
            f"{pairs(b, h, g, n, ov) / ideal:<6.3f} "
            f"{greedy(slow, n) / ideal:.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
