"""Issue 14's whole-job decode benchmark: `batchrun run` with default flags against mlx-lm's
batch_generate, each a fresh process, on the same rows (N raw prompts of ~128 tokens, up to 256
new tokens, greedy).

    python scripts/bench_decode_job.py OUT_DIR --model PATH [--rows 1024] [--max-tokens 256]
        [--concurrency 256,1024] [--systems batchrun,masked,nocudnn,noshared,batch_generate]
        [--flags "..."] [--trace]

- batchrun: `batchrun run ROWS --max-tokens N --model PATH` (no other flags); tok/s over the
  report's job wall (the job loop: reading, tokenizing, feeding, writing, committing);
- masked: the same with BATCHRUN_DECODE_KERNEL=0 (decode attention through mlx-lm's mask);
- nocudnn: the same with MLX_CUDA_USE_CUDNN_SDPA=0 (MLX's prefill attention without cuDNN);
- fixed_budget: the same with the earlier GPU defaults (a fixed 32,768-token prefill budget, no
  warm-up);
- noshared: the same with --no-shared-prefix (each row its own copy of any cached prefix);
- batch_generate: mlx-lm's batch_generate on the same prompts' tokens at each concurrency;
  tok/s over its own call (after imports, loading and tokenizing).
A system may be named twice (the second run finds MLX's and the driver's kernel caches warm).
With --trace, batchrun's runs go through scripts/trace_job.py: each engine step and prefill
(rows, padded length) with timestamps, in OUT_DIR/trace-SYSTEM-N.txt.
Generated tokens: the rows' completion tokens (a row may stop early at an end token).
Writes OUT_DIR/decode_job.json and prints a table.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchrun.models.random_model import review  # noqa: E402  (no MLX import: cheap)

PEER = r'''
import json, sys, time
import batchrun  # the same BLAS routing as batchrun gets
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate
model_path, rows_path, max_tokens, concurrency = sys.argv[1:5]
model, tokenizer = load(model_path)
prompts = [tokenizer.encode(json.loads(line)["prompt"]) for line in open(rows_path)]
start = time.perf_counter()
out = batch_generate(model, tokenizer, prompts, max_tokens=int(max_tokens),
                     completion_batch_size=int(concurrency), return_token_ids=True)
print(json.dumps({"wall_s": time.perf_counter() - start,
                  "tokens": sum(len(t) for t in out.token_ids),
                  "peak_memory_bytes": mx.get_peak_memory()}))
'''

# batchrun's systems: the environment each runs with.
ENV = {"batchrun": {},
       "masked": {"BATCHRUN_DECODE_KERNEL": "0"},
       # MLX's prefill attention without cuDNN (which builds a graph for every new shape)
       "nocudnn": {"MLX_CUDA_USE_CUDNN_SDPA": "0"},
       "fixed_budget": {},
       "noshared": {}}
# Systems that run batchrun with flags of their own (rows without a shared prefix: the shared
# attention's machinery switched off, for issue 13's "no regression elsewhere").
FLAGS = {"noshared": ["--no-shared-prefix"]}
# Systems that run batchrun with some of its settings as they were (Python run first).
PATCHES = {
    # the earlier GPU defaults: a fixed 32,768-token prefill budget, no warm-up
    "fixed_budget": "from batchrun.engine import engine, memory\n"
                "memory.GPU_PREFILL_TOKENS = (32768, 32768)\n"
                "engine.Engine.warm_up = lambda self, cpu_too=False: None",
}
# Runs argv[2:] (a script, or "-m batchrun") after exec'ing argv[1], PyTorch hidden first as
# the command line hides it.
PATCHED = ("import runpy, sys\nfrom batchrun.engine.load import keep_torch_out\n"
           "keep_torch_out(sys.argv[sys.argv.index('--model') + 1])\n"
           "exec(sys.argv[1])\nsys.argv = sys.argv[2:]\n"
           "if sys.argv[0] == '-m':\n    sys.argv = ['batchrun', *sys.argv[2:]]\n"
           "    runpy.run_module('batchrun', run_name='__main__', alter_sys=True)\n"
           "else:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n")


def write_rows(path: Path, rows: int, words: int) -> None:
    """Rows of synthetic reviews, each about `words` words."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(rows):
            text = []
            while len(text) < words:
                text += review(rng)[1].split()
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": " ".join(text[:words])}) + "\n")


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--words", type=int, default=108, help="words a prompt (~128 tokens)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="256,1024", help="batch_generate's batch sizes")
    ap.add_argument("--systems", default="batchrun,masked,batch_generate")
    ap.add_argument("--flags", default="", help="extra flags for batchrun run")
    ap.add_argument("--trace", action="store_true", help="batchrun runs through trace_job.py")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = out / "rows.jsonl"
    write_rows(rows, args.rows, args.words)
    results = []
    for n, system in enumerate(args.systems.split(",")):
        if system in ENV:
            env = {**os.environ, **ENV[system]}
            job = out / f"job-{system}-{n}"
            entry = [str(ROOT / "scripts" / "trace_job.py")] if args.trace else ["-m", "batchrun"]
            if system in PATCHES:
                entry = ["-c", PATCHED, PATCHES[system], *entry]
            start = time.perf_counter()
            proc = run([sys.executable, *entry, "run", str(rows), "--quiet", "--max-tokens",
                        str(args.max_tokens), "--model", args.model, "--job-dir", str(job),
                        "--restart", *FLAGS.get(system, []), *args.flags.split()], env)
            process = time.perf_counter() - start
            if args.trace:
                (out / f"trace-{system}-{n}.txt").write_text(proc.stderr)
            report = json.loads((job / "report.json").read_text())["runs"][-1]
            results.append({"system": system, "process_s": process, "wall_s": report["wall_s"],
                            "tokens": report["completion_tokens"],
                            "mean_batch": report["mean_batch_size"],
                            "max_concurrency": report["max_concurrency"],
                            "ttft_p50_s": report["ttft_p50_s"],
                            "peak_memory_bytes": report["peak_memory_bytes"]})
        elif system == "batch_generate":
            for c in args.concurrency.split(","):
                r = json.loads(run([sys.executable, "-c", PEER, args.model, str(rows),
                                    str(args.max_tokens), c]).stdout.splitlines()[-1])
                results.append({"system": f"batch_generate@{c}", **r})
        for r in results:
            r.setdefault("tokens_per_s", r["tokens"] / r["wall_s"])
        print(json.dumps(results[-1]), flush=True)
    best_peer = max((r["tokens_per_s"] for r in results
                     if r["system"].startswith("batch_generate")), default=0)
    lines = [f"{'system':22} {'job s':>8} {'tokens':>8} {'tok/s':>9} {'vs best peer':>12} "
             f"{'mean batch':>10}"]
    for r in results:
        ratio = r["tokens_per_s"] / best_peer if best_peer else 0
        lines.append(f"{r['system']:22} {r['wall_s']:8.2f} {r['tokens']:8d} "
                     f"{r['tokens_per_s']:9.0f} {ratio:11.2f}x {r.get('mean_batch') or 0:10.1f}")
    print("\n".join(lines))
    (out / "decode_job.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "rows": args.rows, "max_tokens": args.max_tokens,
        "model": args.model, "flags": args.flags, "results": results, "table": lines},
        indent=2))


if __name__ == "__main__":
    main()
