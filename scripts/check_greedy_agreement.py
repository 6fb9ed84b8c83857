"""Greedy tokens of batchrun's engine against mlx-lm's own generation of the model as loaded.

    python scripts/check_greedy_agreement.py MODEL OUT_DIR [--rows 512] [--instruction 1000]
        [--max-tokens 8] [--weights auto] [--mlx-lm-batched N]

The labeling rows of scripts/bench_labeling.py (one shared instruction, a review a row). batchrun:
the engine with its weight plan (on CUDA a quantized model's layers are dequantized into bf16, so
its rounding differs from the quantized kernels'), every row in one batch, a cold prefix cache.
mlx-lm: `generate_step` on each row alone, on the model as loaded. Reported: the share of rows
whose greedy tokens are identical, the share whose first token is, where the others first
differ, the largest difference of a chosen token's log-probability over the positions before
the first difference, and the rows identical to mlx-lm's generation on the weights as the plan
holds them (which separates the plan's rounding from the engine's arithmetic), and with
--mlx-lm-batched the rows mlx-lm's own batch_generate gives as its generate_step does (how far
any batched run can agree).
Writes OUT_DIR/greedy_agreement.json.
"""

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import batchrun  # noqa: F401  (the same BLAS routing as batchrun gets)

# isort: split
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate, generate_step

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import SamplingParams
from batchrun.models.weights import plan_and_apply

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_labeling import write_rows  # noqa: E402


def mlx_lm_rows(model_path: str, rows: list[list[dict]], max_tokens: int, plan: str = ""):
    """mlx-lm's generation of each row alone; with `plan`, on the weights batchrun's plan
    holds (the engine's arithmetic apart from its weights' rounding)."""
    model, tokenizer = load(model_path)
    if plan:
        plan_and_apply(model, plan)
    eos = set(tokenizer.eos_token_ids)
    out = []
    for messages in rows:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        tokens, logprobs = [], []
        for token, lp in generate_step(mx.array(ids), model, max_tokens=max_tokens):
            token = int(token)
            if token in eos:
                break
            tokens.append(token)
            logprobs.append(lp[token].item())
        out.append((tokens, logprobs))
    return out


def mlx_lm_batched_rows(model_path: str, rows: list[list[dict]], max_tokens: int,
                        batch: int) -> list[list[int]]:
    """mlx-lm's own batch_generate on the rows, `batch` at a time: how far mlx-lm agrees with
    itself alone and batched (the baseline any batched run is read against)."""
    model, tokenizer = load(model_path)
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in rows]
    eos = set(tokenizer.eos_token_ids)
    out = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens,
                         return_token_ids=True, completion_batch_size=batch,
                         prefill_batch_size=batch).token_ids
    return [list(itertools.takewhile(lambda t: t not in eos, ids)) for ids in out]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--instruction", type=int, default=1000, help="instruction length in words")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--mlx-lm-batched", type=int, default=0, metavar="N",
                    help="also mlx-lm's batch_generate, N rows a batch, against its generate_step")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rows.jsonl"
    write_rows(path, args.rows, args.instruction)
    rows = [json.loads(line)["messages"] for line in path.open()]

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        engine = Engine.load(args.model, EngineConfig(weights=args.weights, cache_dir=cache))
        plan = engine.weight_plan.describe()
        changed = engine.weight_plan.changed
        outs = engine.generate(rows, SamplingParams(max_tokens=args.max_tokens, logprobs=True))
        engine.close()
        del engine
    ours = [(o.token_ids, o.logprobs or []) for o in outs]
    engine_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = mlx_lm_rows(args.model, rows, args.max_tokens)
    mlx_lm_s = time.perf_counter() - start
    # mlx-lm on the planned weights: a difference there is the engine's, not the plan's
    planned = mlx_lm_rows(args.model, rows, args.max_tokens, args.weights) if changed else theirs
    batched = mlx_lm_batched_rows(args.model, rows, args.max_tokens, args.mlx_lm_batched) \
        if args.mlx_lm_batched else None

    identical = first = 0
    where: Counter = Counter()
    largest = 0.0
    differing = []
    for i, ((a, alp), (b, blp)) in enumerate(zip(ours, theirs, strict=True)):
        same = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)))
        for j in range(min(same, len(alp), len(blp))):
            largest = max(largest, abs(alp[j] - blp[j]))
        if a == b:
            identical += 1
        else:
            where[same] += 1
            if len(differing) < 10:
                differing.append({"row": i, "position": same, "batchrun": a, "mlx_lm": b})
        first += bool(a[:1] == b[:1])
    result = {
        "date": time.strftime("%Y-%m-%d"), "model": args.model, "weights": plan,
        "device": str(mx.default_device()), "rows": len(rows), "max_tokens": args.max_tokens,
        "identical_rows": identical, "identical_share": identical / len(rows),
        "identical_first_token": first, "first_difference_at": dict(sorted(where.items())),
        "largest_logprob_difference": largest,
        "identical_to_mlx_lm_on_planned_weights": sum(
            a == b for (a, _), (b, _) in zip(ours, planned, strict=True)),
        "mlx_lm_batched_identical_to_mlx_lm": None if batched is None else sum(
            a == b for a, (b, _) in zip(batched, theirs, strict=True)),
        "engine_s": round(engine_s, 2),
        "mlx_lm_s": round(mlx_lm_s, 2), "differing_examples": differing}
    print(json.dumps({k: v for k, v in result.items() if k != "differing_examples"}))
    (args.out / "greedy_agreement.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
