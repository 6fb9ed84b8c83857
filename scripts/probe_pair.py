"""Everything the demo tests ask of a trained pair, counted rather than asserted, so a retrain can
be judged before it replaces sample_data's pair: the labeling job's agreement with the ratings
(test: 190 of 200), the sample questions (44 of 48), the weather tool call for every lesson city
(the test asks Oslo), essays written right to 256 tokens (13 of 26), references quoted (36 of
39), and the share of guesses kept with the draft on essays and prompt lookup on quotes (0.8).

    python scripts/probe_pair.py TARGET DRAFT [--json OUT]

Prints one JSON object; `passes` is whether every test threshold is met.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)

# isort: split
import orjson  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from batchrun.cli import cli  # noqa: E402
from batchrun.engine.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.types import SamplingParams  # noqa: E402
from batchrun.models import REPO_ROOT, load_model, random_model  # noqa: E402
from tools.demo_models import lessons, train  # noqa: E402

THRESHOLDS = {"labels": 190, "questions": 44, "oslo": 1, "essays": 13, "references": 36}


def job_results(args: list[str], folder: Path, output: Path | None = None) -> dict:
    output = output or folder / "results.jsonl"
    result = CliRunner().invoke(cli, ["run", *args, "--job-dir", str(folder), "--output",
                                      str(output), "--quiet"])
    if result.exit_code:
        raise SystemExit(f"batchrun run {' '.join(args)}: {result.output.strip()}")
    return {r["custom_id"]: r.get("text") for r in map(orjson.loads,
                                                       output.read_bytes().splitlines())}


def labels(target: str, tmp: Path) -> int:
    got = job_results([str(REPO_ROOT / "jobs" / "label_reviews_choices.toml"), "--model",
                       target], tmp / "labels", tmp / "labels.jsonl")
    ratings = {r["id"]: r["rating"] for r in map(
        orjson.loads, (REPO_ROOT / "sample_data" / "reviews.jsonl").read_bytes().splitlines())}
    return sum(got.get(i) == lessons.sentiment(r) for i, r in ratings.items())


def questions(target: str, tmp: Path) -> int:
    prompts = REPO_ROOT / "sample_data" / "prompts.jsonl"
    texts = job_results([str(prompts), "--model", target, "--no-prefix-cache"], tmp / "q")
    asked = {task.format(t=t): lessons.answer(task, t) for task in random_model.TASKS
             for t in random_model.TOPICS}
    right = 0
    for row in map(orjson.loads, prompts.read_bytes().splitlines()):
        messages = row.get("messages") or [{"role": "user", "content": row.get("prompt")}]
        answer = asked.get(next(m["content"] for m in reversed(messages) if m["role"] == "user"))
        text = (texts[row["custom_id"]] or "").strip()
        if answer is not None:
            right += bool(text) and answer.startswith(text) or text.startswith(answer)
    return right


def engine_counts(lm, draft: str) -> dict:
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(prefix_cache=False), lm.context_length)
    essays, _, quoted, _ = train.long_answers_known(engine)
    cities = train.weather_calls_known(engine)
    kept = {}
    topics4 = random_model.TOPICS[:4]
    essays4 = [[{"role": "user", "content": lessons.ESSAY_TASKS[0].format(t=t)}] for t in topics4]
    quotes4 = [[{"role": "system", "content": lessons.reference_text(t)},
                {"role": "user", "content": lessons.REFERENCE_TASKS[2].format(t=t)}]
               for t in topics4]
    for prompts, kind in ((essays4, "draft"), (quotes4, "ngram")):
        config = EngineConfig(max_concurrency=4, speculate=kind, draft_tokens=6,
                              draft_model=draft if kind == "draft" else None, prefix_cache=False)
        spec = Engine(lm.model, lm.tokenizer, config, lm.context_length)
        spec.speculator.adaptive = False
        spec.generate(prompts, SamplingParams(max_tokens=64))
        stats = spec.stats.speculation
        kept[kind] = round(stats.accepted / max(stats.proposed, 1), 3)
    return {"essays": essays, "references": quoted, "cities": len(cities),
            "oslo": int("Oslo" in cities), "kept_draft": kept["draft"],
            "kept_ngram": kept["ngram"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        counts = {"labels": labels(args.target, Path(tmp)),
                  "questions": questions(args.target, Path(tmp))}
    counts.update(engine_counts(load_model(args.target), args.draft))
    counts["passes"] = (all(counts[k] >= v for k, v in THRESHOLDS.items())
                        and min(counts["kept_draft"], counts["kept_ngram"]) > 0.8)
    line = json.dumps({"target": args.target, **counts})
    print(line, flush=True)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
