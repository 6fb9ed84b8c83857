#!/bin/bash
# Session 16's seventh H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first), on
# the device time left: with the stand-in warming up kernels beside the model's loading, is the
# engine's own two-row warm-up still worth its ~0.3 s? Warm 512-row jobs, default against
# TRACE_NO_WARM_UP=1, four interleaved pairs after a throwaway.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work7; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
ab 4 rows512 c0 warmup - nowarmup TRACE_NO_WARM_UP=1
for name in nowarmup-1 nowarmup-2; do
    echo "$name:"; grep "rows built\|Feeder.take [1-9]\|prompt 510\|prompt 512" \
        $W/keep/label-trace-$name.txt | head -5
done
pack
