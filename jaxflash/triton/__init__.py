"""Pallas kernels for the Triton lowering (NVIDIA sm80+, CPU interpret)."""

from jaxflash.triton.backend import attention as attention
from jaxflash.triton.backend import check_supported as check_supported
from jaxflash.triton.backend import count_visited_tiles as count_visited_tiles
from jaxflash.triton.config import TritonConfig as TritonConfig
from jaxflash.triton.config import default_config as default_config
