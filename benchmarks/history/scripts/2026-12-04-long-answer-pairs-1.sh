#!/bin/bash
# Written in session 16 for the next session's first H200 call (set-up line:
# shared/gpu/README.md; /tmp/l1b built first; not run yet):
# 1. With the stand-in warming up kernels beside the model's loading, is the engine's own
#    two-row warm-up still worth its ~0.3 s? Warm 512-row jobs, default against
#    TRACE_NO_WARM_UP=1, four interleaved pairs after a throwaway.
# 2. The decode job with --no-shared-prefix, whose rows now keep the ranged decode kernel
#    (session 16's round B: 13.7-14.1 s against 4.4-5.1 s before the change).
# Results: $OUT/keep.tgz, $OUT/decode/decode_job.json and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work1; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
ab 4 rows512 c0 warmup - nowarmup TRACE_NO_WARM_UP=1
for name in nowarmup-1 nowarmup-2; do
    echo "$name:"; grep "rows built\|Feeder.take [1-9]\|prompt 510\|prompt 512" \
        $W/keep/label-trace-$name.txt | head -5
done
pack
python3 scripts/bench_decode_job.py $W/decode --model /tmp/l1b --rows 1024 \
    --systems batchrun,batchrun,noshared,batchrun,noshared | tail -7
mkdir -p $OUT/decode && cp $W/decode/decode_job.json $OUT/decode/
