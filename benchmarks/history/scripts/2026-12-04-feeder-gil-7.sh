#!/bin/bash
# Session 15's seventh H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first), on
# the device time left: with the take waiting for rows still being built, a fresh machine's
# cold 512-row labeling jobs after a throwaway: one admission each, no step compiling kernels.
# Results: $OUT/keep.tgz (packed after each job) and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work7; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
pack
for i in 1 2; do
    label cold-$i rows512 cold-$i
    grep "Feeder.take [1-9]\|Engine.warm_up" $W/keep/label-trace-cold-$i.txt | head -3
    pack
done
