#!/bin/bash
# Session 13's fourth H200 call: batchrun's speculation tests (greedy tokens the same with and
# without speculation, on the float32 demo pair) on CUDA with MLX's TF32 matmuls (its default)
# and without (MLX_ENABLE_TF32=0); then two traced warm 512-row labeling jobs that time each
# block file's read and each block's arrays (trace_job.py). Needs pytest in /tmp/site.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work4; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
for tf32 in 1 0; do
    MLX_ENABLE_TF32=$tf32 python3 -m pytest -q -p no:cacheprovider tests/test_speculate.py \
        > $W/keep/test-speculate-tf32-$tf32.log 2>&1
    echo "speculation tests, TF32 $tf32:"; tail -3 $W/keep/test-speculate-tf32-$tf32.log
    grep "^FAILED" $W/keep/test-speculate-tf32-$tf32.log | head -5 | cut -c1-200
done
labeling_rows
label throwaway rows512 c1
for i in 1 2; do label blocks-$i rows512 c1; done
for i in 1 2; do
    echo "blocks-$i:"; grep "DiskCache.load_many\|DiskCache._decode\|from_blocks" \
        $W/keep/label-trace-blocks-$i.txt | awk '{n[$3]++; s[$3]+=$2} END {for (k in n) print k, n[k], s[k] " s"}'
    grep "DiskCache._read" $W/keep/label-trace-blocks-$i.txt | awk '{print $1, $2}' | sort -n | sed -n '1p;$p'
done
pack
