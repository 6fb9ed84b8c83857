#!/bin/bash
# Session 16's second H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first):
# issue 13's "no regression elsewhere" (the decode job, 1,024 rows x 128 -> 256 tokens, with
# the shared attention's machinery and with --no-shared-prefix, interleaved after a throwaway),
# then the whole-process labeling comparison with the exit that skips the interpreter's
# teardown, and warm 512-row jobs again.
# Results: $OUT/keep.tgz, $OUT/decode/decode_job.json, $OUT/whole/labeling.json.
OUT=${OUT:-/tmp/out}
W=/tmp/work2; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
python3 scripts/bench_decode_job.py $W/decode --model /tmp/l1b --rows 1024 \
    --systems batchrun,batchrun,noshared,batchrun,noshared,batchrun,noshared | tail -9
mkdir -p $OUT/decode && cp $W/decode/decode_job.json $OUT/decode/
python3 scripts/bench_labeling.py $W/whole --model /tmp/l1b --rows 512 --instruction 1000 \
    --max-tokens 8 --concurrency 512 --systems batchrun,peer
mkdir -p $OUT/whole && cp $W/whole/labeling.json $OUT/whole/
for f in $W/whole/job-*/report.json; do cp $f $OUT/whole/$(basename $(dirname $f))-report.json; done
for i in 1 2 3 4; do label warm-$i rows512 c0; done
pack
