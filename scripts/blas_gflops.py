"""fp32 matmul speed of MLX on the CPU under the BLAS batchrun routes it to.

    python scripts/blas_gflops.py                          # OpenBLAS (batchrun's default)
    BATCHRUN_BLAS=reference python scripts/blas_gflops.py  # the BLAS bundled with mlx-cpu
"""

import time

import batchrun  # noqa: F401  (routes MLX to OpenBLAS: must come before mlx.core)

# isort: split
import mlx.core as mx

from batchrun import blas

print(f"BLAS: {blas.verify().describe()}")
for n in (256, 1024):
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    seconds = (time.perf_counter() - start) / 5
    print(f"{n}x{n} @ {n}x{n}: {2 * n**3 / seconds / 1e9:.1f} GFLOP/s")
