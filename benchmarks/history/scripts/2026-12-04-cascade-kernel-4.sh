#!/bin/bash
# Session 12's fourth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first):
# - where the first shared-prefix forward's time goes, layer by layer and part by part
#   (first_use_profile.py --order plain --watch, after a throwaway job filled MLX's kernel
#   cache on disk);
# - warm 512-row labeling jobs with the cascade kernel and without it (BATCHRUN_CASCADE_KERNEL=0:
#   the prefix kernel and MLX's ops, as before this session), interleaved, three each.
# Results: $OUT/keep.tgz and the printed summary.
OUT=${OUT:-/tmp/out}
W=/tmp/work4; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
python3 scripts/first_use_profile.py --model /tmp/l1b --order plain --watch | tee $W/keep/first-use-watch.jsonl | grep -v '"call": 2'
for i in 1 2 3; do
    label cascade-$i rows512 c1
    label parts-$i rows512 c1 BATCHRUN_CASCADE_KERNEL=0
done
pack
