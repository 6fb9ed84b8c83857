#!/bin/bash
# Session 11's second H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first), after
# the prefix kernel's prefills were evaluated layer by layer and the kernels compiled ahead:
# - labeling jobs (512 rows, ~1.5k-token instruction, 8 new tokens; traced, with the warm-up's
#   and the kernels' compile times): a throwaway job, cold and warm twice, 4,096 rows warm;
# - the decode job of issue 14 (1,024 rows x 128 -> 256 tokens, default flags), twice, traced:
#   rows without a shared prefix;
# - the whole-process labeling comparison, side by side: batchrun cold and warm, the careful
#   mlx-lm user (prefix prefilled once), plain batch_generate;
# - the prefix kernel's greedy-token check on the 150m shape in bfloat16.
# Everything lands under $OUT as one archive.
OUT=${OUT:-/tmp/out}
python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from bench_labeling import write_rows
write_rows(Path('$OUT/rows512.jsonl'), 512, 1000); write_rows(Path('$OUT/rows4096.jsonl'), 4096, 1000)"
label() {  # name rows cache [env]
    env $4 python3 scripts/trace_job.py run $OUT/$2.jsonl --quiet --max-tokens 8 --model /tmp/l1b \
        --job-dir $OUT/label-$1 --cache-dir $OUT/$3 2> $OUT/label-trace-$1.txt
    python3 -c "import json; r = json.load(open('$OUT/label-$1/report.json'))['runs'][-1]
print('labeling $1: job wall', r['wall_s'], 's,', round(r['rows_done'] / r['wall_s']), 'rows/s,',
      'peak', round(r['peak_memory_bytes'] / 2**30, 2), 'GiB')"
    grep -i "warning\|error" $OUT/label-trace-$1.txt | head -3
}
label throwaway rows512 cache0
label cold-1 rows512 c1
label warm-1 rows512 c1
label cold-2 rows512 c2
label warm-2 rows512 c2
label big-warm rows4096 c1
rm -rf $OUT/cache0 $OUT/c1 $OUT/c2 $OUT/label-*/results.jsonl $OUT/rows*.jsonl
python3 scripts/bench_decode_job.py $OUT/decode --model /tmp/l1b --rows 1024 \
    --systems batchrun,batchrun --trace 2>&1 | tail -6
python3 scripts/bench_labeling.py $OUT/whole --model /tmp/l1b --rows 512 --instruction 1000 \
    --max-tokens 8 --concurrency 512 --systems batchrun,peer,batch_generate 2>&1 | tail -12
python3 scripts/check_prefix_kernel.py $OUT/kernel > $OUT/kernel.log 2>&1
echo "kernel check exit $?"; grep '"greedy"\|rows_differing' $OUT/kernel.log | cut -c1-600
find $OUT -name "*.jsonl" -size +1M -delete
tar czf /tmp/all.tgz -C $OUT . && mv /tmp/all.tgz $OUT/
find $OUT -mindepth 1 -not -name all.tgz -delete
