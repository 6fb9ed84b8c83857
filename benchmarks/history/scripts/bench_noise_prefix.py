"""Run-to-run noise check: batchrun with and without a prefix cache, alternated, on the
short workload (no shared prefixes).  python scripts/bench_noise_prefix.py"""

import tempfile
from pathlib import Path

import batchrun  # noqa: F401  (routes MLX to OpenBLAS: must come before mlx.core)

# isort: split
from batchrun import bench as b

lm = b.model_for(None, None, None)
w = b.make_workload(lm.tokenizer, "short", 128, 64)
b.warm_up(lm, w)
for _ in range(3):
    r1 = b.run_batchrun(lm, w, 64)
    with tempfile.TemporaryDirectory() as d:
        r2 = b.run_batchrun(lm, w, 64, Path(d), "cold")
    print(f"plain {r1.wall_s:.2f}  cache {r2.wall_s:.2f}")
