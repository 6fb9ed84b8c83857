"""How much of a CPU decode step MLX's scalar exp costs: one model's decode step (B rows, a
100-token context) as mlx-lm runs it, then with SwiGLU's SiLU replaced by a ReLU, then with
attention's softmax dropped too (wrong outputs: a probe of cost, not a system).

    python scripts/probe_decode_unary.py MODEL_DIR [ROWS]     # e.g. sample_data/demo-trained 256

Prints milliseconds a step for each. Llama-shaped models only (it swaps mlx-lm's llama module's
functions).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx_lm.models.llama as llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from batchrun.models import load_model  # noqa: E402


def step_ms(model, rows: int, steps: int = 20) -> float:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 500, (rows, 100)), cache=cache))
    token = mx.zeros((rows, 1), mx.int32)
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(token, cache=cache))
    return (time.perf_counter() - start) / steps * 1000


def no_softmax(queries, keys, values, cache, scale, mask, sinks=None):
    b, heads, length, dim = queries.shape
    kv = keys.shape[1]
    scores = (queries * scale).reshape(b, kv, heads // kv, length, dim) @ \
        keys[:, :, None].swapaxes(-1, -2)
    return (scores @ values[:, :, None]).reshape(b, heads, length, dim)


def main() -> None:
    model = load_model(sys.argv[1]).model
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    print(f"mlx-lm's step: {step_ms(model, rows):.1f} ms")
    llama.swiglu = lambda gate, x: mx.maximum(gate, 0) * x
    print(f"SiLU replaced: {step_ms(model, rows):.1f} ms")
    llama.scaled_dot_product_attention = no_softmax
    print(f"softmax dropped too: {step_ms(model, rows):.1f} ms")


if __name__ == "__main__":
    main()
