#!/bin/bash
# Issue 14's H200 measurements in one device call (the set-up line: shared/gpu/README.md): the
# ranged decode kernel checked against its reference and timed a layer, then the decode
# workload (1,024 rows x 128 -> 256 tokens, 1B Llama shape) in one process with the kernel,
# without it, with default flags, and mlx-lm's batch_generate; with JOB_SYSTEMS (e.g.
# batchrun,nocudnn,masked,batch_generate) also as whole `batchrun run` jobs
# (bench_decode_job.py). /tmp/l1b must exist (python -m batchrun.models.build /tmp/l1b
# --shape llama-1b). Everything lands under $OUT (one archive).
OUT=${OUT:-/tmp/out}
python3 scripts/check_decode_kernel.py $OUT/kernel ${CHECK_FLAGS} > $OUT/kernel.log 2>&1
CHECK=$?; echo "kernel check exit $CHECK"; grep -v '^{' $OUT/kernel.log | tail -5; grep '_ms' $OUT/kernel.log
[ -n "$SKIP_BENCH" ] || [ $CHECK != 0 ] || python3 scripts/bench_gpu.py $OUT/bench --rows ${ROWS:-1024} \
    --concurrency ${CONCURRENCY:-1024} --repeat ${REPEAT:-1} \
    --systems ${SYSTEMS:-batchrun,batchrun_masked,batchrun_defaults,batch_generate} \
    > $OUT/bench.log 2>&1
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    if line.startswith('{'):
        r = json.loads(line)
        print(r.get('system'), r.get('concurrency'), 'tok/s', round(r.get('tokens_per_s', 0)),
              'wall', round(r.get('wall_s', 0), 2), 'mean batch', r.get('mean_batch'))
" $OUT/bench.log 2>/dev/null; tail -3 $OUT/bench.log
# The whole job: `batchrun run` with default flags (and variants) against batch_generate.
[ -z "$JOB_SYSTEMS" ] || [ $CHECK != 0 ] || python3 scripts/bench_decode_job.py $OUT/job \
    --model /tmp/l1b --rows ${ROWS:-1024} --concurrency ${JOB_CONCURRENCY:-256,1024} \
    --systems $JOB_SYSTEMS > $OUT/job.log 2>&1
[ -z "$JOB_SYSTEMS" ] || tail -8 $OUT/job.log
rm -f $OUT/job/rows.jsonl $OUT/job/job-*/results.jsonl
tar czf $OUT/all.tgz -C $OUT --exclude=all.tgz .
find $OUT -mindepth 1 -not -name all.tgz -delete
