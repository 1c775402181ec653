"""The device check shared by the kernel backends' ``check_supported``."""

from __future__ import annotations

from collections.abc import Callable

import jax


def require_cuda(backend: str, need: str, accepts: Callable[[str], bool],
                 interpret_hint: str) -> None:
  """Raises NotImplementedError unless the default device is a CUDA GPU
  whose compute capability ``accepts``; ``need`` words the requirement."""
  if jax.default_backend() != "gpu":
    raise NotImplementedError(
        f"{backend} backend needs {need} (default backend is"
        f" {jax.default_backend()!r}); {interpret_hint}")
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", None)
  if cc is not None and not accepts(str(cc)):
    raise NotImplementedError(
        f"{backend} backend needs {need}, got compute capability {cc}"
        f" ({dev.device_kind})")
