#!/bin/bash
# Session 15's sixth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): cold
# 512-row labeling jobs (an empty cache folder each: the instruction computed, its 27 blocks
# stored and written) with this tree (blocks fetched from the device in one transfer, files made
# on the writer thread; the stand-in warm-up) against commit bbcd92d's batchrun/ (in old/, with
# this trace_job.py), two interleaved pairs after a throwaway of each. Results: $OUT/keep.tgz
# and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work6; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
TRACE=old/scripts/trace_job.py label throwaway-old rows512 c00
for i in 1 2; do
    TRACE=old/scripts/trace_job.py label cold-old-$i rows512 cold-old-$i
    label cold-new-$i rows512 cold-new-$i
done
for name in cold-old-1 cold-new-1 cold-old-2 cold-new-2; do
    echo "$name:"; grep "compute_prefix\|from_blocks\|Engine.warm_up" $W/keep/label-trace-$name.txt | head -4
done
pack
