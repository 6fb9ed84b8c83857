"""Reuse of prompts computed earlier in a job: conversations whose later rows extend earlier ones.

    python scripts/bench_reuse.py OUT_DIR [--model PATH] [--rows 256] [--gap 128]
        [--system-words 600] [--max-concurrency 32] [--max-tokens 4]

Row i < gap is a system message (its own, ~`system-words` words) and a user turn; row i >= gap
repeats row i - gap's system message and user turn, adds an assistant turn and a new user turn.
At a concurrency well under `gap`, row i - gap has long finished when row i arrives: only a
prompt kept from the rows computed before serves it. batchrun runs the rows with the prefix
cache (a fresh cache folder) and without it; reported: the share of prompt tokens read from the
cache, whether both give the same texts, and each run's job seconds. Writes OUT_DIR/reuse.json.
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["order", "delivery", "refund", "battery", "screen", "kettle", "handle", "warranty",
         "colour", "size", "courier", "box", "manual", "charger", "strap", "lid", "button",
         "noise", "smell", "label", "price", "invoice", "return"]


def rows(n: int, gap: int, words: int) -> list[dict]:
    out = []
    for i in range(n):
        base = i % gap
        rng = random.Random(base)
        system = f"Case {base}. Facts: " + " ".join(rng.choice(WORDS) for _ in range(words))
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Summarize case {base} in one word."}]
        if i >= gap:
            messages += [{"role": "assistant", "content": "Done."},
                         {"role": "user", "content": f"And the mood of case {base}?"}]
        out.append({"custom_id": f"r{i}", "messages": messages})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=str(ROOT / "sample_data" / "demo-model"))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--gap", type=int, default=128)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = out / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows, args.gap,
                                                                  args.system_words)))
    result = {"rows": args.rows, "gap": args.gap, "max_concurrency": args.max_concurrency}
    texts = {}
    for name, extra in (("cache", ["--cache-dir", str(out / "cache")]),
                        ("no cache", ["--no-prefix-cache"])):
        job = out / f"job-{name.replace(' ', '-')}"
        subprocess.run([sys.executable, "-m", "batchrun", "run", str(data), "--quiet",
                        "--model", args.model, "--job-dir", str(job), "--max-tokens",
                        str(args.max_tokens), "--max-concurrency", str(args.max_concurrency),
                        *extra], check=True)
        report = json.loads((job / "report.json").read_text())
        records = [json.loads(line) for line in
                   (job / "results.jsonl").read_text().splitlines()]
        texts[name] = [r["text"] for r in records]
        later = [r["usage"] for r in records if r["index"] >= args.gap]
        result[name] = {k: report.get(k) for k in ("prompt_tokens", "cached_prompt_tokens",
                                                   "wall_s", "prompt_sources")}
        # the rows that repeat an earlier row's start: the share of theirs read from the cache
        result[name]["later_rows_cached_share"] = \
            sum(u["cached_tokens"] for u in later) / max(1, sum(u["prompt_tokens"] for u in later))
    cached = result["cache"]
    result["cached_share"] = cached["cached_prompt_tokens"] / max(1, cached["prompt_tokens"])
    result["same_texts"] = texts["cache"] == texts["no cache"]
    (out / "reuse.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
