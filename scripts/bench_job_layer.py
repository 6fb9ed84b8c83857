"""Issue 3's benchmark: memory stays flat in the row count, and the job layer alone (reading,
parsing, templating, tokenizing, ordering, writing, committing) is far faster than the engine.

    python scripts/bench_job_layer.py OUT_DIR [--rows 10000,50000,100000]

For each row count it writes a synthetic JSONL and runs, each in a fresh process:
  - `batchrun run FILE --max-tokens 1` on the demo model (real engine), and
  - the same job with a null engine that answers every request at once (job layer alone),
and reports wall time, rows/s and the process's peak RSS.
"""

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import batchrun  # noqa: F401  (routes MLX to OpenBLAS: must come before mlx.core)

CHILD = r"""
import resource, sys, time
from pathlib import Path
import batchrun
from batchrun.engine.engine import Engine
from batchrun.engine.config import EngineConfig
from batchrun.engine.types import FinishReason, Output, SamplingParams
from batchrun.job.rows import RowOptions
from batchrun.job.runner import JobRunner
from batchrun.job.spec import JobSpec

class NullEngine(Engine):
    '''The real engine's bookkeeping with no model call: every request gets one token at once.'''
    def step(self):
        finished, self._finished = self._finished, []
        while self._waiting:
            seq = self._waiting.popleft()
            finished.append(Output(seq.id, "x", [0], FinishReason.LENGTH, len(seq.prompt)))
            self.stats.completion_tokens += 1
        self.stats.requests_finished += len(finished)
        return finished

mode, path, job = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
cls = NullEngine if mode == "null" else Engine
engine = cls.load(None, EngineConfig(max_concurrency=64))
spec = JobSpec(path, job, job / "results.jsonl", None,
               RowOptions(SamplingParams(max_tokens=1)), quiet=True)
start = time.perf_counter()
report = JobRunner(engine, spec, "demo", engine.model_path, "cpu").run()
wall = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(f"{report['rows_done']} {wall:.3f} {rss}")
"""


def write_rows(path: Path, n: int) -> None:
    rng = random.Random(n)
    words = ["kettle", "sturdy", "quiet", "tent", "bright", "slow", "great", "broken", "price"]
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
            row = ({"prompt": f"Review {i}: {text}"} if i % 2 else
                   {"messages": [{"role": "user", "content": f"Classify: {text}"}]})
            f.write(json.dumps({"custom_id": f"row-{i}", **row}) + "\n")


def run(mode: str, path: Path, job: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(job)],
                         capture_output=True, text=True, check=True)
    rows, wall, rss = out.stdout.split()[-3:]
    return {"mode": mode, "rows": int(rows), "wall_s": float(wall),
            "rows_per_s": int(rows) / float(wall), "peak_rss_mb": int(rss) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", default="10000,50000,100000")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for n in map(int, args.rows.split(",")):
        path = args.out / f"rows-{n}.jsonl"
        write_rows(path, n)
        for mode in ("null", "engine"):
            r = run(mode, path, args.out / f"job-{mode}-{n}")
            results.append(r)
            print(f"{n:>7} rows  {mode:6}  {r['wall_s']:8.1f} s  {r['rows_per_s']:9.0f} rows/s  "
                  f"peak RSS {r['peak_rss_mb']:7.1f} MB", flush=True)
        path.unlink()
    (args.out / "job-layer.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "max_rss_units": resource.getpagesize(),
         "results": results}, indent=2))


if __name__ == "__main__":
    main()
