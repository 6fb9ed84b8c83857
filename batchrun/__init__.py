"""batchrun: offline batch jobs for LLM inference on MLX.

`batchrun.Engine` and `batchrun.Job` are the Python API (batchrun/api.py); they load lazily, so
`import batchrun` (and the command line) stays cheap.
"""

from batchrun import blas as _blas

# Before anything imports mlx.core: route MLX's CPU matmuls to OpenBLAS (see blas.py).
_blas.activate()

__version__ = "0.1.0"
__all__ = ["Engine", "Job", "__version__"]


def __getattr__(name: str):
    if name in ("Engine", "Job"):
        from batchrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'batchrun' has no attribute {name!r}")
