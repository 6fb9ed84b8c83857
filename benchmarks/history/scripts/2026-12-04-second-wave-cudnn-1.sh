#!/bin/bash
# Session 13's first H200 call: both attention kernels against their references after the
# last session's CPU-only changes (check_prefix_kernel.py --quick), then warm 512-row labeling
# jobs (traced), and one traced 4,096-row job to find where the second wave's join waits.
# Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work1; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
python3 scripts/check_prefix_kernel.py $W/kquick --quick > $W/keep/kernel-quick.log 2>&1
echo "kernel check exit $?"; grep -c '"ok": true' $W/keep/kernel-quick.log
grep '"ok": false\|refused": \["' $W/keep/kernel-quick.log | head -5 | cut -c1-400
grep -i 'warning' $W/keep/kernel-quick.log | head -3 | cut -c1-300
label throwaway rows512 c1
for i in 1 2 3; do label cascade-$i rows512 c1; done
label wave-1 rows4096 c1
label wave-2 rows4096 c1
pack
