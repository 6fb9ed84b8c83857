"""The gated-delta decode step: batchrun's CUDA kernel (engine/kernels/gated_delta_step.py)
against mlx-lm's rule (gated_delta_ops), at Qwen3.5's 2B shape (16 heads, 128 x 128 state),
for a few batch sizes: the largest difference and each one's seconds a step for one layer.

    python scripts/probe_gated_delta_step.py OUT_DIR [--rows 128,512,1024]

Writes OUT_DIR/gated_delta_step.json.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.models.gated_delta import gated_delta_ops  # noqa: E402

from batchrun.engine.kernels import gated_delta_step  # noqa: E402


def timed(fn, repeat: int = 20) -> float:
    mx.eval(fn())
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", default="128,512,1024")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--width", type=int, default=128)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    H, D = args.heads, args.width
    results = []
    for B in (int(r) for r in args.rows.split(",")):
        keys = mx.random.split(mx.random.key(B), 6)
        q = (mx.random.normal((B, 1, H, D), key=keys[0]) * D ** -0.5).astype(mx.bfloat16)
        k = (mx.random.normal((B, 1, H, D), key=keys[1]) * D ** -0.5).astype(mx.bfloat16)
        v = mx.random.normal((B, 1, H, D), key=keys[2]).astype(mx.bfloat16)
        g = mx.random.uniform(0.5, 1.0, (B, 1, H), key=keys[3])
        beta = mx.random.uniform(0.0, 1.0, (B, 1, H), key=keys[4]).astype(mx.bfloat16)
        state = mx.random.normal((B, H, D, D), key=keys[5]) * 0.1
        mx.eval(q, k, v, g, beta, state)
        xs = (q, k, v, g, beta, state)
        taken = gated_delta_step.takes(q, g, state)
        row = {"rows": B, "kernel_taken": taken, "refused": gated_delta_step._refused[:1]}
        row["mlx_lm_s"] = timed(lambda xs=xs: gated_delta_ops(*xs))
        if taken:
            y, new = gated_delta_step.step(q, k, v, g, beta, state)
            y_ref, new_ref = gated_delta_ops(q, k, v, g, beta, state)
            row["max_diff_y"] = mx.abs(y - y_ref).max().item()
            row["max_diff_state"] = mx.abs(new - new_ref).max().item()
            row["kernel_s"] = timed(lambda xs=xs: gated_delta_step.step(*xs))
            row["speedup"] = row["mlx_lm_s"] / row["kernel_s"]
        print(json.dumps(row), flush=True)
        results.append(row)
    (args.out / "gated_delta_step.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
