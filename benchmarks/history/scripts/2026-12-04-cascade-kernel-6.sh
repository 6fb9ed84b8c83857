#!/bin/bash
# Session 12's sixth H200 call, after the cascade kernel reads a model's queries and writes its
# output in the (rows, L, heads, D) layout the projections give and take (no copy either way):
# both kernels against their references (check_prefix_kernel.py --quick), the first
# shared-prefix forward taken apart (first_use_profile.py --watch, after a throwaway job), and
# warm 512-row labeling jobs with and without the cascade kernel, interleaved.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work6; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
python3 scripts/check_prefix_kernel.py $W/kquick --quick > $W/keep/kernel-quick.log 2>&1
echo "kernel check exit $?"; grep -c '"ok": true' $W/keep/kernel-quick.log
grep '"ok": false\|refused": \["' $W/keep/kernel-quick.log | head -5 | cut -c1-400
grep '"what": "prefill attention' $W/keep/kernel-quick.log | cut -c1-300
label throwaway rows512 c1
python3 scripts/first_use_profile.py --model /tmp/l1b --order plain --watch > $W/keep/first-use-watch4.jsonl
grep 'cascade\|attention\|tail\|layer0"' $W/keep/first-use-watch4.jsonl
for i in 1 2; do
    label cascade-$i rows512 c1
    label parts-$i rows512 c1 BATCHRUN_CASCADE_KERNEL=0
done
pack
