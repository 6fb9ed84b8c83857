#!/bin/bash
# The H200 measurements issues 13 and 14 still need, in one device call (set-up line:
# shared/gpu/README.md; /tmp/l1b built first): the greedy-token check of the decode kernel's
# grouped layout, then one interleaved run of the whole decode job against its peers at their
# best batch sizes, then traced labeling jobs (cold and warm cache, after a throwaway job that
# meets the shapes first). Everything lands under $OUT as one archive.
OUT=${OUT:-/tmp/out}
python3 scripts/check_decode_kernel.py $OUT/kernel > $OUT/kernel.log 2>&1
echo "kernel check exit $?"; grep -v '^{' $OUT/kernel.log | tail -3; grep rows_differing $OUT/kernel.log
# A throwaway job first: a machine's first process compiles MLX's kernels (BENCHMARKS.md).
python3 scripts/bench_decode_job.py $OUT/job --model /tmp/l1b --rows 1024 \
    --concurrency 512,1024 --systems batchrun,batchrun,batch_generate,batchrun > $OUT/job.log 2>&1
tail -6 $OUT/job.log
python3 scripts/bench_gpu.py $OUT/peers --systems batch_generate,hf --concurrency 1024 \
    > $OUT/peers.log 2>&1
grep '^{' $OUT/peers.log | cut -c1-160
python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from bench_labeling import write_rows; write_rows(Path('$OUT/lrows.jsonl'), 512, 1000)"
for t in throwaway cold warm; do
    [ $t = throwaway ] && C=$OUT/cache0 || C=$OUT/cache1
    python3 scripts/trace_job.py run $OUT/lrows.jsonl --quiet --max-tokens 8 --model /tmp/l1b \
        --job-dir $OUT/label-$t --cache-dir $C 2> $OUT/label-trace-$t.txt
    python3 -c "import json; r = json.load(open('$OUT/label-$t/report.json'))['runs'][-1]
print('labeling $t: job wall', r['wall_s'], 's')"
done
rm -rf $OUT/job/rows.jsonl $OUT/job/job-*/results.jsonl $OUT/cache0 $OUT/cache1 \
    $OUT/label-*/results.jsonl $OUT/lrows.jsonl
tar czf $OUT/all.tgz -C $OUT --exclude=all.tgz .
find $OUT -mindepth 1 -not -name all.tgz -delete
