"""A process's first and second forward of a model (two rows of 15 tokens) on the GPU, and
where the CUDA driver's and MLX's compiled-kernel caches are: whether the first use of kernels
is the driver compiling PTX (its cache grows) or loading what MLX compiled.

    python scripts/probe_first_forward.py --model PATH
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (its environment before MLX's import)

# isort: split
import mlx.core as mx  # noqa: E402


def folder_size(path: Path) -> str:
    if not path.exists():
        return "absent"
    files = [p for p in path.rglob("*") if p.is_file()]
    return f"{len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    from mlx_lm import load

    start = time.perf_counter()
    model, _ = load(args.model)
    loaded = time.perf_counter()
    tokens = mx.array([[1 + i for i in range(15)]] * 2)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        mx.eval(model(tokens))
        times.append(time.perf_counter() - t)
    driver = Path(os.environ.get("CUDA_CACHE_PATH", Path.home() / ".nv" / "ComputeCache"))
    print(f"load {loaded - start:.2f} s, first forward {times[0]:.3f} s, second "
          f"{times[1]:.3f} s; CUDA_CACHE_MAXSIZE={os.environ.get('CUDA_CACHE_MAXSIZE')}, "
          f"CUDA_CACHE_DISABLE={os.environ.get('CUDA_CACHE_DISABLE')}; driver cache "
          f"{driver}: {folder_size(driver)}", flush=True)


if __name__ == "__main__":
    main()
