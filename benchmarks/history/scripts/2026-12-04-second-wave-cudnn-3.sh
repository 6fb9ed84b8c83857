#!/bin/bash
# Session 13's third H200 call: the committed default (MLX's own fused attention, cuDNN off)
# against MLX_CUDA_USE_CUDNN_SDPA=1 on the 1,024-row decode job, interleaved; then speculation
# on the trained demo pair with the one-layer draft and the measured switch's backoff
# (bench_speculate.py: few, long, tail, full).
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work3; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
python3 scripts/bench_decode_job.py $W/decode-0 --model /tmp/l1b --rows 1024 --systems batchrun \
    > $W/keep/decode-0-throwaway.log 2>&1
n=0
for cudnn in default 1 default 1; do
    n=$((n + 1))
    if [ $cudnn = default ]; then env=(); else env=(MLX_CUDA_USE_CUDNN_SDPA=1); fi
    env "${env[@]}" python3 scripts/bench_decode_job.py $W/decode-$n --model /tmp/l1b \
        --rows 1024 --systems batchrun > $W/keep/decode-$n-cudnn-$cudnn.log 2>&1
    echo "decode job $n, cudnn $cudnn:"; tail -1 $W/keep/decode-$n-cudnn-$cudnn.log
    for f in $W/decode-$n/*.json; do cp $f $W/keep/decode-$n-cudnn-$cudnn-$(basename $f); done
done
python3 scripts/bench_speculate.py $W/spec --reps 3 --workloads few,long,tail,full \
    > $W/keep/speculate.log 2>&1
tail -14 $W/keep/speculate.log
cp $W/spec/*.json $W/keep/ 2>/dev/null
pack
