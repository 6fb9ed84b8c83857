#!/bin/bash
# Session 15's fifth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): warm
# 512-row labeling jobs with the stand-in warm-up beside the model's loading (session 14's
# d804047, restored) and an idle take that lingers while rows keep coming, against the same
# tree with BATCHRUN_STAND_IN_WARM_UP=0, five interleaved pairs after a throwaway of each.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work5; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
label throwaway-off rows512 c1 BATCHRUN_STAND_IN_WARM_UP=0
for i in 1 2 3 4 5; do
    label standin-$i rows512 c1
    label off-$i rows512 c1 BATCHRUN_STAND_IN_WARM_UP=0
done
for name in standin-1 off-1 standin-2 off-2 standin-3; do
    echo "$name:"; grep "_load_model\|Engine.warm_up\|rows built\|Feeder.take [1-9]" \
        $W/keep/label-trace-$name.txt | head -6
done
pack
