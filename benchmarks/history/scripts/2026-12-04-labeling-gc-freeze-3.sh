#!/bin/bash
# Session 14's third H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): warm
# 512-row labeling jobs with this tree (the job loop's garbage collection frozen, cheaper
# per-row keys) against commit 7b56cb9's batchrun/ (in old/, with this trace_job.py), four
# interleaved pairs; then speculation on the trained demo pair after the switch's measures
# changed (bench_speculate.py: few, long, tail, full). Results: $OUT/keep.tgz and the printed
# lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work3; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
TRACE=old/scripts/trace_job.py label throwaway-old rows512 c1
for i in 1 2 3 4; do
    label new-$i rows512 c1
    TRACE=old/scripts/trace_job.py label old-$i rows512 c1
done
for name in old-1 new-1 old-2 new-2; do
    echo "$name:"; grep "garbage\|Engine.warm_up\|rows built" $W/keep/label-trace-$name.txt
done
python3 scripts/bench_speculate.py $W/spec --reps 3 --workloads few,long,tail,full \
    > $W/keep/speculate.log 2>&1
tail -16 $W/keep/speculate.log
cp $W/spec/*.json $W/keep/ 2>/dev/null
pack
