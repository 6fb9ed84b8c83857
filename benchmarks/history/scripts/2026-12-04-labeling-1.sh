#!/bin/bash
# Session 16's first H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first):
# cold 512-row labeling jobs on a fresh machine after a throwaway (one admission each, no step
# compiling kernels?), warm jobs with the stand-in against without it, then the whole-process
# comparison with the hand-cached mlx-lm peer and plain batch_generate.
# Results: $OUT/keep.tgz, $OUT/whole/labeling.json and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work1; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c0
pack
for i in 1 2; do
    label cold-$i rows512 cold-$i
    grep "Feeder.take [1-9]" $W/keep/label-trace-cold-$i.txt | head -3
    pack
done
ab 3 rows512 c0 standin - off BATCHRUN_STAND_IN_WARM_UP=0
pack
python3 scripts/bench_labeling.py $W/whole --model /tmp/l1b --rows 512 --instruction 1000 \
    --max-tokens 8 --concurrency 512 --systems batchrun,peer,batch_generate
mkdir -p $OUT/whole && cp $W/whole/labeling.json $OUT/whole/
for f in $W/whole/job-*/report.json; do cp $f $OUT/whole/$(basename $(dirname $f))-report.json; done
