"""Issue 13's defaults check: `batchrun run` with default flags against the best flags found.

    python scripts/sweep_flags.py OUT_DIR [--model PATH] [--rows 120] [--instruction 1300]
        [--max-tokens 4] [--reps 2] [--workload labeling|decode]
        [--flags "" "--max-concurrency 64" ...]

Labeling rows (bench_labeling.py's: a ~N-word shared instruction + one review); one cold job
fills a prefix-cache folder, then each flag set (the empty one: the defaults) runs as a fresh
warm process `reps` times, in turn. `--workload decode`: bench_decode_job.py's rows instead
(no shared prefix, ~128 prompt tokens; give --max-tokens 256), with no prefix cache. Prints
each set's best and median job wall (the report's) and the defaults' speed as a share of the
best set's; writes OUT_DIR/sweep.json.
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decode_job  # noqa: E402
from bench_labeling import write_rows  # noqa: E402

FLAG_SETS = ["", "--max-concurrency 32", "--max-concurrency 64", "--max-concurrency 128",
             "--prefill-batch-size 4", "--prefill-batch-size 16", "--prefill-batch-size 64",
             "--prefill-batch-size 256"]


def job_wall(out: Path, rows: Path, cache: Path | None, model: str, max_tokens: int,
             flags: str) -> float:
    job = out / "job"
    subprocess.run(["rm", "-rf", str(job)], check=True)
    caching = ["--cache-dir", str(cache)] if cache else ["--no-prefix-cache"]
    subprocess.run([sys.executable, "-m", "batchrun", "run", str(rows), "--quiet",
                    "--job-dir", str(job), *caching, "--model", model,
                    "--max-tokens", str(max_tokens), *shlex.split(flags)], check=True)
    return json.loads((job / "report.json").read_text())["runs"][-1]["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--instruction", type=int, default=1300, help="words")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workload", choices=("labeling", "decode"), default="labeling")
    ap.add_argument("--flags", nargs="*", default=FLAG_SETS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = args.out / "rows.jsonl"
    if args.workload == "decode":
        bench_decode_job.write_rows(rows, args.rows, 108)
        cache = None
    else:
        write_rows(rows, args.rows, args.instruction)
        cache = args.out / "cache"
        job_wall(args.out, rows, cache, args.model, args.max_tokens, "")  # fills the cache
    walls: dict[str, list[float]] = {f: [] for f in args.flags}
    for _ in range(args.reps):
        for flags in args.flags:
            walls[flags].append(job_wall(args.out, rows, cache, args.model, args.max_tokens,
                                         flags))
    best = min(min(w) for w in walls.values())
    table = []
    for flags, w in walls.items():
        table.append({"flags": flags or "(defaults)", "walls_s": w, "best_s": min(w),
                      "median_s": statistics.median(w), "speed_vs_best": best / min(w)})
        print(f"{flags or '(defaults)':28} best {min(w):6.3f} s  median "
              f"{statistics.median(w):6.3f} s  {best / min(w):6.1%} of the best set")
    (args.out / "sweep.json").write_text(json.dumps(
        {"workload": args.workload, "rows": args.rows, "instruction_words": args.instruction,
         "max_tokens": args.max_tokens, "model": args.model, "table": table}, indent=2))


if __name__ == "__main__":
    main()
