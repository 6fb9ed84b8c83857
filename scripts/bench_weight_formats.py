"""One layer's matmul in each weight format, on the default device: float32, bf16, and affine
4- / 8-bit (group 64), at several batch sizes; with dequantize-then-multiply for the 4-bit.
The figures behind the weight plan (batchrun/models/weights.py; BENCHMARKS.md, "Quantized and
mixture-of-experts models").

    python scripts/bench_weight_formats.py [--k 1024] [--n 3072] [--rows 1,32,256]
    python scripts/bench_weight_formats.py --experts [--rows 8,32,128,512]

--experts: one mixture-of-experts layer (64 experts, 8 a row, 1,024 x 512, float32), mlx-lm's
sorted gather_mm path (SwitchGLU's from 64 routed rows on) against batchrun's grouped one
(models/weights.py, GroupedSwitchLinear).
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
    parser.add_argument("--experts", action="store_true")
    args = parser.parse_args()
    if args.experts:
        for rows in map(int, args.rows.split(",")):
            print(json.dumps({"device": str(mx.default_device()), "rows": rows,
                              "ms": experts(rows, args.reps)}))
        return
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

def experts(rows: int, reps: int, n_experts: int = 64, k: int = 8) -> dict:
    """Milliseconds one expert layer takes for `rows` rows, each routed to `k` experts."""
    from mlx_lm.models.switch_layers import SwitchLinear, _gather_sort, _scatter_unsort

    from batchrun.models.weights import GroupedSwitchLinear

    layer = SwitchLinear(1024, 512, n_experts, bias=False)
    grouped = GroupedSwitchLinear(layer)
    x = mx.random.normal((rows, 1, 1, 1, 1024))  # as SwitchGLU shapes a (rows, 1, D) input
    routed = mx.random.randint(0, n_experts, (rows, 1, k))
    mx.eval(layer.parameters(), x, routed)

    def gather():
        xs, ids, inverse = _gather_sort(x, routed)
        return _scatter_unsort(layer(xs, ids, sorted_indices=True), inverse, routed.shape)

    return {"gather_mm, sorted": round(timed(gather, reps), 3),
            "grouped by expert": round(timed(lambda: grouped(x, routed), reps), 3)}


if __name__ == "__main__":
    main()
