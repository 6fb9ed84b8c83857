#!/bin/bash
# Session 11's H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first):
# - the shared-prefix attention kernel (prefix_attention.py) against its reference, and its cost
#   against the MLX ops it replaced (scripts/check_prefix_kernel.py --quick);
# - labeling jobs (512 rows, ~1.5k-token instruction, 8 new tokens; traced), after a throwaway job
#   that meets the shapes first: cold and warm twice with the kernel, once without it
#   (BATCHRUN_PREFIX_KERNEL=0); then 4,096 rows on a warm cache.
# Everything lands under $OUT as one archive.
OUT=${OUT:-/tmp/out}
python3 scripts/check_prefix_kernel.py $OUT/kernel --quick > $OUT/kernel.log 2>&1
echo "kernel check exit $?"; grep '^{' $OUT/kernel.log | cut -c1-400
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
label cold-off rows512 c2 BATCHRUN_PREFIX_KERNEL=0
label warm-off rows512 c2 BATCHRUN_PREFIX_KERNEL=0
label cold-2 rows512 c3
label warm-2 rows512 c3
label big-warm rows4096 c1
rm -rf $OUT/cache0 $OUT/c1 $OUT/c2 $OUT/c3 $OUT/label-*/results.jsonl $OUT/rows*.jsonl
tar czf $OUT/all.tgz -C $OUT --exclude=all.tgz .
find $OUT -mindepth 1 -not -name all.tgz -delete
