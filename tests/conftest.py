import glob
import os

# Several CPU devices for pmap / sharding tests; must precede importing jax.
if "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
# Without a GPU the tests' time is XLA compiling interpret-mode kernels
# (seconds each; running them takes milliseconds): LLVM's optimisation
# level 0 and no expensive passes roughly halve it.  (Neither flag
# licenses fast math, so results keep IEEE semantics.)  Not on GPU
# machines, where the compiled kernels' speed is measured too.
if (not glob.glob("/dev/nvidia[0-9]*")
    and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=0"
                              " --xla_llvm_disable_expensive_passes=true")
# On GPUs, XLA autotunes every matmul fusion of the reference by compiling
# many Triton variants; tests never measure speed, so skip that.
os.environ["XLA_FLAGS"] += " --xla_gpu_autotune_level=0"
# jaxflash.autotune's on-disk winners never steer the tests' calls (a test
# of the cache points it at a file of its own).
os.environ["JAXFLASH_AUTOTUNE_CACHE"] = "off"

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=10,
                          print_blob=True)
settings.load_profile("ci")


def has_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def tool(monkeypatch):
  """``tool(name)``: the module ``name`` of tools/ (put on the path for
  the test)."""
  import importlib
  import pathlib
  monkeypatch.syspath_prepend(pathlib.Path(__file__).parents[1] / "tools")
  return importlib.import_module
