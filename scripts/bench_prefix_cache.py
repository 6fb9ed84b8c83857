"""Issue 4's benchmark: a labeling workload with a long shared instruction.

    python scripts/bench_prefix_cache.py OUT_DIR [--shape demo|150m] [--rows 256]

Rows: a ~1,000-token system instruction (few-shot examples) + a short review, 8 new tokens.
(a) In one process: mlx-lm batch_generate (no cache) vs batchrun's engine with a cold prefix
    cache, same rows, same concurrency: prefill time and wall time.
(b) `batchrun run` twice in fresh processes on one cache folder: cold, then warm from disk:
    share of prompt tokens served from the cache, and wall time.
"""

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import batchrun  # noqa: F401  (routes MLX to OpenBLAS: must come before mlx.core)

# isort: split
from batchrun.bench import model_for
from batchrun.cache import make_prefix_cache
from batchrun.cache.disk import default_cache_dir
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import SamplingParams
from batchrun.models.random_model import review

CONCURRENCY = 64


def instruction(tokenizer, target_tokens: int = 1000) -> str:
    rng = random.Random(7)
    parts = ["You label product reviews with one word: positive, negative or neutral."]
    while len(tokenizer.encode(" ".join(parts))) < target_tokens:
        _, text, rating = review(rng)
        label = "positive" if rating >= 4 else "negative" if rating <= 2 else "neutral"
        parts.append(f"Review: {text} Label: {label}.")
    return " ".join(parts)


def rows(tokenizer, n: int) -> list[list[dict]]:
    system = instruction(tokenizer)
    rng = random.Random(11)
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"Review: {review(rng)[1]} Label:"}] for _ in range(n)]


def in_process(lm, messages: list[list[dict]], out: Path) -> dict:
    from mlx_lm.generate import batch_generate

    prompts = [lm.tokenizer.encode(lm.tokenizer.apply_chat_template(m, tokenize=False,
                                                                     add_generation_prompt=True),
                                   add_special_tokens=False) for m in messages]
    # Warm-up: compile kernels, fault in weights.
    batch_generate(lm.model, lm.tokenizer, prompts[:2], max_tokens=2)

    start = time.perf_counter()
    bg = batch_generate(lm.model, lm.tokenizer, prompts, max_tokens=8,
                        completion_batch_size=CONCURRENCY, return_token_ids=True)
    bg_wall = time.perf_counter() - start

    cache = make_prefix_cache(lm.fingerprint, 1 << 30, None)
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=CONCURRENCY),
                    lm.context_length, prefix_cache=cache, model_fingerprint=lm.fingerprint)
    start = time.perf_counter()
    for p in prompts:
        engine.add_tokens(p, SamplingParams(max_tokens=8))
    outs = engine.run()
    br_wall = time.perf_counter() - start
    same = [o.token_ids for o in outs] == bg.token_ids
    return {"prompt_tokens": sum(map(len, prompts)),
            "batch_generate": {"wall_s": bg_wall, "prefill_s": bg.stats.prompt_time},
            "batchrun_cold": {"wall_s": br_wall, "prefill_s": engine.stats.prefill_time,
                              "cached_tokens": engine.stats.cached_tokens},
            "same_tokens": same}


def cli_runs(model: str, messages: list[list[dict]], out: Path) -> dict:
    path = out / "labeling.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "messages": m}) + "\n"
                            for i, m in enumerate(messages)))
    cache = out / "cache"
    results = {}
    for name in ("cold", "warm"):
        job = out / f"job-{name}"
        cmd = [sys.executable, "-m", "batchrun", "run", str(path), "--model", model,
               "--job-dir", str(job), "--cache-dir", str(cache), "--max-tokens", "8",
               "--max-concurrency", str(CONCURRENCY), "--quiet", "--restart"]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        process_s = time.perf_counter() - start
        report = json.loads((job / "report.json").read_text())
        results[name] = {"process_s": process_s, "job_wall_s": report["wall_s"],
                         "prompt_tokens": report["prompt_tokens"],
                         "cached_prompt_tokens": report["cached_prompt_tokens"],
                         "prefill_tokens_per_s": report["prefill_tokens_per_s"]}
    texts = [(out / f"job-{n}" / "results.jsonl").read_text().splitlines() for n in results]
    results["same_text"] = [json.loads(x)["text"] for x in texts[0]] == \
        [json.loads(x)["text"] for x in texts[1]]
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="demo")
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lm = model_for(None, args.shape, default_cache_dir())
    messages = rows(lm.tokenizer, args.rows)
    a = in_process(lm, messages, args.out)
    b = cli_runs(lm.path, messages, args.out)
    result = {"date": time.strftime("%Y-%m-%d"), "shape": args.shape, "rows": args.rows,
              "in_process": a, "cli": b}
    (args.out / f"prefix-{args.shape}.json").write_text(json.dumps(result, indent=2))
    bg, cold = a["batch_generate"], a["batchrun_cold"]
    warm = b["warm"]
    print(f"{args.shape}: {args.rows} rows, {a['prompt_tokens']:,} prompt tokens")
    print(f"(a) prefill: batch_generate {bg['prefill_s']:.1f}s, batchrun cold "
          f"{cold['prefill_s']:.1f}s -> {bg['prefill_s'] / cold['prefill_s']:.1f}x less; "
          f"wall {bg['wall_s']:.1f}s vs {cold['wall_s']:.1f}s; same tokens: {a['same_tokens']}")
    print(f"(b) warm from disk: {warm['cached_prompt_tokens'] / warm['prompt_tokens']:.1%} of "
          f"prompt tokens cached; job wall cold {b['cold']['job_wall_s']:.1f}s vs warm "
          f"{warm['job_wall_s']:.1f}s -> {b['cold']['job_wall_s'] / warm['job_wall_s']:.1f}x; "
          f"whole process {b['cold']['process_s']:.1f}s vs {warm['process_s']:.1f}s; "
          f"same text: {b['same_text']}")


if __name__ == "__main__":
    main()
