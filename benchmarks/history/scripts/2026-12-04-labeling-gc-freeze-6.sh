#!/bin/bash
# (BATCHRUN_STAND_IN_WARM_UP: commit d804047, backed out in the next commit but one.)
# Session 14's sixth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): the
# feeder's build threads (8 on this 16-core host, against 2) with the stand-in warm-up on and
# off, warm 512-row labeling jobs, two interleaved rounds. Results: $OUT/keep.tgz and the
# printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work6; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
for i in 1 2; do
    label w8-standin-$i rows512 c1
    label w2-standin-$i rows512 c1 TRACE_BUILD_WORKERS=2
    label w8-off-$i rows512 c1 BATCHRUN_STAND_IN_WARM_UP=0
    label w2-off-$i rows512 c1 TRACE_BUILD_WORKERS=2 BATCHRUN_STAND_IN_WARM_UP=0
done
for f in $W/keep/label-trace-w*.txt; do
    echo "$(basename $f): $(grep 'rows built' $f | cut -c30-) $(grep -c 'Feeder.take [1-9]' $f) takes, $(grep 'Engine.warm_up' $f)"
done
pack
