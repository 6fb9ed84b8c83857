"""Check the shared-prefix attention kernel (batchrun/engine/kernels/prefix_attention.py) on a
CUDA device.

    python scripts/check_prefix_kernel.py OUT_DIR [--quick]

1. Correctness: the kernel against `reference` (float32 MLX ops on the CPU, same inputs) over
   dtypes, head dims, rows, queries a row (width), and prefix lengths, the last block of
   queries and the last tile of keys part-full; the cascade kernel against
   `cascade_reference` (rows with left padding, own keys part of their cache). Fails (exit 1)
   beyond tolerance, or if the kernel was refused.
2. Cost of one layer's prefix part at a labeling job's shapes (a suffix prefill, a decode
   step): the kernel against the MLX ops the engine ran on CUDA before it (float32 scores in
   evaluated chunks, shared_prefix._attend_prefix); a prefill's whole attention, the cascade
   kernel against the parts path (prefix kernel, own part in MLX ops, merge).
3. Greedy tokens (not with --quick): the engine on a small bfloat16 model, rows under two
   shared instructions, the prefix part through the kernel and through MLX's ops.

Writes OUT_DIR/prefix_kernel.json. CI has no GPU; the CPU tests cover `reference`, the
dispatch and the source's compilation.
"""

import argparse
import json
import sys
from pathlib import Path

import batchrun  # noqa: F401

# isort: split
import mlx.core as mx

from batchrun.engine.kernels import prefix_attention as pa
from batchrun.engine.kernels import shared_prefix

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_decode_kernel import timed  # noqa: E402  (milliseconds a call, warmed up)

TOLERANCE = {mx.float16: 4e-3, mx.bfloat16: 2.5e-2}


def correctness() -> list[dict]:
    results = []
    mx.random.seed(0)
    cases = [(dtype, D, rows, kv_heads, width, length)
             for dtype in (mx.bfloat16, mx.float16) for D in pa.HEAD_DIMS
             for rows, kv_heads, width, length in (
                 (1, 1, 1, 1), (3, 2, 37, 150), (7, 8, 4, 64), (16, 8, 180, 1763),
                 (300, 8, 4, 1763), (2, 4, 5, 4097), (5, 1, 63, 65))]
    for dtype, D, rows, kv_heads, width, length in cases:
        pa._refused.clear()
        q = mx.random.normal((rows, kv_heads, width, D)).astype(dtype)
        k = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
        v = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
        scale = D ** -0.5
        out, lse = pa.prefix_attention(q, k, v, scale)
        mx.eval(out, lse)
        with mx.stream(mx.cpu):
            expected, expected_lse = pa.reference(q, k, v, scale)
            error = mx.abs(out - expected).max().item()
            lse_error = mx.abs(lse - expected_lse).max().item()
        result = {"dtype": str(dtype), "D": D, "rows": rows, "kv_heads": kv_heads,
                  "width": width, "length": length, "max_error": error,
                  "max_lse_error": lse_error, "refused": list(pa._refused)}
        result["ok"] = not pa._refused and max(error, lse_error) <= TOLERANCE[dtype]
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def cascade_correctness() -> list[dict]:
    """The cascade kernel (a prefill's whole attention under one prefix) against
    `cascade_reference`: rows with and without left padding, one and several blocks a row,
    own keys filling part of their cache."""
    results = []
    mx.random.seed(1)
    cases = [(dtype, D, B, heads, kv_heads, L, length, stride, used)
             for dtype in (mx.bfloat16, mx.float16) for D in pa.HEAD_DIMS
             for B, heads, kv_heads, L, length, stride, used in (
                 (1, 4, 1, 2, 1, 32, 2), (3, 4, 2, 37, 150, 64, 50), (16, 32, 8, 45, 1763, 64, 45),
                 (5, 8, 8, 7, 65, 288, 260), (2, 8, 2, 130, 4097, 160, 131))]
    for dtype, D, B, heads, kv_heads, L, length, stride, used in cases:
        pa._refused.clear()
        queries = mx.random.normal((B, heads, L, D)).astype(dtype)
        k = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
        v = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
        own_k = mx.random.normal((B, kv_heads, stride, D)).astype(dtype)
        own_v = mx.random.normal((B, kv_heads, stride, D)).astype(dtype)
        # Left padding from none to past where the new tokens start (padding queries).
        pad = mx.array([min(used, (7 * b) % (used - L + 4)) for b in range(B)])
        scale = D ** -0.5
        out = pa.cascade_attention(queries, own_k, own_v, pad, used, k, v, scale)
        mx.eval(out)
        with mx.stream(mx.cpu):
            expected = pa.cascade_reference(queries, own_k, own_v, pad, used, k, v, scale,
                                            mx.float32)
            error = mx.abs(out.astype(mx.float32) - expected).max().item()
        result = {"kernel": "cascade", "dtype": str(dtype), "D": D, "rows": B, "heads": heads,
                  "kv_heads": kv_heads, "L": L, "length": length, "stride": stride,
                  "used": used, "max_error": error, "refused": list(pa._refused)}
        result["ok"] = not pa._refused and error <= TOLERANCE[dtype]
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def cascade_timing(rows: int, L: int, length: int, heads=32, kv_heads=8, D=64, reps=20) -> dict:
    """One layer's prefill attention under a prefix: the cascade kernel against the parts
    path it replaces (the prefix kernel, the own part in MLX ops, the merge)."""
    dtype = mx.bfloat16
    k = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
    v = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
    prefix = shared_prefix.SharedPrefix([k], [v])
    cache = shared_prefix.SharedPrefixBatchCache([prefix] * rows, 0)
    queries = mx.random.normal((rows, heads, L, D)).astype(dtype)
    mask = cache.make_mask(L)
    keys, values = cache.update_and_fetch(
        mx.random.normal((rows, kv_heads, L, D)).astype(dtype),
        mx.random.normal((rows, kv_heads, L, D)).astype(dtype))
    mx.eval(queries, keys, values, cache.keys, cache.values, mask)

    def parts():
        pa.CASCADE_ENABLED = False  # as BATCHRUN_CASCADE_KERNEL=0
        try:
            return shared_prefix.attention_with_prefix(queries, keys, values, cache, D ** -0.5,
                                                       mask)
        finally:
            pa.CASCADE_ENABLED = True

    calls = {"cascade": lambda: shared_prefix.attention_with_prefix(
                 queries, keys, values, cache, D ** -0.5, mask),
             "parts": parts}
    result = {"what": f"prefill attention, {rows} rows x {L} queries, {length}-key prefix",
              "rows": rows, "L": L, "length": length}
    for name, call in calls.items():
        result[name + "_ms"] = timed(call, reps)
    result["speedup"] = result["parts_ms"] / result["cascade_ms"]
    print(json.dumps(result), flush=True)
    return result


def timing(what: str, rows: int, width: int, length: int, kv_heads=8, D=64, reps=20) -> dict:
    dtype = mx.bfloat16
    q = mx.random.normal((rows, kv_heads, width, D)).astype(dtype)
    k = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
    v = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
    scale = D ** -0.5
    mx.eval(q, k, v)
    calls = {
        "kernel": lambda: pa.prefix_attention(q, k, v, scale),
        "mlx_ops": lambda: shared_prefix._attend_prefix(q.astype(mx.float32) * scale, k, v),
    }
    result = {"what": what, "rows": rows, "width": width, "length": length,
              "kv_heads": kv_heads, "D": D}
    for name, call in calls.items():
        result[name + "_ms"] = timed(call, reps)
    flops = 4 * rows * width * kv_heads * length * D  # two products, a multiply-add each
    result["kernel_tflops"] = flops / (result["kernel_ms"] / 1000) / 1e12
    result["speedup"] = result["mlx_ops_ms"] / result["kernel_ms"]
    result["refused"] = list(pa._refused)
    print(json.dumps(result), flush=True)
    return result


def greedy(model_dir: str) -> dict:
    from batchrun.cache import block_layout, make_prefix_cache
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.types import SamplingParams
    from batchrun.models import load_model

    lm = load_model(model_dir)
    lm.model.set_dtype(mx.bfloat16)
    instructions = [
        "You label product reviews as positive, negative or neutral. " + " ".join(
            f"Example {i}: the kettle is sturdy and quiet, so it is positive." for i in range(30)),
        "Translate the review into a one-word mood. " + " ".join(
            f"Sample {i}: the lamp flickers and hums, so the mood is gloomy." for i in range(30))]
    chats = [[{"role": "system", "content": instructions[i % 2]},
              {"role": "user", "content": f"Review {i}: it is {'great' if i % 3 else 'awful'}"}]
             for i in range(64)]
    tokens = {}
    for on in (False, True):
        pa.ENABLED = on
        cache = make_prefix_cache(lm.fingerprint, 1 << 30, None, block_size=32,
                                  layout=block_layout(lm.model))
        engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=64),
                        lm.context_length, prefix_cache=cache, model_fingerprint=lm.fingerprint)
        tokens[on] = [o.token_ids for o in engine.generate(chats, SamplingParams(max_tokens=24))]
        hits = engine.get_cache_stats()["hit_tokens"]
    pa.ENABLED = True
    result = {"dtype": "bfloat16", "rows": len(chats), "cache_hit_tokens": hits,
              **gaps(lm, chats, tokens[False], tokens[True]),
              "rows_differing": sum(a != b for a, b in zip(tokens[False], tokens[True],
                                                           strict=True)),
              "first_differences": [
                  {"row": i, "position": next(j for j, (x, y) in enumerate(
                      zip(a + [-1], b + [-2], strict=False)) if x != y)}
                  for i, (a, b) in enumerate(zip(tokens[False], tokens[True], strict=True))
                  if a != b][:10],
              "refused": list(pa._refused)}
    print(json.dumps(result), flush=True)
    return result


def gaps(lm, chats: list, off: list[list[int]], on: list[list[int]]) -> dict:
    """How close the two paths' choices were where they part: from one uncached forward of
    the prompt and the tokens both chose (MLX's own attention), the logit gap between the two
    tokens chosen there, and the gap between the top two logits at every position of the
    first 8 rows, for scale."""
    from batchrun.engine.backends.prompt import PromptBuilder

    builder = PromptBuilder(lm.tokenizer)

    def logits(i: int, tokens: list[int]) -> mx.array:
        prompt = builder.encode_chat(chats[i])
        out = lm.model(mx.array([prompt + tokens]))[0, len(prompt) - 1:].astype(mx.float32)
        mx.eval(out)
        return out

    parting = []
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        j = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if j is not None:
            row = logits(i, a[:j])[j]
            parting.append(abs(row[a[j]].item() - row[b[j]].item()))
    typical = []
    for i in range(min(8, len(off))):
        top = mx.sort(logits(i, off[i][:-1]), axis=-1)[:, -2:]
        typical += (top[:, 1] - top[:, 0]).tolist()
    typical.sort()
    return {"parting_logit_gaps": sorted(round(g, 4) for g in parting),
            "top2_gap_quantiles": {q: round(typical[int(q * (len(typical) - 1))], 4)
                                   for q in (0.05, 0.25, 0.5)} if typical else {}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="/tmp/m150",
                        help="an mlx-lm model folder for the greedy check (the 150m shape "
                             "is built there if absent)")
    parser.add_argument("--quick", action="store_true", help="no greedy-token check")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not pa.on_cuda():
        sys.exit("check_prefix_kernel.py needs MLX's CUDA backend")
    result = {"correctness": correctness() + cascade_correctness()}
    result["timing"] = [
        timing("suffix prefill, 512 rows x 45 queries x 4 heads", 512, 180, 1763),
        timing("suffix prefill, 128 rows, head size 128", 128, 180, 1763, D=128),
        timing("decode step, 1,024 rows x 4 heads", 1024, 4, 1763),
        timing("decode step, 64 rows x 4 heads", 64, 4, 1763)]
    result["cascade_timing"] = [cascade_timing(512, 45, 1763), cascade_timing(1, 35, 1728),
                                cascade_timing(8, 7, 1763)]
    if not args.quick:
        if not (Path(args.model) / "config.json").exists():
            from batchrun.models.random_model import build

            build(Path(args.model), "150m")
        result["greedy"] = greedy(args.model)
    (args.out / "prefix_kernel.json").write_text(json.dumps(result, indent=2))
    sys.exit(0 if all(r["ok"] for r in result["correctness"]) else 1)


if __name__ == "__main__":
    main()
