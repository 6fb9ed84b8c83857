"""The H200 figure in BENCHMARKS.md, from bench_gpu.py's JSON outputs (needs matplotlib, not a
dependency of batchrun: `pip install matplotlib==3.11.2`).

    python scripts/plot_gpu.py benchmarks/2026-12-02-h200

Left: generated tokens/s per system and concurrency (mean of the interleaved repeats).
Right: where a decode step's time goes at 1,024 rows.
"""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

folder = Path(sys.argv[1])
runs = json.loads((folder / "gpu-lean-interleaved.json").read_text())["runs"]
steps = json.loads((folder / "gpu-step-breakdown.json").read_text())

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
systems = [("batchrun", "batchrun"), ("batch_generate", "mlx-lm batch_generate")]
width = 0.35
for i, (key, label) in enumerate(systems):
    for j, c in enumerate((256, 1024)):
        rate = statistics.mean(r["tokens_per_s"] for r in runs
                               if r["system"] == key and r.get("concurrency") == c)
        left.bar(j + (i - 0.5) * width, rate, width, color=f"C{i}",
                 label=label if j == 0 else None)
        left.text(j + (i - 0.5) * width, rate, f"{rate / 1000:.1f}k", ha="center", va="bottom")
hf = next(r for r in runs if r["system"] == "transformers")
left.bar(2, hf["tokens_per_s"], width, color="C2", label="transformers generate (PyTorch)")
left.text(2, hf["tokens_per_s"], f"{hf['tokens_per_s'] / 1000:.1f}k", ha="center", va="bottom")
left.set_xticks([0, 1, 2], ["256 rows at once", "1,024 rows at once", "batch 256"])
left.set_ylabel("generated tokens/s")
left.set_title("1,024 rows x 256 new tokens, llama-1b shape, bf16")
left.set_ylim(0, 1.3 * max(r["tokens_per_s"] for r in runs))
left.legend(loc="upper right", fontsize=8)

bare = steps["bare"][0]
engine = steps["engine_decode"][0]
whole = [r for r in runs if r["system"] == "batchrun" and r.get("concurrency") == 1024]
bars = [("model alone,\nno mask", bare["pipelined"]["step_ms"]),
        ("model alone,\nbatch cache + mask", bare["masked"]["step_ms"]),
        ("batchrun step,\n1,024 running", engine["generation_stream"]["step_ms"]),
        ("batchrun whole run,\nper step", statistics.mean(r["wall_s"] / r["steps"] * 1e3
                                                      for r in whole))]
right.bar(range(len(bars)), [ms for _, ms in bars], color=["C7", "C3", "C0", "C0"])
for k, (_, ms) in enumerate(bars):
    right.text(k, ms, f"{ms:.0f} ms", ha="center", va="bottom")
right.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
right.set_ylabel("ms per decode step")
right.set_title("Where a step goes at 1,024 rows")
fig.tight_layout()
out = folder / "throughput.svg"
fig.savefig(out, metadata={"Date": None})
print(out)
