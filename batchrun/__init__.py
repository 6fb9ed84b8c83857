"""batchrun: offline batch jobs for LLM inference on MLX."""

from batchrun import blas as _blas

# Before anything imports mlx.core: route MLX's CPU matmuls to OpenBLAS (see blas.py).
_blas.activate()

__version__ = "0.1.0"
