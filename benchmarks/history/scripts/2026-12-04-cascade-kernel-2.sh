#!/bin/bash
# Session 12's second H200 call: issue 13's "default flags reach 90% of the best flags" on the
# GPU, for labeling (512 rows, ~1.5k-token instruction, 8 new tokens, warm prefix cache) and
# for the decode job (1,024 rows x ~128 -> 256 tokens, no prefix cache); each flag set a fresh
# `batchrun run`, two rounds. Results: $OUT/keep.tgz (sweep.json each) and the printed tables.
OUT=${OUT:-/tmp/out}
W=/tmp/work2; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
python3 scripts/sweep_flags.py $W/label --model /tmp/l1b --rows 512 --instruction 1000 \
    --max-tokens 8 --reps 2 --flags "" "--max-concurrency 256" "--max-concurrency 2048" \
    "--prefill-batch-size 64" "--prefill-batch-size 128" "--prefill-batch-size 512" \
    "--prefill-batch-size 256 --max-concurrency 1024" 2>&1 | grep -v "^report\|^rows\|^tokens\|^throughput\|^results"
cp $W/label/sweep.json $W/keep/sweep-labeling.json
python3 scripts/sweep_flags.py $W/decode --workload decode --model /tmp/l1b --rows 1024 \
    --max-tokens 256 --reps 2 --flags "" "--max-concurrency 512" "--max-concurrency 2048" \
    "--prefill-batch-size 64" "--prefill-batch-size 256" \
    "--prefill-batch-size 256 --max-concurrency 1024" 2>&1 | grep -v "^report\|^rows\|^tokens\|^throughput\|^results"
cp $W/decode/sweep.json $W/keep/sweep-decode.json
pack
