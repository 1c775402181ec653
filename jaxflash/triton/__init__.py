"""Pallas kernels for the Triton lowering (NVIDIA sm80+, CPU interpret):
forward and backward on local arrays (:mod:`jaxflash.triton.backend`),
with no autodiff or partitioning of their own (:mod:`jaxflash.op` builds
the differentiable op over them).  The submodules ``forward`` and
``backward`` are the kernels."""

from jaxflash.triton.backend import check_supported as check_supported
from jaxflash.triton.backend import count_visited_tiles as count_visited_tiles
from jaxflash.triton.config import TritonConfig as TritonConfig
from jaxflash.triton.config import default_config as default_config
