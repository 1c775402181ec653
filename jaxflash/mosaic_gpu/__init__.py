"""Hopper (sm90) kernels in Pallas Mosaic GPU."""

from jaxflash.mosaic_gpu.backend import attention as attention
from jaxflash.mosaic_gpu.backend import (
    check_deterministic as check_deterministic,
)
from jaxflash.mosaic_gpu.backend import check_supported as check_supported
from jaxflash.mosaic_gpu.config import INTERPRET_CONFIG as INTERPRET_CONFIG
from jaxflash.mosaic_gpu.config import MosaicConfig as MosaicConfig
from jaxflash.mosaic_gpu.config import default_config as default_config
