#!/bin/bash
# Session 16's fifth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first; old/
# holds commit 403e92f's batchrun/ and trace_job.py): the stand-in beside the model's loading
# now also compiles and checks batchrun's own attention kernels for the model's shape; warm
# 512-row labeling jobs against the tree without that, five interleaved pairs after a
# throwaway of each.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work5; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
TRACE=old/scripts/trace_job.py label throwaway-old rows512 c0
for i in 1 2 3 4 5; do
    label new-$i rows512 c0
    TRACE=old/scripts/trace_job.py label old-$i rows512 c0
done
medians 5 new old
for name in new-1 old-1 new-2 old-2; do
    echo "$name:"; grep "_load_model\|Engine.warm_up\|rows built\|Feeder.take [1-9]" \
        $W/keep/label-trace-$name.txt | head -5
done
pack
