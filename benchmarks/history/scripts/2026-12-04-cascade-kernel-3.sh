#!/bin/bash
# Session 12's third H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first), after
# a prefill's attention under one shared prefix became one kernel (prefix_attention's cascade
# kernel: no own-part scores, mask or merge in MLX ops):
# - both kernels against their references, and the cascade kernel's cost against the parts
#   path it replaced (check_prefix_kernel.py --quick);
# - labeling (512 rows, ~1.5k-token instruction, 8 new tokens; traced): a throwaway job, cold
#   twice, warm three times, 4,096 rows warm;
# - first use of each path (first_use_profile.py, plain first, as a job's warm-up goes);
# - the decode job of issue 14 (1,024 rows x 128 -> 256 tokens, default flags), twice;
# - greedy tokens on the 150m shape in bf16, kernels on and off, with the gaps where they part;
# - the whole-process labeling comparison side by side.
# Results: $OUT/keep.tgz and the printed summary.
OUT=${OUT:-/tmp/out}
W=/tmp/work3; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
python3 scripts/check_prefix_kernel.py $W/kquick --quick > $W/keep/kernel-quick.log 2>&1
echo "kernel check exit $?"; grep -c '"ok": true' $W/keep/kernel-quick.log
grep '"ok": false\|refused": \["' $W/keep/kernel-quick.log | head -5 | cut -c1-400
grep '"what": "prefill attention' $W/keep/kernel-quick.log | cut -c1-300
label throwaway rows512 c1
label cold-1 rows512 c2
label warm-1 rows512 c1
label warm-2 rows512 c2
label cold-2 rows512 c3
label warm-3 rows512 c1
label big-warm rows4096 c1
python3 scripts/first_use_profile.py --model /tmp/l1b --order plain | tee $W/keep/first-use-plain.jsonl
python3 scripts/bench_decode_job.py $W/decode --model /tmp/l1b --rows 1024 \
    --systems batchrun,batchrun 2>&1 | tail -4
cp $W/decode/*.json $W/keep/ 2>/dev/null
python3 scripts/check_prefix_kernel.py $W/kernel > $W/keep/kernel.log 2>&1
echo "kernel check (with greedy) exit $?"; grep '"greedy"\|rows_differing' $W/keep/kernel.log | cut -c1-700
pack
python3 scripts/bench_labeling.py $W/whole --model /tmp/l1b --rows 512 --instruction 1000 \
    --max-tokens 8 --concurrency 512 --systems batchrun,peer,batch_generate 2>&1 | tail -12
cp $W/whole/*.json $W/keep/ 2>/dev/null
pack
