#!/bin/bash
# Session 12's fifth H200 call: the first shared-prefix forward's first attention call, taken
# apart (first_use_profile.py --watch now also times serves_cascade, the kernels' check and
# launches, each after its inputs were evaluated), after a throwaway job filled MLX's kernel
# cache on disk. Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work5; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
python3 scripts/first_use_profile.py --model /tmp/l1b --order plain --watch | tee $W/keep/first-use-watch2.jsonl | grep -v '"call": 2\|layer[1-9]'
python3 scripts/first_use_profile.py --model /tmp/l1b --order cascade --watch | tee $W/keep/first-use-watch3.jsonl | grep -v '"call": 2\|layer[1-9]'
pack
