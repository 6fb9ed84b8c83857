#!/bin/bash
# Session 16's fourth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): the
# feeder's one build thread, now the default, against eight (session 15's default on 16 cores),
# in warm 512-row jobs interleaved after a throwaway; then cold jobs and a warm 4,096-row job
# with the new default.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work4; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
ab 5 rows512 c0 one - eight TRACE_BUILD_WORKERS=8
pack
for i in 1 2; do label cold-$i rows512 cold-$i; done
label throwaway-4096 rows4096 c0
label warm-4096 rows4096 c0
pack
