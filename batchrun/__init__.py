"""batchrun: offline batch jobs for LLM inference on MLX.

`batchrun.Engine` and `batchrun.Job` are the Python API (batchrun/api.py); they load lazily, so
`import batchrun` (and the command line) stays cheap.
"""

import os as _os

from batchrun import blas as _blas

# Before anything imports mlx.core: route MLX's CPU matmuls to OpenBLAS (see blas.py).
_blas.activate()
# Before MLX's first attention on CUDA: its own fused attention rather than cuDNN's, unless the
# user chose. Measured on the H200 (MLX 0.32.4, BENCHMARKS.md, Decode throughput): the 1,024-row
# decode job was faster without cuDNN in three of four interleaved pairs (median 5.13 s against
# 5.48), and a labeling job on a warm prefix cache, which never reaches MLX's fused attention,
# was the same.
_os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
# float32 matmuls in full float32, unless the user chose: MLX runs them as TF32 by default on
# CUDA (and on Apple's M5 GPUs), whose rounding depends on the shape, so a float32 model's
# tokens and log-probabilities could depend on the batch. On the H200 with TF32 a choices row's
# log-probability differed by 1.1e-3 between its two paths (tests/test_speculate.py); bfloat16
# and float16 models' matmuls are not TF32's.
_os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"
__all__ = ["Engine", "Job", "__version__"]


def __getattr__(name: str):
    if name in ("Engine", "Job"):
        from batchrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'batchrun' has no attribute {name!r}")
