#!/bin/bash
# Session 26: MLX's CUDA graph settings against a speculative step's host cost (issue 18). A
# speculative step of the demo pair is host-bound on the H100 (session 25's profiles: encoding
# the draft's and the verification's kernels); MLX's CUDA backend records each kernel into a
# CUDA graph, committed every MLX_MAX_OPS_PER_BUFFER (default 20) operations, cached by
# topology up to MLX_CUDA_GRAPH_CACHE_SIZE (default 100) graphs. The essays workload (target a)
# and the full batch (d), 5 reps each after a throwaway, under each setting in turn.
# Set-up line: shared/gpu/README.md. Results: $OUT/env-*/ and the printed tables.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads essays > /dev/null
for setting in default MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=100 \
    MLX_CUDA_GRAPH_CACHE_SIZE=2000; do
  echo "== $setting"
  if [ $setting = default ]; then e=""; else e=$setting; fi
  env $e python3 scripts/bench_speculate.py $OUT/env-${setting%%=*} --reps 5 \
    --workloads essays,full 2>&1 | tail -10
done
