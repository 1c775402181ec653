"""Hopper (sm90) kernels in Pallas Mosaic GPU: forward and backward on
local arrays (:mod:`jaxflash.mosaic_gpu.backend`), with no autodiff or
partitioning of their own (:mod:`jaxflash.op` builds the differentiable op
over them).  The submodules ``forward`` and ``backward`` are the kernels."""

from jaxflash.mosaic_gpu.backend import (
    check_deterministic as check_deterministic,
)
from jaxflash.mosaic_gpu.backend import check_supported as check_supported
from jaxflash.mosaic_gpu.backend import serves_backward as serves_backward
from jaxflash.mosaic_gpu.config import INTERPRET_CONFIG as INTERPRET_CONFIG
from jaxflash.mosaic_gpu.config import MosaicConfig as MosaicConfig
from jaxflash.mosaic_gpu.config import default_config as default_config
