"""How long a process's first calls of the ranged decode kernel take (NVRTC's compile and the
driver's load), then a later call: python scripts/first_call_cost.py"""

import time

import batchrun  # noqa: F401

# isort: split
import mlx.core as mx

from batchrun.engine import decode_attention as da

q = mx.random.normal((77, 32, 1, 64)).astype(mx.bfloat16)
k = mx.random.normal((77, 8, 60, 64)).astype(mx.bfloat16)
starts = mx.zeros((77,), mx.int32)
mx.eval(q, k, starts)
for with_lse in (True, True, False):
    t = time.perf_counter()
    mx.eval(da.ranged_attention(q, k, k, starts, 0.125, with_lse=with_lse)[0])
    print(f"with_lse={with_lse}: {time.perf_counter() - t:.3f}s", flush=True)
