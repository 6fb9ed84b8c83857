"""One layer's matmul in each weight format, on the default device: float32, bf16, and affine
4- / 8-bit (group 64), at several batch sizes; with dequantize-then-multiply for the 4-bit.
The figures behind the weight plan (batchrun/models/weights.py; BENCHMARKS.md, "Quantized and
mixture-of-experts models").

    python scripts/bench_weight_formats.py [--k 1024] [--n 3072] [--rows 1,32,256]
"""

import argparse
import json
import time

import batchrun  # noqa: F401  (routes MLX to OpenBLAS: must come before mlx.core)

# isort: split
import mlx.core as mx


def timed(fn, reps: int) -> float:
    for _ in range(2):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--rows", default="1,32,256")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    w = mx.random.normal((args.n, args.k))
    packed = {bits: mx.quantize(w.astype(mx.bfloat16), 64, bits) for bits in (4, 8)}
    for rows in map(int, args.rows.split(",")):
        ms = measure(rows, w, packed, args.reps)
        print(json.dumps({"device": str(mx.default_device()), "rows": rows, "k": args.k,
                          "n": args.n, "ms": {k: round(v, 3) for k, v in ms.items()}}))


def measure(rows: int, w: mx.array, packed: dict, reps: int) -> dict:
    """Milliseconds a product of `rows` rows takes in each format."""
    x = mx.random.normal((rows, w.shape[1]))
    xh, wh = x.astype(mx.bfloat16), w.astype(mx.bfloat16)
    mx.eval(x, xh, wh, packed)
    ms = {"float32": timed(lambda: x @ w.T, reps), "bfloat16": timed(lambda: xh @ wh.T, reps)}
    for bits, (q, s, b) in packed.items():
        ms[f"{bits}-bit"] = timed(lambda q=q, s=s, b=b, bits=bits: mx.quantized_matmul(
            xh, q, s, b, transpose=True, group_size=64, bits=bits), reps)
    q, s, b = packed[4]
    ms["4-bit dequantized first"] = timed(lambda: xh @ mx.dequantize(q, s, b, 64, 4).T, reps)
    return ms

if __name__ == "__main__":
    main()
