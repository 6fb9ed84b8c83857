#!/bin/bash
# The second H200 call of session 10 (set-up line: shared/gpu/README.md; /tmp/l1b built first):
# - the greedy-token check of the decode kernel, each layout against MLX's masked attention,
#   with where and how closely each differing row's tokens parted;
# - labeling jobs (512 rows, ~1.5k-token instruction, 8 tokens), cold and warm cache, with
#   and without the engine's warm-up, twice each, after a throwaway job that meets the shapes
#   first; then 4,096 rows on a warm cache (the rate once a process's first-use costs are paid).
# Everything lands under $OUT as one archive.
OUT=${OUT:-/tmp/out}
python3 scripts/check_decode_kernel.py $OUT/kernel --greedy-only > $OUT/kernel.log 2>&1
echo "kernel check exit $?"; grep '^{' $OUT/kernel.log | cut -c1-600
python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from bench_labeling import write_rows
write_rows(Path('$OUT/rows512.jsonl'), 512, 1000); write_rows(Path('$OUT/rows4096.jsonl'), 4096, 1000)"
label() {  # name rows cache [env]
    env $4 python3 scripts/trace_job.py run $OUT/$2.jsonl --quiet --max-tokens 8 --model /tmp/l1b \
        --job-dir $OUT/label-$1 --cache-dir $OUT/$3 2> $OUT/label-trace-$1.txt
    python3 -c "import json; r = json.load(open('$OUT/label-$1/report.json'))['runs'][-1]
print('labeling $1: job wall', r['wall_s'], 's,', round(r['rows_done'] / r['wall_s']), 'rows/s,',
      'peak', round(r['peak_memory_bytes'] / 2**30, 2), 'GiB')"
    grep "rows built" $OUT/label-trace-$1.txt
}
label throwaway rows512 cache0
for rep in 1 2; do
    label cold-warmup-$rep rows512 cw$rep
    label warm-warmup-$rep rows512 cw$rep
    label cold-nowarmup-$rep rows512 cn$rep TRACE_NO_WARM_UP=1
    label warm-nowarmup-$rep rows512 cn$rep TRACE_NO_WARM_UP=1
done
label big-warm rows4096 cw1
rm -rf $OUT/cache0 $OUT/cw* $OUT/cn* $OUT/label-*/results.jsonl $OUT/rows*.jsonl
tar czf $OUT/all.tgz -C $OUT --exclude=all.tgz .
find $OUT -mindepth 1 -not -name all.tgz -delete
