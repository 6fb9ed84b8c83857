"""Where a step's time goes on the CPU: op and step timings for one model folder.

    python scripts/cpu_op_costs.py MODEL_DIR     # e.g. the 150m shape built by batchrun bench
"""

import sys
import time

import batchrun  # noqa: F401  (routes MLX to OpenBLAS: must come before mlx.core)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from batchrun import blas
from batchrun.models import load_model


def ms(f, n=5) -> float:
    mx.eval(f())
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return (time.perf_counter() - start) / n * 1000


def main(path: str) -> None:
    print(f"BLAS: {blas.verify().describe()}")
    lm = load_model(path)
    model = lm.model
    hidden = model.args.hidden_size
    h = mx.random.normal((512, 3 * hidden))
    print(f"exp over {h.size:,} floats: {ms(lambda: mx.exp(h)):.1f} ms "
          f"(numpy: {_numpy_exp_ms(np.array(h)):.1f} ms)")
    print(f"silu over {h.size:,} floats: {ms(lambda: nn.silu(h)):.1f} ms")
    w = mx.random.normal((3 * hidden, hidden))
    for m in (1, 8, 64, 512):
        a = mx.random.normal((m, hidden))
        t = ms(lambda a=a: a @ w.T, 10)
        gflops = 2 * m * hidden * 3 * hidden / t / 1e6
        print(f"matmul {m}x{hidden} @ {hidden}x{3 * hidden}: {gflops:.0f} GFLOP/s")
    layer = model.model.layers[0]
    x = mx.random.normal((1, 512, hidden))
    print(f"one layer, 512-token prompt: attention "
          f"{ms(lambda: layer.self_attn(layer.input_layernorm(x), mask='causal')):.0f} ms, "
          f"MLP {ms(lambda: layer.mlp(layer.post_attention_layernorm(x))):.0f} ms")
    a = layer.self_attn
    q = mx.random.normal((1, a.n_heads, 512, hidden // a.n_heads))
    k = mx.random.normal((1, a.n_kv_heads, 512, hidden // a.n_heads))
    sdpa = ms(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1, mask="causal"))
    print(f"  of which scaled_dot_product_attention: {sdpa:.0f} ms, "
          f"silu {ms(lambda: nn.silu(h)):.0f} ms")
    for b in (1, 8, 64):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((b, 128), dtype=mx.int32), cache=cache))
        step = mx.zeros((b, 1), dtype=mx.int32)
        t = ms(lambda step=step, cache=cache: model(step, cache=cache))
        print(f"decode step at batch {b}: {t:.1f} ms ({b / t * 1000:.0f} tokens/s)")
    prompt = mx.zeros((1, 512), dtype=mx.int32)
    t = ms(lambda: model(prompt, cache=make_prompt_cache(model)), 2)
    print(f"prefill of one 512-token prompt: {t:.0f} ms ({512 / t * 1000:.0f} tokens/s)")


def _numpy_exp_ms(a) -> float:
    start = time.perf_counter()
    for _ in range(5):
        np.exp(a)
    return (time.perf_counter() - start) / 5 * 1000


if __name__ == "__main__":
    main(sys.argv[1])
