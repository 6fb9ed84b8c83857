"""The README's labeling recipe with `smollm2` on 300 reviews, against mlx-lm's
`batch_generate` on the same converted model, side by side (BENCHMARKS.md, "A real small
model").

    python scripts/bench_smollm2.py OUT_DIR [--rows 300]

Rows: the sample data's 200 reviews, then more of the same kind (sample_data's generator) up
to --rows. Systems, each a fresh process:
- batchrun: `batchrun run` with the recipe (an answer prefix and --choices positive,negative);
- batch_generate, float32: mlx-lm on the converted folder widened to float32, as batchrun
  holds it on a CPU (mlx-lm's `dequantize_model`), the same chat prompts (the answer begun
  the same way), 2 new tokens (enough for the label word), prefill and completion batch
  sizes as given (mlx-lm's defaults 8 and 32 unless --peer-batch);
- batch_generate: the same on the model as it loads (4-bit), on the first --quantized-rows
  rows only (MLX's quantized matmuls are slow on a CPU).
Prints one JSON line a system: wall seconds (process), rows/s; batchrun's job wall too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You classify the sentiment of product reviews."
TEMPLATE = "Review: {text}\nIs this review positive or negative?"
PREFIX = "Sentiment: "

PEER = r"""
import json, sys, time
t0 = time.perf_counter()
import batchrun  # the same BLAS routing as batchrun gets
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate
folder, rows_path, widen, prefill, completion = sys.argv[1:6]
model, tok = load(folder)
if widen == "1":
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model
    model = dequantize_model(model)
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
rows = [json.loads(l) for l in open(rows_path)]
prompts = [tok.apply_chat_template(
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": TEMPLATE.format(text=r["text"])},
     {"role": "assistant", "content": PREFIX}], continue_final_message=True) for r in rows]
t1 = time.perf_counter()
out = batch_generate(model, tok, prompts, max_tokens=2, prefill_batch_size=int(prefill),
                     completion_batch_size=int(completion))
t2 = time.perf_counter()
texts = out.texts
print(json.dumps({"load_s": t1 - t0, "generate_s": t2 - t1, "answers": texts[:5]}))
"""


def write_rows(path: Path, count: int) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_labeling import review

    lines = (ROOT / "sample_data" / "reviews.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    out = [{"id": r["id"], "text": r["review"]} for r in rows][:count]
    rng = random.Random(7)
    while len(out) < count:
        _, text, _ = review(rng)
        out.append({"id": f"extra-{len(out)}", "text": text})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--peer-batch", default="8,32")
    parser.add_argument("--quantized-rows", type=int, default=30,
                        help="rows for batch_generate on the 4-bit model (slow on a CPU)")
    parser.add_argument("--skip-batchrun", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = args.out / "rows.jsonl"
    write_rows(rows, args.rows)
    batchrun = [sys.executable, "-m", "batchrun", "run", str(rows), "--model", "smollm2",
                "--system", SYSTEM, "--prompt-template", TEMPLATE, "--answer-prefix", PREFIX,
                "--choices", "positive,negative", "--job-dir", str(args.out / "job"),
                "--restart", "--quiet"]
    subprocess.run(batchrun[:4] + ["--dry-run"] + batchrun[4:], check=True,
                   capture_output=True)  # pulls and converts the model once, untimed
    if not args.skip_batchrun:
        t = time.perf_counter()
        subprocess.run(batchrun, check=True, capture_output=True)
        wall = time.perf_counter() - t
        run = json.loads((args.out / "job" / "report.json").read_text())["runs"][-1]
        print(json.dumps({"system": "batchrun", "rows": args.rows, "process_s": round(wall, 2),
                          "job_wall_s": run.get("wall_s"),
                          "rows_per_s": round(args.rows / wall, 2),
                          "mean_batch": run.get("mean_batch_size")}), flush=True)
    from batchrun.models import resolve

    folder = resolve("smollm2")
    prefill, completion = args.peer_batch.split(",")
    script = PEER.replace("SYSTEM", repr(SYSTEM)).replace("TEMPLATE", repr(TEMPLATE)) \
        .replace("PREFIX", repr(PREFIX))
    few = args.out / "rows-quantized.jsonl"
    few.write_text("".join(rows.read_text().splitlines(keepends=True)[:args.quantized_rows]))
    for widen, path, count in (("1", rows, args.rows), ("0", few, args.quantized_rows)):
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", script, folder, str(path), widen, prefill,
                               completion], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t
        if done.returncode != 0:
            sys.exit(f"batch_generate failed: {done.stderr[-2000:]}")
        inner = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps({"system": "batch_generate" + ("_float32" if widen == "1" else ""),
                          "rows": count, "process_s": round(wall, 2),
                          "generate_s": round(inner["generate_s"], 2),
                          "rows_per_s": round(count / wall, 2),
                          "answers": inner["answers"]}), flush=True)


if __name__ == "__main__":
    main()
