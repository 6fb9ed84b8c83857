#!/bin/bash
# (BATCHRUN_STAND_IN_WARM_UP: commit d804047, backed out in the next commit but one.)
# Session 14's fifth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): warm
# 512-row labeling jobs with the stand-in warm-up beside the model's loading (the default)
# against BATCHRUN_STAND_IN_WARM_UP=0, four interleaved pairs, traced; the probe's figures
# from gpu_session14d.sh are in round D. Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work5; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
label throwaway-off rows512 c1 BATCHRUN_STAND_IN_WARM_UP=0
for i in 1 2 3 4; do
    label standin-$i rows512 c1
    label off-$i rows512 c1 BATCHRUN_STAND_IN_WARM_UP=0
done
for name in standin-1 off-1 standin-2 off-2; do
    echo "$name:"; grep "_load_model\|Engine.warm_up\|rows built\|JobRunner.run" \
        $W/keep/label-trace-$name.txt
done
pack
