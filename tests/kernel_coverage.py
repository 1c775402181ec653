"""What the Hopper kernels' interpreter runs cover, found by tracing them.

The Mosaic GPU kernels are Python that runs while JAX traces them: a
``pallas_call`` builds its program then, and the interpreter (race
detection included) afterwards runs that program.  So tracing a run with
``jax.make_jaxpr`` (no compile, no execution; a fraction of a second)
tells

* which lines of ``jaxflash/mosaic_gpu/*.py`` the run reaches (its
  coverage: a line no run reaches is kernel code no interpreter test
  checks), and
* which Pallas kernels it builds (hashed as tools/kernel_fingerprint.py
  does: each kernel's parameters minus names and debug information, and
  the shapes it is called with): two runs that build the same kernels
  test the same program twice.

tests/test_mosaic_gpu.py runs every interpreter run it registers, a
per-commit few (``PER_COMMIT``, a greedy set cover of all the runs' lines)
on every commit and the others as ``slow``; its guard test re-traces them
and checks the cover and that no program runs twice.  When the kernels or
the runs change, print the new selection with

    PYTHONPATH=. python tests/kernel_coverage.py

and paste it over ``PER_COMMIT`` in tests/test_mosaic_gpu.py.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterable

REGENERATE = "PYTHONPATH=. python tests/kernel_coverage.py"

# The parts of a run, each traced on its own: the forward kernel, and the
# backward kernels (dQ, dK/dV) from given residuals.
PARTS = ("fwd", "bwd")


def _kernel_dir() -> str:
  import jaxflash.mosaic_gpu
  return os.path.dirname(os.path.abspath(jaxflash.mosaic_gpu.__file__))


def kernel_texts(jaxpr) -> list[str]:
  """The Pallas kernel calls of a traced program, in order, as text
  (tools/kernel_fingerprint.py's, which hashes the same)."""
  tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                       "tools")
  if tools not in sys.path:
    sys.path.insert(0, tools)
  import kernel_fingerprint
  return kernel_fingerprint.kernel_texts(jaxpr)


class _LineRecorder:
  """(file, line) of every line of ``jaxflash/mosaic_gpu`` executed while
  recording, by ``sys.monitoring`` LINE events (other code's events are
  switched off at their first occurrence, so recording costs little)."""

  def __init__(self):
    mon = sys.monitoring
    self.root = _kernel_dir() + os.sep
    self.tool = next((i for i in range(6) if mon.get_tool(i) is None), None)
    if self.tool is None:
      raise RuntimeError("no free sys.monitoring tool id")
    mon.use_tool_id(self.tool, "jaxflash kernel coverage")
    self.lines: set[tuple[str, int]] = set()
    mon.register_callback(self.tool, mon.events.LINE, self._on_line)

  def _on_line(self, code, line):
    if code.co_filename.startswith(self.root):
      self.lines.add((os.path.basename(code.co_filename), line))
      return None
    return sys.monitoring.DISABLE

  def record(self, fn: Callable[[], object]):
    """Runs ``fn`` and returns ``(its result, the lines it reached)``."""
    mon = sys.monitoring
    self.lines = set()
    mon.restart_events()  # what an earlier recording switched off
    mon.set_events(self.tool, mon.events.LINE)
    try:
      result = fn()
    finally:
      mon.set_events(self.tool, 0)
    return result, frozenset(self.lines)

  def close(self):
    sys.monitoring.register_callback(self.tool, sys.monitoring.events.LINE,
                                     None)
    sys.monitoring.free_tool_id(self.tool)


def trace_runs(runs: dict[str, dict[str, tuple[Callable, tuple]]]):
  """Traces every run's parts, ``runs = {name: {part: (fn, args)}}`` with
  ``args`` abstract (``jax.ShapeDtypeStruct``), each after
  ``jax.clear_caches()``.  Returns ``{name: (lines, {part: hash})}``:
  the union of the lines its parts reached and a hash of each part's
  Pallas kernels.

  One part is traced first and dropped: lines that run once per process
  (a cache's first fill) belong to no run."""
  import jax

  recorder = _LineRecorder()
  try:
    def one(fn, args):
      jax.clear_caches()
      jaxpr, lines = recorder.record(lambda: jax.make_jaxpr(fn)(*args))
      texts = kernel_texts(jaxpr)
      assert texts, "no Pallas kernel in the traced program"
      digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
      return lines, digest

    first = next(iter(runs.values()))
    one(*next(iter(first.values())))  # the warm-up
    out = {}
    for name, parts in runs.items():
      lines, hashes = frozenset(), {}
      for part, (fn, args) in parts.items():
        part_lines, hashes[part] = one(fn, args)
        lines |= part_lines
      out[name] = (lines, hashes)
    return out
  finally:
    recorder.close()


def duplicates(traced) -> list[tuple[str, str, str]]:
  """``(part, run, earlier run)`` for each run part whose kernels an
  earlier run's same part built already."""
  seen, dups = {}, []
  for name, (_, hashes) in traced.items():
    for part, digest in hashes.items():
      if (part, digest) in seen:
        dups.append((part, name, seen[part, digest]))
      else:
        seen[part, digest] = name
  return dups


def greedy_cover(sets: dict[str, frozenset],
                 cost: Callable[[str], float] = lambda name: 1.0,
                 ) -> list[str]:
  """A greedy set cover of the union of ``sets``: repeatedly the run that
  reaches the most lines not yet reached per unit of ``cost`` (ties: the
  cheaper, then the earlier run)."""
  left = set().union(*sets.values())
  order = list(sets)
  chosen = []
  while left:
    best = max(order, key=lambda n: (len(sets[n] & left) / cost(n),
                                     -cost(n), -order.index(n)))
    if not sets[best] & left:
      break
    chosen.append(best)
    left -= sets[best]
  return chosen


def uncovered(sets: dict[str, frozenset], chosen: Iterable[str]) -> set:
  """What some run covers that none of ``chosen`` does."""
  every = set().union(*sets.values())
  return every - set().union(*(sets[n] for n in chosen if n in sets))


def main():
  # The interpreter's threads: 8 host devices, set before jax is imported
  # (tests/conftest.py does the same under pytest).
  if "--xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import time

  import test_mosaic_gpu as t

  runs = t.interpreter_runs()
  start = time.time()
  traced = trace_runs(t.traced_parts(runs))
  took = time.time() - start
  for part, name, earlier in duplicates(traced):
    print(f"# duplicate {part}: {name} builds {earlier}'s kernels")
  sets = {run.name: t.coverage(run, traced[run.name][0]) for run in runs}
  cost = {run.name: t.run_cost(run) for run in runs}
  chosen = greedy_cover(sets, cost=cost.get)
  lines = set().union(*(lines for lines, _ in traced.values()))
  print(f"# {len(runs)} runs traced in {took:.0f} s reach {len(lines)} lines"
        f" of jaxflash/mosaic_gpu, {len(set().union(*sets.values()))} at"
        f" their padded head_dim; {len(chosen)} runs (cost"
        f" {sum(cost[n] for n in chosen):g}) reach them all:")
  print("PER_COMMIT = (")
  for name in chosen:
    print(f"    {name!r},")
  print(")")


if __name__ == "__main__":
  main()
