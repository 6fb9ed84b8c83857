"""Check the ranged decode kernel (batchrun/engine/kernels/decode_attention.py) on a CUDA device.

    python scripts/check_decode_kernel.py OUT_DIR [--quick | --greedy-only]

1. Correctness: the kernel (both layouts, da.GROUPED) against `reference` (float32
   MLX ops on the CPU, same inputs) over dtypes, head dims, query heads per KV head, row
   starts, lengths and splits, with the keys a slice of a larger buffer as a batch KV cache
   passes them. Fails (exit 1) beyond tolerance, or if the kernel was refused.
2. Greedy tokens: the engine on a small model with the kernel and without it (MLX's attention
   with mlx-lm's mask), in float32 and in bfloat16.
3. Cost of one layer's decode attention: MLX's fused attention without a mask (the floor),
   with mlx-lm's mask (what a continuous batch ran), and the kernel (also with the other warps
   a thread block of 2, 4 and 8, and the other layout: da.GROUPED).

Writes OUT_DIR/decode_kernel.json. CI has no GPU; the CPU tests cover `reference` and the
dispatch.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import batchrun  # noqa: F401

# isort: split
import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from batchrun.engine.kernels import decode_attention as da

TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def correctness() -> list[dict]:
    results = []
    mx.random.seed(0)
    cases = [(grouped, dtype, D, G, rows, length, splits)
             for grouped in (True, False)
             for dtype in (mx.bfloat16, mx.float16, mx.float32)
             for D in (64, 128) for G in (1, 4, 8)
             for rows, length in ((3, 1), (5, 33), (7, 300), (2, 2049))
             for splits in (None, 1, 3)]
    for grouped, dtype, D, G, rows, length, splits in cases:
        da.GROUPED = grouped
        da._refused.clear()
        kv_heads = 2
        buffer = (rows, kv_heads, length + 40, D)  # a cache's buffers, `length` slots filled
        kb = mx.random.normal(buffer).astype(dtype)
        vb = mx.random.normal(buffer).astype(dtype)
        k, v = kb[..., :length, :], vb[..., :length, :]
        q = mx.random.normal((rows, kv_heads * G, 1, D)).astype(dtype)
        starts = mx.random.randint(0, length, (rows,)).astype(mx.int32)
        starts[0] = 0
        scale = D ** -0.5
        out, lse = da.ranged_attention(q, kb, vb, starts, scale, length, with_lse=True,
                                       splits=splits)
        plain, _ = da.ranged_attention(q, kb, vb, starts, scale, length, splits=splits)
        n = splits or da.splits_for(rows, kv_heads, length)
        with mx.stream(mx.cpu):  # exact float32 (CUDA's float32 matmuls may round as TF32)
            r_out, r_lse = da.reference(q, k, v, starts, scale, n)
            r_out, r_lse = da.merge_splits(r_out, r_lse) if n > 1 else (r_out[:, :, 0],
                                                                        r_lse[..., 0])
            mx.eval(r_out, r_lse)
        error = mx.abs(out[:, :, 0] - r_out).max().item()
        plain_error = mx.abs(plain[:, :, 0].astype(mx.float32) - r_out).max().item()
        lse_error = mx.abs(lse - r_lse).max().item()
        # A refused kernel falls back to `reference` itself: that is a failure here.
        refused = list(da._refused)
        ok = error <= TOLERANCE[dtype] and lse_error <= 1e-3 and not refused \
            and plain_error <= 2 * TOLERANCE[dtype] + (1e-2 if dtype == mx.bfloat16 else 1e-3)
        results.append({"grouped": grouped, "dtype": str(dtype), "D": D, "G": G, "rows": rows,
                        "length": length, "splits": n, "max_error": error,
                        "plain_error": plain_error, "lse_error": lse_error, "refused": refused,
                        "ok": ok})
        if not ok:
            print("FAIL", json.dumps(results[-1]), flush=True)
    print(f"correctness: {sum(r['ok'] for r in results)} of {len(results)} cases within "
          "tolerance", flush=True)
    da.GROUPED = DEFAULT_GROUPED
    da._refused.clear()
    return results


def greedy(model_dir: str) -> list[dict]:
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.types import SamplingParams
    from batchrun.models import load_model

    results = []
    for dtype in (mx.float32, mx.bfloat16):
        lm = load_model(model_dir)
        lm.model.set_dtype(dtype)
        prompts = [list(range(5 + i % 7, 40 + (i * 13) % 90)) for i in range(48)]
        tokens = {}
        # MLX's attention with a mask, then the kernel in each layout (da.GROUPED)
        for on, grouped in ((False, DEFAULT_GROUPED), (True, True), (True, False)):
            da.ENABLED, da.GROUPED = on, grouped
            da.EVERYWHERE = on and dtype == mx.float32  # the kernel serves half types alone
            engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=16),
                            lm.context_length)
            for p in prompts:
                engine.add_tokens(p, SamplingParams(max_tokens=24))
            tokens[on, grouped] = [o.token_ids for o in engine.run()]
        da.ENABLED, da.EVERYWHERE, da.GROUPED = True, False, DEFAULT_GROUPED
        masked = tokens[False, DEFAULT_GROUPED]
        for grouped in (True, False):
            kernel = tokens[True, grouped]
            results.append({
                "dtype": str(dtype), "layout": "grouped" if grouped else "lane_per_key",
                "rows": len(prompts),
                "rows_differing": sum(a != b for a, b in zip(masked, kernel, strict=True)),
                "divergences": [divergence(lm.model, p, a, b) for p, a, b in
                                zip(prompts, masked, kernel, strict=True) if a != b]})
            print(json.dumps(results[-1]), flush=True)
    return results


def divergence(model, prompt: list[int], a: list[int], b: list[int]) -> dict:
    """Where two greedy runs of one row part, and how close the choice was there: the top two
    logits of the whole sequence up to that point in one causal forward pass (no batch, no
    cache). A gap near the dtype's rounding is a tie the two attention paths broke apart."""
    at = next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2], strict=False)) if x != y)
    logits = model(mx.array([prompt + a[:at]]))[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    return {"position": at, "tokens": [a[at] if at < len(a) else None,
                                       b[at] if at < len(b) else None],
            "top_two_gap": top[1] - top[0],
            "logit_of_each": [logits[t].item() if t is not None else None
                              for t in (a[at] if at < len(a) else None,
                                        b[at] if at < len(b) else None)]}


WARPS_SWEEP = tuple(w for w in (2, 4, 8) if w != da.WARPS)
DEFAULT_GROUPED = da.GROUPED


def timed(call, reps: int) -> float:
    """Milliseconds a call, after three warm-up calls."""
    for _ in range(3):
        mx.eval(call())
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(call())
    return (time.perf_counter() - start) / reps * 1000


def timing(rows: int, length: int, heads=32, kv_heads=8, D=64, reps=50) -> dict:
    dtype = mx.bfloat16
    q = mx.random.normal((rows, heads, 1, D)).astype(dtype)
    kb = mx.random.normal((rows, kv_heads, length + 64, D)).astype(dtype)
    vb = mx.random.normal((rows, kv_heads, length + 64, D)).astype(dtype)
    k, v = kb[..., :length, :], vb[..., :length, :]
    padding = mx.random.randint(0, max(1, length // 4), (rows,)).astype(mx.int32)
    mask = create_causal_mask(1, offset=length - 1, left_padding=padding)
    scale = D ** -0.5
    mx.eval(q, kb, vb, k, v, padding, mask)
    calls = {
        "fused_no_mask": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
        "fused_masked": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                     mask=mask),
        "kernel": lambda: da.ranged_attention(q, kb, vb, padding, scale, length)[0],
        "kernel_lse": lambda: da.ranged_attention(q, kb, vb, padding, scale, length,
                                                  with_lse=True),
    }
    result = {"rows": rows, "length": length, "heads": heads, "kv_heads": kv_heads, "D": D,
              "splits": da.splits_for(rows, kv_heads, length)}
    for name, call in calls.items():
        result[name + "_ms"] = timed(call, reps)
    default = da.WARPS
    for warps in WARPS_SWEEP:  # warps a thread block (a define of the kernel's source)
        da.WARPS = warps
        result[f"kernel_{warps}_warps_ms"] = timed(calls["kernel"], reps)
    da.WARPS = default
    da.GROUPED = not DEFAULT_GROUPED  # the other layout
    other = "grouped" if da.GROUPED else "lane_per_key"
    result[f"kernel_{other}_ms"] = timed(calls["kernel"], reps)
    da.GROUPED = DEFAULT_GROUPED
    result["refused"] = list(da._refused)
    result["kv_gb_per_s_kernel"] = 2 * k.nbytes / (result["kernel_ms"] / 1000) / 1e9
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="/tmp/m150",
                        help="an mlx-lm model folder for the greedy check (the 150m shape "
                             "is built there if absent)")
    parser.add_argument("--quick", action="store_true", help="no greedy-token check")
    parser.add_argument("--greedy-only", action="store_true",
                        help="only the greedy-token check")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not da.on_cuda():
        sys.exit("check_decode_kernel.py needs MLX's CUDA backend")
    result = {"correctness": [] if args.greedy_only else correctness()}
    if not args.greedy_only:
        result["timing"] = [timing(r, n) for r, n in ((1024, 256), (1024, 384), (256, 256),
                                                      (512, 64), (8, 2048), (64, 1024))]
    if not args.quick:
        if not (Path(args.model) / "config.json").exists():
            from batchrun.models.random_model import build

            build(Path(args.model), "150m")
        result["greedy"] = greedy(args.model)
    (args.out / "decode_kernel.json").write_text(json.dumps(result, indent=2))
    sys.exit(0 if all(r["ok"] for r in result["correctness"]) else 1)


if __name__ == "__main__":
    main()
