"""Issue 18's speculative-decoding benchmarks, on the trained demo pair (this CPU or a GPU):

    python scripts/bench_speculate.py OUT_DIR [--reps 3] [--workloads few,long,extract,tail,full]

(a workload may name its own repetitions: `--workloads tail:15,full:15,long`).

Each workload runs its systems interleaved, `--reps` times, in one process (engine time from
the first request to the last output; the model and draft loaded once, a warm-up first):
- few: 8 sample questions (sample_data/prompts.jsonl, not its weather-tool rows), greedy,
  max_tokens 256 (the model ends its answers itself); plain, then --draft-model with 4 and 6
  guesses, then ngram (and with --other-draft PATH, that draft with 4 and 6 guesses, in long too);
- long: the issue's 8 x 256 job: the same 8 rows made 256 tokens each (min_tokens 256: past its
  answer the committed pair goes on as its lessons taught it); the same systems and the draft
  with 8 guesses;
- essays: 8 rows asking for an essay about a topic (the ~330-token answers of the lessons'
  `long_answers`: for a pair trained with them), min_tokens and max_tokens 256; the same
  systems, and the draft with 6 and 8 guesses uncompiled (draft6u, draft8u: its forward as
  mlx-lm runs it, not `speculate.CompiledForward`) (on the H200 an earlier long-answer pair ended
  some essays after their first part, where the CPU's arithmetic went on);
- few_sampled: the same rows sampled (temperature 0.7, seeded);
- extract: 8 rows whose answer copies spans of the prompt (a reference text holding a topic's
  facts, then a question the lessons' `long_answers` answer in the reference's sentences; the
  committed pair was taught them), max_tokens 128;
  plain, ngram with 4, 6 and 8 guesses, the draft with 6;
- tail: 512 sample questions at the CPU's default concurrency; the tail is the time from the
  461st finished row (90%) to the last; plain, then draft (speculating by measurement);
- full: 256 rows of the random-weight demo model (the trained draft's tokenizer), 48 tokens
  each, all finishing together: the batch is full to the end, so nothing speculates and the
  figure is what the per-step decision costs; plain, draft.
Greedy tokens are compared with plain decoding's on every run. Writes OUT_DIR/speculate.json
and prints a table of median seconds and ratios.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)
from batchrun.engine.config import EngineConfig  # noqa: E402
from batchrun.engine.decoding import speculate  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.types import SamplingParams  # noqa: E402
from batchrun.models import (  # noqa: E402
    DEMO_DRAFT_MODEL,
    DEMO_MODEL,
    RANDOM_DEMO_MODEL,
    load_model,
)
from tools.demo_models.lessons import (  # noqa: E402
    ESSAY_TASKS,
    FACTS,
    REFERENCE_TASKS,
    reference_text,
)


def questions(n: int, tools: bool = True) -> list[list[dict]]:
    """Chats of the sample prompts, cycled to n; without `tools`, not the weather-tool rows."""
    rows = [json.loads(line) for line in (ROOT / "sample_data" / "prompts.jsonl").open()]
    chats = [r["messages"] if "messages" in r else [{"role": "user", "content": r["prompt"]}]
             for r in rows if tools or "tools" not in r]
    return [chats[i % len(chats)] for i in range(n)]


def extraction(n: int) -> list[list[dict]]:
    """A reference text holding the answer, then a question answered from it."""
    topics = sorted(FACTS)
    return [[{"role": "system", "content": reference_text(topics[i % len(topics)])},
             {"role": "user", "content": REFERENCE_TASKS[i % len(REFERENCE_TASKS)].format(
                 t=topics[i % len(topics)])}] for i in range(n)]


def essays(n: int) -> list[list[dict]]:
    topics = sorted(FACTS)
    return [[{"role": "user", "content": ESSAY_TASKS[i % 2].format(t=topics[i % len(topics)])}]
            for i in range(n)]


SYSTEMS = {"plain": ("off", 4), "draft4": ("draft", 4), "draft6": ("draft", 6),
           "draft8": ("draft", 8), "ngram": ("ngram", 4), "ngram6": ("ngram", 6),
           "ngram8": ("ngram", 8), "ngram12": ("ngram", 12), "draft": ("draft", 4),
           "other4": ("other", 4), "other6": ("other", 6),  # --other-draft's
           "draft6u": ("draft", 6), "draft8u": ("draft", 8)}  # the draft's forward uncompiled
DRAFTS = {"draft": DEMO_DRAFT_MODEL}
WORKLOADS = {
    # name: (target, rows, params, concurrency, systems)
    "few": (DEMO_MODEL, lambda: questions(8, tools=False), SamplingParams(max_tokens=256), 8,
            ("plain", "draft4", "draft6", "ngram")),
    "long": (DEMO_MODEL, lambda: questions(8, tools=False),
             SamplingParams(max_tokens=256, min_tokens=256), 8,
             ("plain", "draft4", "draft6", "draft8", "ngram")),
    "essays": (DEMO_MODEL, lambda: essays(8), SamplingParams(max_tokens=256, min_tokens=256), 8,
               ("plain", "draft4", "draft6", "draft8", "ngram", "draft6u", "draft8u")),
    "few_sampled": (DEMO_MODEL, lambda: questions(8, tools=False),
                    SamplingParams(max_tokens=256, temperature=0.7, seed=5), 8,
                    ("plain", "draft4", "draft6")),
    "extract": (DEMO_MODEL, lambda: extraction(8), SamplingParams(max_tokens=128), 8,
                ("plain", "ngram", "ngram6", "ngram8", "ngram12", "draft6")),
    "tail": (DEMO_MODEL, lambda: questions(512), SamplingParams(max_tokens=256), None,
             ("plain", "draft4")),
    "full": (RANDOM_DEMO_MODEL, lambda: questions(256), SamplingParams(max_tokens=48), 256,
             ("plain", "draft4")),
}


def run_once(lm, chats, params, concurrency, system) -> dict:
    method, k = SYSTEMS[system]
    speculate.COMPILE_DRAFT = not system.endswith("u")
    config = EngineConfig(max_concurrency=concurrency,
                          speculate="draft" if method == "other" else method, draft_tokens=k,
                          draft_model=str(DRAFTS[method]) if method in DRAFTS else None,
                          prefix_cache=False)
    engine = Engine(lm.model, lm.tokenizer, config, lm.context_length)
    ids = [engine.add_request(messages=c, params=params) for c in chats]
    finished = {}
    start = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            finished[out.request_id] = (time.perf_counter() - start, out.token_ids)
    wall = time.perf_counter() - start
    times = sorted(t for t, _ in finished.values())
    s = engine.stats.speculation
    return {"system": system, "wall_s": wall,
            "tail_s": wall - times[int(0.9 * len(times))],
            "tokens": sum(len(t) for _, t in finished.values()),
            "mean_batch": engine.stats.mean_batch_size,
            "speculative_steps": s.steps, "proposed": s.proposed, "accepted": s.accepted,
            "outputs": [finished[i][1] for i in ids]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workloads", default="few,few_sampled,extract,tail,full")
    parser.add_argument("--target", type=Path, help="the trained target in place of the demo's "
                        "(a pair being tried)")
    parser.add_argument("--draft", type=Path, help="the draft in place of the demo's")
    parser.add_argument("--other-draft", type=Path,
                        help="a second draft model, run beside the demo's in `few` and `long` "
                             "(other4, other6)")
    args = parser.parse_args()
    if args.other_draft:
        DRAFTS["other"] = args.other_draft
    if args.draft:
        DRAFTS["draft"] = args.draft
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for item in args.workloads.split(","):
        name, _, reps = item.partition(":")
        reps = int(reps) if reps else args.reps
        target, rows, params, concurrency, systems = WORKLOADS[name]
        if name in ("few", "long") and args.other_draft:
            systems = (*systems, "other4", "other6")
        lm = load_model(str(args.target if args.target and target == DEMO_MODEL else target))
        chats = rows()
        run_once(lm, chats[:4], SamplingParams(max_tokens=8), concurrency, "draft4")  # warm-up
        runs = []
        for rep in range(reps):
            for system in systems:
                r = run_once(lm, chats, params, concurrency, system)
                r["rep"] = rep
                runs.append(r)
                print(f"{name:8} {system:7} rep {rep}: {r['wall_s']:.3f} s, tail "
                      f"{r['tail_s']:.3f} s, {r['tokens']} tokens, kept {r['accepted']} of "
                      f"{r['proposed']}", flush=True)
        reference = next(r["outputs"] for r in runs if r["system"] == "plain")
        for r in runs:
            r["same_tokens"] = r.pop("outputs") == reference
        results[name] = runs
    summary = []
    for name, runs in results.items():
        base = statistics.median(r["wall_s"] for r in runs if r["system"] == "plain")
        base_tail = statistics.median(r["tail_s"] for r in runs if r["system"] == "plain")
        for system in dict.fromkeys(r["system"] for r in runs):
            mine = [r for r in runs if r["system"] == system]
            wall = statistics.median(r["wall_s"] for r in mine)
            tail = statistics.median(r["tail_s"] for r in mine)
            summary.append({"workload": name, "system": system, "median_wall_s": wall,
                            "speedup": base / wall, "median_tail_s": tail,
                            "tail_speedup": base_tail / tail if tail else None,
                            "acceptance": sum(r["accepted"] for r in mine)
                            / max(1, sum(r["proposed"] for r in mine)),
                            "same_tokens": all(r["same_tokens"] for r in mine)})
    (args.out / "speculate.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "reps": args.reps, "workloads": args.workloads,
         "summary": summary,
         "runs": results}, indent=2))
    print(f"{'workload':9}{'system':8}{'wall s':>8}{'speedup':>9}{'tail s':>8}{'tail x':>8}"
          f"{'kept':>7}  same tokens")
    for s in summary:
        print(f"{s['workload']:9}{s['system']:8}{s['median_wall_s']:8.3f}{s['speedup']:8.2f}x"
              f"{s['median_tail_s']:8.3f}{(s['tail_speedup'] or 0):7.2f}x{s['acceptance']:7.0%}"
              f"  {s['same_tokens']}")


if __name__ == "__main__":
    main()
