"""The on-disk cache of :func:`jaxflash.autotune`'s winners: the Hopper
config measured fastest for a class of calls on one device kind and jax
version, which later calls of that class use instead of the tuned default
(``backend._resolve_config``).

The cache is one JSON file: ``$JAXFLASH_AUTOTUNE_CACHE`` where set (an
empty value or ``off`` turns the cache off: nothing is read or written),
else ``$XDG_CACHE_HOME/jaxflash/autotune.json`` (``~/.cache`` without
``XDG_CACHE_HOME``).  Its entries: ``{device kind: {jax version: {class:
{MosaicConfig field: value}}}}``; a file that cannot be read, or an entry
that is no valid config, is ignored (the tuned default serves the call).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp

from jaxflash.mosaic_gpu.config import MosaicConfig, kernel_head_dim

ENV = "JAXFLASH_AUTOTUNE_CACHE"


def cache_path() -> str | None:
  """The cache file, or None where the cache is off."""
  path = os.environ.get(ENV)
  if path is not None:
    return None if path.strip().lower() in ("", "off") else path
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxflash", "autotune.json")


def _bucket(n: int) -> int:
  """The power of two at or above ``n`` (at least 128): calls of 3000 and
  4096 keys share a class."""
  return max(128, 1 << max(0, int(n) - 1).bit_length())


def call_class(q, k, *, causal: bool, window: bool) -> str:
  """The class of a call the cache keys on: dtype, the kernels' head_dim,
  causal and windowed or not, query heads per key/value head, and batch
  x heads, query and key lengths each rounded up to a power of two, e.g.
  ``bfloat16-d96-causal-g4-bh64-q4096-k4096``."""
  B, T, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  mask = "-".join(name for name, on in (("causal", causal),
                                        ("window", window)) if on)
  return (f"{jnp.dtype(q.dtype).name}-d{kernel_head_dim(D)}-"
          f"{mask or 'full'}-g{H // K}-bh{_bucket(B * H)}-q{_bucket(T)}-"
          f"k{_bucket(S)}")


def _read(path: str) -> dict:
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return {}
  return data if isinstance(data, dict) else {}


@functools.cache
def _entries(path: str, mtime: float) -> dict:
  del mtime  # re-read when the file changes
  return _read(path).get("entries", {})


def lookup(device_kind: str, key: str) -> MosaicConfig | None:
  """The cached winner of class ``key`` on this device kind and jax
  version, or None."""
  path = cache_path()
  if path is None or not os.path.exists(path):
    return None
  fields = (_entries(path, os.path.getmtime(path))
            .get(device_kind, {}).get(jax.__version__, {}).get(key))
  if not isinstance(fields, dict):
    return None
  try:
    return MosaicConfig(**fields)
  except (TypeError, ValueError):  # a field renamed or refused since
    return None


def store(device_kind: str, key: str, config: MosaicConfig) -> str | None:
  """Writes ``config`` as the winner of class ``key``; returns the file
  (None where the cache is off).  The file is replaced whole (written
  beside it, then renamed), so a reader never sees half of it."""
  path = cache_path()
  if path is None:
    return None
  data = _read(path) if os.path.exists(path) else {}
  data["about"] = __doc__.split("\n\n")[0]
  entries = data.setdefault("entries", {})
  entries.setdefault(device_kind, {}).setdefault(
      jax.__version__, {})[key] = dataclasses.asdict(config)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
  return path
