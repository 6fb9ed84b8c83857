#!/bin/bash
# Session 13's second H200 call: what MLX's cuDNN attention (MLX_CUDA_USE_CUDNN_SDPA, on by
# default in MLX 0.32) costs a process's first use and a job. A labeling job on a warm prefix
# cache never runs MLX's fused attention (cascade and decode kernels), yet its warm-up's plain
# prefill does. Interleaved: first_use_profile.py (plain first) with cuDNN on and off, warm
# 512-row labeling jobs with it on and off (3 each), and the 1,024-row decode job (no shared
# prefix: its prefills are MLX's fused attention) on and off.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work2; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
label throwaway-nocudnn rows512 c1 MLX_CUDA_USE_CUDNN_SDPA=0
for cudnn in 1 0; do
    MLX_CUDA_USE_CUDNN_SDPA=$cudnn python3 scripts/first_use_profile.py --model /tmp/l1b \
        --order plain > $W/keep/first-use-cudnn$cudnn.jsonl
    echo "cudnn $cudnn"; grep -v '"call:' $W/keep/first-use-cudnn$cudnn.jsonl
done
for i in 1 2 3; do
    label cudnn-$i rows512 c1
    label nocudnn-$i rows512 c1 MLX_CUDA_USE_CUDNN_SDPA=0
done
n=0
for cudnn in 1 0 1 0; do
    n=$((n + 1))
    MLX_CUDA_USE_CUDNN_SDPA=$cudnn python3 scripts/bench_decode_job.py $W/decode-$n \
        --model /tmp/l1b --rows 1024 --systems batchrun > $W/keep/decode-$n-cudnn$cudnn.log 2>&1
    echo "decode job $n, cudnn $cudnn:"; tail -3 $W/keep/decode-$n-cudnn$cudnn.log
    for f in $W/decode-$n/*.json; do cp $f $W/keep/decode-$n-cudnn$cudnn-$(basename $f); done
done
pack
