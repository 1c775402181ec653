"""The package's layers: each module imports only modules of the layers
below it (its own kernel package aside), so the import graph has no cycle.

Read from the source (every ``import``, also those inside functions), so
a lazy import that runs back up is caught as well as a top-level one.
"""

import ast
import pathlib

import jaxflash

ROOT = pathlib.Path(jaxflash.__file__).parent

# Bottom to top.  A module may import modules of lower layers, and a
# kernel package's modules each other; nothing of its own layer or above.
LAYERS = (
    ("jaxflash.masks", "jaxflash.flashmask", "jaxflash._util",
     "jaxflash._timing", "jaxflash.splitk"),
    ("jaxflash.reference", "jaxflash._context"),
    ("jaxflash.triton", "jaxflash.mosaic_gpu"),
    ("jaxflash._partition",),
    ("jaxflash.op",),
    ("jaxflash.checks", "jaxflash.backends"),
    ("jaxflash.fp8",),
    ("jaxflash.api", "jaxflash.ring", "jaxflash.paged"),
    ("jaxflash.sharding", "jaxflash.tune"),
    ("jaxflash.linen",),
    ("jaxflash",),
    ("jaxflash.bench",),
)


def _layer(module: str) -> tuple[int, str]:
  """(layer index, unit) of a module: the unit is the LAYERS entry it
  belongs to (a package's submodules belong to the package)."""
  best = None
  for i, names in enumerate(LAYERS):
    for name in names:
      if name == "jaxflash" and module != "jaxflash":
        continue
      if module == name or module.startswith(name + "."):
        if best is None or len(name) > len(best[1]):
          best = (i, name)
  if best is None:
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")
  return best


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in ROOT.rglob("*.py"):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


def _imports(module: str, path: pathlib.Path, text: str | None = None
             ) -> set[str]:
  """jaxflash modules ``module`` imports (``from a import b`` counts as
  ``a.b`` when that is a module, else ``a``)."""
  known = _modules()
  package = module if path.name == "__init__.py" else module.rpartition(
      ".")[0]
  found = set()
  for node in ast.walk(ast.parse(text or path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
               for a in node.names]
    else:
      continue
    found.update(n.rstrip(".") for n in names
                 if n == "jaxflash" or n.startswith("jaxflash."))
  return found


def _violations(module: str, deps: set[str]) -> list[str]:
  layer, unit = _layer(module)
  wrong = []
  for dep in sorted(deps):
    dep_layer, dep_unit = _layer(dep)
    if dep_unit == unit and unit != "jaxflash":
      continue  # inside one kernel package (or module)
    if dep_layer >= layer:
      wrong.append(f"{module} (layer {layer}) imports {dep} (layer"
                   f" {dep_layer})")
  return wrong


def test_every_module_imports_only_lower_layers():
  wrong = []
  for module, path in sorted(_modules().items()):
    wrong += _violations(module, _imports(module, path))
  assert not wrong, "\n".join(wrong)


def test_kernel_packages_know_nothing_above_them():
  """The kernels know nothing of the op, the dispatch or each other."""
  for module, path in _modules().items():
    unit = _layer(module)[1]
    if unit not in ("jaxflash.triton", "jaxflash.mosaic_gpu"):
      continue
    other = ({"jaxflash.triton", "jaxflash.mosaic_gpu"} - {unit}).pop()
    for dep in _imports(module, path):
      assert not dep.startswith(other), (module, dep)
      assert _layer(dep)[0] < 2 or dep.startswith(unit), (module, dep)


def test_the_layer_check_sees_a_violation():
  """The checker itself: imports that run up or sideways are reported,
  also lazy ones inside a function."""
  path = ROOT / "triton" / "backend.py"
  lazy = "def f():\n  from jaxflash import op\n  from .. import api\n"
  deps = _imports("jaxflash.triton.backend", path, lazy)
  assert deps == {"jaxflash.op", "jaxflash.api"}
  assert len(_violations("jaxflash.triton.backend", deps)) == 2
  sideways = _imports("jaxflash.triton.backend", path,
                      "from jaxflash.mosaic_gpu import forward\n")
  assert _violations("jaxflash.triton.backend", sideways)
  assert not _violations("jaxflash.triton.backend",
                         {"jaxflash.triton.common", "jaxflash.masks"})
