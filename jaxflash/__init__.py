"""jaxflash: FlashAttention for JAX, in Pallas."""

from jaxflash.api import IMPLEMENTATIONS as IMPLEMENTATIONS
from jaxflash.api import dot_product_attention as dot_product_attention
from jaxflash.api import flash_attention as flash_attention
from jaxflash.flashmask import FlashMask as FlashMask
from jaxflash.fp8 import hadamard_rotate as hadamard_rotate
from jaxflash.fp8 import quantize_fp8 as quantize_fp8
from jaxflash.masks import PAD_SEGMENT_ID as PAD_SEGMENT_ID
from jaxflash.masks import MaskSpec as MaskSpec
from jaxflash.mosaic_gpu import MosaicConfig as MosaicConfig
from jaxflash.op import RESIDUAL_NAMES as RESIDUAL_NAMES
from jaxflash.paged import mla_attention as mla_attention
from jaxflash.paged import paged_attention as paged_attention
from jaxflash.triton import TritonConfig as TritonConfig
from jaxflash.tune import autotune as autotune

__version__ = "0.1.0"

# The public submodules (docs/api.md) as attributes after a
# plain ``import jaxflash``, loaded on first use (PEP 562): ``linen``
# imports Flax, which a user of the functions alone does not pay for.
_SUBMODULES = ("linen", "sharding", "reference")


def __getattr__(name):
  if name in _SUBMODULES:
    import importlib
    return importlib.import_module(f"jaxflash.{name}")
  raise AttributeError(f"module 'jaxflash' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_SUBMODULES))
