"""Issue 7's benchmark: the same rows decoded free and under a constraint, in one process.

    python scripts/bench_constrained.py [--shape demo|150m] [--rows 128] [--max-tokens 64]

Systems, each on the same prompts at the same concurrency, alternated over `--repeat` rounds:
  free    no constraint;
  regex   a regex that allows long free text ([a-z ,.']{1,400}): the random model writes as many
          tokens as the free rows do, so time per token compares masking cost alone;
  schema  a labeling JSON schema (enum, integer, short string, boolean);
  choices three labels, answered from the choices' probabilities.
Prints seconds, generated tokens and ms per generated token; the ratio to `free` is per token
(rows of different systems end at different lengths).
"""

import argparse
import json
import time
from pathlib import Path

import batchrun  # noqa: F401  (routes MLX to OpenBLAS: must come before mlx.core)

# isort: split
import mlx.core as mx

from batchrun import bench as b
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import Constraint, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative", "neutral"]},
    "score": {"type": "integer", "minimum": 1, "maximum": 5},
    "summary": {"type": "string", "maxLength": 40},
    "verified": {"type": "boolean"}},
    "required": ["label", "score", "summary", "verified"], "additionalProperties": False}
CONSTRAINTS = {
    "free": None,
    "regex": Constraint.regex(r"[a-z ,.']{1,400}"),
    "schema": Constraint.json_schema(SCHEMA),
    "choices": Constraint.choices(["positive", "negative", "neutral"]),
}


def run(lm, prompts, constraint, max_tokens: int, concurrency: int) -> dict:
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=concurrency),
                    lm.context_length)
    _ = engine.grammars  # build the tokenizer index outside the timing (once per model)
    start = time.perf_counter()
    for p in prompts:
        engine.add_tokens(p, SamplingParams(max_tokens=max_tokens, constraint=constraint))
    outs = engine.run()
    wall = time.perf_counter() - start
    tokens = sum(o.completion_tokens for o in outs)
    return {"wall_s": wall, "tokens": tokens, "ms_per_token": wall / tokens * 1e3,
            "complete": sum(bool(o.constraint_complete) for o in outs)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="demo")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm = b.model_for(None, args.shape, Path.home() / ".cache" / "batchrun")
    w = b.make_workload(lm.tokenizer, "short", args.rows, args.max_tokens)
    b.warm_up(lm, w)
    results: dict[str, list[dict]] = {name: [] for name in CONSTRAINTS}
    for _ in range(args.repeat):
        for name, constraint in CONSTRAINTS.items():
            mx.clear_cache()
            results[name].append(run(lm, w.prompts, constraint, args.max_tokens,
                                     args.concurrency))
    best = {name: min(rs, key=lambda r: r["ms_per_token"]) for name, rs in results.items()}
    print(f"{args.shape}: {args.rows} rows, max_tokens {args.max_tokens}, "
          f"concurrency {args.concurrency}, best of {args.repeat}")
    print(f"{'system':8} {'wall s':>8} {'tokens':>7} {'ms/token':>9} {'vs free':>8} complete")
    for name, r in best.items():
        ratio = r["ms_per_token"] / best["free"]["ms_per_token"]
        print(f"{name:8} {r['wall_s']:8.2f} {r['tokens']:7d} {r['ms_per_token']:9.3f} "
              f"{ratio:7.2f}x {r['complete']:>4}/{args.rows}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "machine": b.machine(), "runs": results}, indent=2))


if __name__ == "__main__":
    main()
