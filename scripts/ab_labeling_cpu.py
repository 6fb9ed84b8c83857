"""Issue 13's CPU side by side, in one process: the careful mlx-lm user (the common prefix
prefilled once, copied into every row) against batchrun's engine with a cold and a warm
prefix cache, under engine knobs, repeated so the spread of this shared machine shows.

    [OPENBLAS_THREAD_TIMEOUT=28] python scripts/ab_labeling_cpu.py OUT.json [--rows 120]
        [--reps 3] [--variants default,notails,host4m,notails_host4m,mlx_attention]

OPENBLAS_THREAD_TIMEOUT=28 is OpenBLAS's own default (idle threads spin ~0.1 s); batchrun sets
4 unless told otherwise. Workload: `batchrun bench`'s labeling rows (a shared 1,000-token
prefix, 12-40 tokens of each row's own), demo model, 4 new tokens.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)
from batchrun import bench  # noqa: E402
from batchrun.engine.backends import text  # noqa: E402
from batchrun.engine.kernels import host_attention, shared_prefix  # noqa: E402
from batchrun.models import load_model  # noqa: E402

VARIANTS = {
    "default": {},
    "notails": {(text, "SHARED_TAILS"): False},
    "host4m": {(shared_prefix, "HOST_MIN_SCORES"): 1 << 22},  # the earlier NumPy threshold
    "notails_host4m": {(text, "SHARED_TAILS"): False, (shared_prefix, "HOST_MIN_SCORES"): 1 << 22},
    "mlx_attention": {(host_attention, "ENABLED"): False},  # prefills' attention in MLX
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="default,notails,host4m,notails_host4m")
    args = ap.parse_args()
    lm = load_model(str(Path(__file__).resolve().parents[1] / "sample_data" / "demo-model"))
    w = bench.make_workload(lm.tokenizer, "labeling", args.rows, 4)
    bench.warm_up(lm, w)
    defaults = {k: getattr(*k) for v in VARIANTS.values() for k in v}
    walls: dict[str, list[float]] = {}
    for _ in range(args.reps):
        walls.setdefault("peer", []).append(round(bench.run_hand_cached(lm, w, 64).wall_s, 3))
        for name in args.variants.split(","):
            for (module, attr), value in {**defaults, **VARIANTS[name]}.items():
                setattr(module, attr, value)
            with tempfile.TemporaryDirectory() as folder:
                for phase in ("cold", "warm"):
                    m = bench.run_batchrun(lm, w, 64, Path(folder))
                    walls.setdefault(f"{name}/{phase}", []).append(round(m.wall_s, 3))
    for name, values in walls.items():
        print(f"{name:24} " + " ".join(f"{v:6.2f}" for v in values), flush=True)
    args.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "rows": args.rows,
        "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
        "wall_s": walls}, indent=2))


if __name__ == "__main__":
    main()
