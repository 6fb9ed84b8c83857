"""Whether SwiGLU through NumPy (vectorized exp) would speed the CPU's multi-query forwards
(prefills, verifications), as host_attention.py does for attention (issue 18, session 24):
mlx-lm's `swiglu` in the llama module replaced, inside the engine's forwards with more than one
query a row, by a NumPy one; bench_speculate.py's essays (draft) and extraction (n-grams), 6
guesses, each plain and speculating, MLX's and NumPy's SwiGLU interleaved, 3 reps after one:

    python scripts/probe_host_swiglu.py

Prints the median seconds of each; says so if any run's greedy tokens differ from the first's.
"""

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx_lm.models.llama as llama  # noqa: E402
import numpy as np  # noqa: E402
from bench_speculate import essays, extraction, run_once  # noqa: E402

from batchrun.engine import host_attention  # noqa: E402
from batchrun.engine.request import SamplingParams  # noqa: E402
from batchrun.models import DEMO_MODEL, load_model  # noqa: E402

MLX_SWIGLU = llama.swiglu


def host_swiglu(gate, x):
    if gate.ndim == 3 and gate.shape[1] > 1 and host_attention._in_forwards.get():
        g, u = np.asarray(gate.astype(mx.float32)), np.asarray(x.astype(mx.float32))
        y = 1 / (1 + np.exp(-np.abs(g)))
        return mx.array(g * np.where(g < 0, 1 - y, y) * u).astype(gate.dtype)
    return MLX_SWIGLU(gate, x)


def main() -> None:
    lm = load_model(str(DEMO_MODEL))
    work = {"essays": (essays(8), SamplingParams(max_tokens=256, min_tokens=256), "draft6"),
            "extract": (extraction(8), SamplingParams(max_tokens=128), "ngram6")}
    for name, (chats, params, method) in work.items():
        walls, first = {}, None
        for rep in range(4):
            for swiglu in ("mlx", "numpy"):
                llama.swiglu = MLX_SWIGLU if swiglu == "mlx" else host_swiglu
                for m in ("plain", method):  # bench_speculate's systems: 6 guesses
                    result = run_once(lm, chats, params, 8, m)
                    wall, tokens = result["wall_s"], result["outputs"]
                    first = first or tokens
                    if tokens != first:
                        print(f"{name} {swiglu} {m}: tokens differ from the first run's")
                    if rep:
                        walls.setdefault((swiglu, m), []).append(wall)
        llama.swiglu = MLX_SWIGLU
        for (swiglu, m), w in walls.items():
            print(f"{name:8} {swiglu:6} {m:6} {statistics.median(w):.3f} s", flush=True)


if __name__ == "__main__":
    main()
