#!/bin/bash
# Session 15's third H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): warm
# 512-row labeling jobs with this tree (the second call's, and block keys reused from the last
# row's) with its default build threads (8 on 16 cores) and with 2 (TRACE_BUILD_WORKERS=2),
# against commit bbcd92d's batchrun/ (in old/, with this trace_job.py), five interleaved
# triples; then speculation's full and tail workloads (issue 18) after the per-row checks left
# the full batch's step. Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work3; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
TRACE=old/scripts/trace_job.py label throwaway-old rows512 c1
for i in 1 2 3 4 5; do
    TRACE=old/scripts/trace_job.py label old-$i rows512 c1
    label new-$i rows512 c1
    label w2-$i rows512 c1 TRACE_BUILD_WORKERS=2
done
for name in old-1 new-1 w2-1 old-2 new-2 w2-2; do
    echo "$name:"; grep "Engine.warm_up\|rows built\|Feeder.take [1-9]" $W/keep/label-trace-$name.txt | head -4
done
python3 scripts/bench_speculate.py $W/spec --reps 3 --workloads tail,full > $W/keep/speculate.log 2>&1
tail -8 $W/keep/speculate.log
cp $W/spec/*.json $W/keep/ 2>/dev/null
pack
