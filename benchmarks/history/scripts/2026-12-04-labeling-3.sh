#!/bin/bash
# Session 16's third H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): warm
# 512-row labeling jobs, default against fewer feeder threads (1, 2) and against a shorter GIL
# switch interval (1 ms instead of 5), interleaved after a throwaway: does contention for the
# GIL between the job loop, the warm-up and the feeder's threads set a warm job's wall?
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work3; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
for i in 1 2 3 4; do
    label default-$i rows512 c0
    label w1-$i rows512 c0 TRACE_BUILD_WORKERS=1
    label w2-$i rows512 c0 TRACE_BUILD_WORKERS=2
    label switch-$i rows512 c0 TRACE_SWITCH_INTERVAL=0.001
done
medians 4 default w1 w2 switch
for name in default-2 w1-2 w2-2 switch-2; do
    echo "$name:"; grep "Engine.warm_up\|rows built\|Feeder.take [1-9]\|load_many 2\|prompt 510" \
        $W/keep/label-trace-$name.txt | head -6
done
pack
