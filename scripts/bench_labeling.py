"""Issue 13's whole-process labeling benchmark: rows under one long shared instruction.

    python scripts/bench_labeling.py OUT_DIR [--model PATH] [--rows 120] [--instruction 1900]
        [--max-tokens 4] [--systems batchrun,copies,masked,peer,batch_generate] [--flags "..."]

Every system is a fresh process timed from start to exit (imports and model load included), on
the same chat rows: a ~N-token system instruction (few-shot examples) + one review.
- batchrun: `batchrun run` cold (empty cache folder), then warm (a new job, same cache folder);
- copies: the same with --no-shared-prefix (each row holds a copy of the prefix's KV);
- nocache: the same with --no-prefix-cache (every row computes its whole prompt);
- masked: the same with BATCHRUN_DECODE_KERNEL=0 (decode steps through MLX's attention and
  mlx-lm's mask instead of the ranged decode kernel);
- peer: a careful mlx-lm user: the common prefix prefilled once, a copy of its KV cache given
  to every row, batch_generate over the rest;
- batch_generate: plain mlx-lm batch_generate.
Writes OUT_DIR/labeling.json and prints a table with ratios.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchrun.models.random_model import review  # noqa: E402  (no MLX import: cheap)

PEER = r'''
import copy, json, sys, time
import batchrun  # the same BLAS routing as batchrun gets
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate
from mlx_lm.models.cache import make_prompt_cache
model_path, rows_path, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
hand_cached = sys.argv[4] == "1"
model, tokenizer = load(model_path)
start = time.perf_counter()  # the job's work: everything after imports and loading the model
rows = [json.loads(line) for line in open(rows_path)]
prompts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in rows]
n = 0
if hand_cached:
    n = min(len(p) for p in prompts) - 1
    n = next((i for i in range(n) if any(p[i] != prompts[0][i] for p in prompts)), n)
cache = make_prompt_cache(model)
if n:
    model(mx.array(prompts[0][:n])[None], cache=cache)
    mx.eval([c.state for c in cache])
caches = [copy.deepcopy(cache) for _ in prompts] if n else None
out = batch_generate(model, tokenizer, [p[n:] for p in prompts], prompt_caches=caches,
                     max_tokens=max_tokens, completion_batch_size=CONCURRENCY,
                     return_token_ids=True)
with open(rows_path + ".out", "w") as f:
    for t in out.token_ids:
        f.write(json.dumps(t) + "\n")
with open(rows_path + ".peak", "w") as f:
    f.write(json.dumps({"peak": mx.get_peak_memory(), "work_s": time.perf_counter() - start}))
'''


def instruction(target_words: int) -> str:
    rng = random.Random(7)
    parts = ["You label product reviews with one word: positive, negative or neutral."]
    while sum(len(p.split()) for p in parts) < target_words:
        _, text, rating = review(rng)
        label = "positive" if rating >= 4 else "negative" if rating <= 2 else "neutral"
        parts.append(f"Review: {text} Label: {label}.")
    return " ".join(parts)


def write_rows(path: Path, rows: int, instruction_words: int) -> None:
    system = instruction(instruction_words)
    rng = random.Random(11)
    with open(path, "w") as f:
        for i in range(rows):
            _, text, _ = review(rng)
            f.write(json.dumps({"custom_id": f"r{i}", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Review: {text} Label:"}]}) + "\n")


def timed(cmd: list[str], cwd: Path, env: dict | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=str(ROOT / "sample_data" / "demo-model"))
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--instruction", type=int, default=1300, help="instruction length in words")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64, help="the peers' batch size")
    ap.add_argument("--systems", default="batchrun,copies,peer,batch_generate")
    ap.add_argument("--flags", default="", help="extra flags for batchrun run")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = out / "rows.jsonl"
    write_rows(rows, args.rows, args.instruction)
    python = sys.executable
    batchrun = [python, "-m", "batchrun", "run", str(rows), "--quiet", "--max-tokens",
                str(args.max_tokens), "--model", args.model, *args.flags.split()]
    peer = [python, "-c", PEER.replace("CONCURRENCY", str(args.concurrency)), args.model,
            str(rows), str(args.max_tokens)]
    results: dict[str, float] = {}
    details: dict[str, dict] = {}
    for system in args.systems.split(","):
        if system in ("batchrun", "copies", "masked", "nocache"):
            extra = {"copies": ["--no-shared-prefix"],
                     "nocache": ["--no-prefix-cache"]}.get(system, [])
            # masked: decode steps through MLX's attention and mlx-lm's mask, not the kernel
            env = {**os.environ, "BATCHRUN_DECODE_KERNEL": "0"} if system == "masked" else None
            cache = out / f"cache-{system}"
            shutil.rmtree(cache, ignore_errors=True)  # cold: an empty cache folder
            for run in ("cold", "warm"):
                job = out / f"job-{system}-{run}"
                name = f"batchrun run ({system}, {run})"
                results[name] = timed([*batchrun, *extra, "--job-dir", str(job),
                                       "--cache-dir", str(cache), "--restart"], out, env)
                report = json.loads((job / "report.json").read_text())
                last = report["runs"][-1]
                details[name] = {k: last[k] for k in ("peak_memory_bytes", "mean_batch_size",
                                                      "prefill_time_s", "decode_time_s",
                                                      "wall_s")}
                details[name]["cached_share"] = round(
                    report["cached_prompt_tokens"] / max(1, report["prompt_tokens"]), 3)
        elif system in ("peer", "batch_generate"):
            name = ("mlx-lm, prefix prefilled once (peer)" if system == "peer"
                    else "mlx-lm batch_generate")
            results[name] = timed([*peer, "1" if system == "peer" else "0"], out)
            peer_run = json.loads(Path(f"{rows}.peak").read_text())
            details[name] = {"peak_memory_bytes": peer_run["peak"], "wall_s": peer_run["work_s"]}
    peer_s = results.get("mlx-lm, prefix prefilled once (peer)")
    plain_s = results.get("mlx-lm batch_generate")
    peer_job = details.get("mlx-lm, prefix prefilled once (peer)", {}).get("wall_s")
    # wall s: the whole process; job s: after imports and the model's load (batchrun: the
    # report's wall, the peer: its own timer), and its ratio to the peer's.
    lines = [f"{'system':44} {'wall s':>8} {'rows/s':>8} {'vs peer':>8} {'vs plain':>9} "
             f"{'job s':>7} {'job vs peer':>11} {'peak GiB':>9} {'cached':>7}"]
    for name, wall in results.items():
        vs_peer = peer_s / wall if peer_s else 0
        vs_plain = plain_s / wall if plain_s else 0
        job = details.get(name, {}).get("wall_s", 0)
        job_vs_peer = peer_job / job if peer_job and job else 0
        peak = details.get(name, {}).get("peak_memory_bytes", 0) / 2**30
        cached = details.get(name, {}).get("cached_share")
        lines.append(f"{name:44} {wall:8.2f} {args.rows / wall:8.1f} {vs_peer:7.2f}x "
                     f"{vs_plain:8.2f}x {job:7.2f} {job_vs_peer:10.2f}x {peak:9.2f} "
                     f"{'' if cached is None else f'{cached:.0%}':>7}")
    print("\n".join(lines))
    (out / "labeling.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "rows": args.rows, "instruction_words":
        args.instruction, "max_tokens": args.max_tokens, "model": args.model,
        "flags": args.flags, "wall_s": results, "details": details,
        "table": lines}, indent=2))


if __name__ == "__main__":
    main()
