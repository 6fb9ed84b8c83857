"""The CPU's attention through NumPy (engine/kernels/host_attention.py) against MLX's own,
interleaved in one process, on bench_speculate.py's workloads and `prefill` (64 rows of its
extraction prompts, ~300 tokens each, 2 new tokens each, all at once: plain decoding only):

    python scripts/ab_host_attention.py OUT.json [--reps 7] [--workloads prefill,extract,essays]
        [--systems plain,ngram6,draft6]

Each repetition runs every system with MLX's attention (`mlx`) and with NumPy's (`host`), in
turn. Prints each pair's median engine seconds and their ratio, and whether every run's greedy
tokens are those of the first; writes every run to OUT.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_speculate as bench  # noqa: E402  (imports batchrun first: BLAS routing)

from batchrun.engine.kernels import host_attention  # noqa: E402
from batchrun.engine.types import SamplingParams  # noqa: E402
from batchrun.models import DEMO_MODEL, load_model  # noqa: E402

WORKLOADS = {**bench.WORKLOADS, "prefill": (DEMO_MODEL, lambda: bench.extraction(64),
                                            SamplingParams(max_tokens=2), 64, ("plain",))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--workloads", default="prefill,extract,essays")
    parser.add_argument("--systems", default="plain,ngram6,draft6")
    args = parser.parse_args()
    systems = args.systems.split(",")
    runs = []
    for name in args.workloads.split(","):
        target, rows, params, concurrency, known = WORKLOADS[name]
        mine = list(known) if name == "prefill" else systems  # prefill: plain decoding
        lm = load_model(str(target))
        chats = rows()
        for on in (True, False):  # warm-up both ways
            host_attention.ENABLED = on
            bench.run_once(lm, chats[:4], SamplingParams(max_tokens=8), concurrency, "draft4")
        reference = None
        for rep in range(args.reps):
            for system in mine:
                for attention in ("mlx", "host"):
                    host_attention.ENABLED = attention == "host"
                    r = bench.run_once(lm, chats, params, concurrency, system)
                    outputs = r.pop("outputs")
                    reference = reference or outputs
                    runs.append({"workload": name, "system": system, "attention": attention,
                                 "rep": rep, "same_tokens": outputs == reference, **r})
                    print(f"{name:8} {system:7} {attention:4} rep {rep}: {r['wall_s']:.3f} s",
                          flush=True)
    host_attention.ENABLED = True
    print(f"{'workload':9}{'system':8}{'mlx s':>8}{'host s':>8}{'host x':>8}{'vs plain':>10}"
          f"  same tokens")
    summary = []
    for name in args.workloads.split(","):
        def median(system, attention, name=name):
            return statistics.median(r["wall_s"] for r in runs if (
                r["workload"], r["system"], r["attention"]) == (name, system, attention))
        for system in dict.fromkeys(r["system"] for r in runs if r["workload"] == name):
            mlx, host = median(system, "mlx"), median(system, "host")
            same = all(r["same_tokens"] for r in runs
                       if (r["workload"], r["system"]) == (name, system))
            vs_plain = median("plain", "host") / host if "plain" in systems else None
            summary.append({"workload": name, "system": system, "mlx_s": mlx, "host_s": host,
                            "host_speedup": mlx / host, "speedup_vs_plain_host": vs_plain,
                            "same_tokens": same})
            print(f"{name:9}{system:8}{mlx:8.3f}{host:8.3f}{mlx / host:7.2f}x"
                  f"{'' if vs_plain is None else f'{vs_plain:9.2f}x'}  {same}")
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "reps": args.reps,
                                    "summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
