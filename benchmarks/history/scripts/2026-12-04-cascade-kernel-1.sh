#!/bin/bash
# Session 12's first H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first):
# where a process's first use goes, before changing anything:
# - a throwaway labeling job (fills MLX's compiled-kernel cache on disk, as a warm job has);
# - first_use_profile.py in three orders (cascade path first, plain first, op by op);
# - warm labeling jobs, interleaved, with CUDA's default lazy module loading and with EAGER;
# - the prefix kernel's greedy check on the 150m shape in bf16, with the logit gaps where the
#   two paths part.
# Results: $OUT/keep.tgz and the printed summary.
OUT=${OUT:-/tmp/out}
W=/tmp/work; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
for order in cascade plain ops; do
    echo "== first use, $order first"
    python3 scripts/first_use_profile.py --model /tmp/l1b --order $order | tee $W/keep/first-use-$order.jsonl
done
for i in 1 2; do
    label warm-lazy-$i rows512 c1
    label warm-eager-$i rows512 c1 CUDA_MODULE_LOADING=EAGER
done
python3 scripts/check_prefix_kernel.py $W/kernel > $W/keep/kernel.log 2>&1
echo "kernel check exit $?"; grep '"greedy"\|rows_differing' $W/keep/kernel.log | cut -c1-900
cp $W/kernel/prefix_kernel.json $W/keep/ 2>/dev/null
pack
