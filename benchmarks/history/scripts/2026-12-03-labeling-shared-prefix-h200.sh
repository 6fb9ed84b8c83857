#!/bin/bash
# Issue 13's H200 measurements in one device call (the set-up line: shared/gpu/README.md):
# a 1B Llama-shaped model, the in-process step profile, the whole-process labeling benchmark,
# a profiled `batchrun run`, and a decode-heavy check that rows without a shared prefix lose
# nothing. Everything lands under $OUT.
OUT=${OUT:-/tmp/out}
MODEL=/tmp/l1b
[ -f $MODEL/config.json ] || python3 -m batchrun.models.build $MODEL --shape llama-1b \
    > $OUT/build.log 2>&1
[ -n "$ONLY_WHOLE" ] || python3 scripts/profile_labeling.py $OUT/profile --model $MODEL --rows 512 --max-tokens 8 \
    --variants "${VARIANTS:-default,unbounded,step256}" --profile > $OUT/profile.log 2>&1
tail -5 $OUT/profile.log
python3 scripts/bench_labeling.py $OUT/whole --model $MODEL --rows 512 --instruction 1000 \
    --max-tokens 8 --concurrency 512 --systems ${WHOLE_SYSTEMS:-batchrun,peer} > $OUT/whole.log 2>&1
tail -8 $OUT/whole.log
[ -n "$ONLY_WHOLE" ] || python3 -m cProfile -o $OUT/run.prof -m batchrun run $OUT/whole/rows.jsonl --quiet \
    --max-tokens 8 --model $MODEL --job-dir $OUT/job-profiled \
    --cache-dir $OUT/whole/cache-batchrun > $OUT/run-profiled.log 2>&1
[ -n "$ONLY_WHOLE" ] || python3 -c "
import pstats, sys
s = pstats.Stats(sys.argv[1])
s.sort_stats('cumtime').print_stats('batchrun|mlx_lm', 90)
s.sort_stats('tottime').print_stats(40)" $OUT/run.prof > $OUT/run-profile.txt
rm -f $OUT/run.prof
# The row-building threads against the admitting thread (GIL): warm job wall by thread count.
for w in ${WORKERS_SWEEP}; do
    python3 -c "import sys, batchrun.job.runner as r; r.BUILD_WORKERS = $w
sys.argv = ['batchrun', 'run', '$OUT/whole/rows.jsonl', '--quiet', '--max-tokens', '8',
            '--model', '$MODEL', '--job-dir', '$OUT/job-workers-$w',
            '--cache-dir', '$OUT/whole/cache-batchrun']
from batchrun.cli import main; main()" > $OUT/workers-$w.log 2>&1
    python3 -c "import json; r = json.load(open('$OUT/job-workers-$w/report.json'))
print('build workers $w: job wall', r['wall_s'], 's, ttft p50', r['ttft_p50_s'])"
done
[ -n "$SKIP_DECODE" ] || python3 -m batchrun bench --model $MODEL --workload short --rows 512 --max-tokens 256 \
    --max-concurrency 512 --systems prefix,prefix_copies --json $OUT/decode.json \
    > $OUT/decode.log 2>&1
tail -8 $OUT/decode.log
# At most 8 files come back from a device call: everything small in one archive.
rm -rf $OUT/whole/cache-* $OUT/whole/job-*/results.jsonl $OUT/job-*/results.jsonl
tar czf $OUT/all.tgz -C $OUT --exclude=all.tgz --exclude='*.jsonl.out' --exclude=rows.jsonl .
find $OUT -mindepth 1 -not -name all.tgz -delete
