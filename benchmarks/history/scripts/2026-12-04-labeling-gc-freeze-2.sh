#!/bin/bash
# Session 14's second H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): warm
# labeling jobs with this tree against the tree before the session's job-loop changes (a copy
# of commit 7b56cb9's batchrun/ in old/, with this trace_job.py), interleaved: 512 rows four
# times each, 4,096 rows once each. Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work2; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
TRACE=old/scripts/trace_job.py label throwaway-old rows512 c1
for i in 1 2 3 4; do
    TRACE=old/scripts/trace_job.py label old-$i rows512 c1
    label new-$i rows512 c1
done
TRACE=old/scripts/trace_job.py label old-4096 rows4096 c1
label new-4096 rows4096 c1
for name in old-1 new-1 old-2 new-2 old-4096 new-4096; do
    echo "$name:"; grep "garbage\|Engine.warm_up\|Feeder.take 512\|GenerationBatch.__init__ 51" \
        $W/keep/label-trace-$name.txt | head -6
done
pack
