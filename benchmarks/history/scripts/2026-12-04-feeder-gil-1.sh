#!/bin/bash
# Session 15's first H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): warm
# 512-row labeling jobs with this tree (rows tokenized by the Rust tokenizer's single-text
# encode, chunks between the feeder's threads, the prompt digest hashed holding the GIL)
# against commit bbcd92d's batchrun/ (in old/, with this trace_job.py), five interleaved pairs.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work1; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
TRACE=old/scripts/trace_job.py label throwaway-old rows512 c1
for i in 1 2 3 4 5; do
    TRACE=old/scripts/trace_job.py label old-$i rows512 c1
    label new-$i rows512 c1
done
for name in old-1 new-1 old-2 new-2 old-3 new-3; do
    echo "$name:"; grep "Engine.warm_up\|rows built\|Feeder.take [1-9]" $W/keep/label-trace-$name.txt | head -4
done
label new-4096 rows4096 c1
TRACE=old/scripts/trace_job.py label old-4096 rows4096 c1
pack
