#!/usr/bin/env bash
# Issue 2's engine benchmark on this CPU: demo model and ~150M fp32 model, 64 rows x 64 new
# tokens, mixed-length (8-512 token, `mixed512`) and short (16-32 token) prompts; sequential mlx-lm vs
# batch_generate vs batchrun, in one process per model and workload.
set -euo pipefail
out=${1:-bench-out}
mkdir -p "$out"
for shape in demo 150m; do
  for workload in short mixed512; do
    batchrun bench --shape "$shape" --workload "$workload" --rows 64 --max-tokens 64 \
      --max-concurrency 64 --systems sequential,batch_generate,batchrun --json "$out/engine-$shape-$workload.json" | tee "$out/engine-$shape-$workload.txt"
  done
done
