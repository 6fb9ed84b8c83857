#!/bin/bash
# Session 11's third H200 call, at commit 5fd9c61 (the engine's
# warm-up then also ran two rows under a shared prefix, text.TextBackend.warm_up, which this call's
# figures removed; TRACE_NO_BACKEND_WARM_UP skipped it). Set-up line: shared/gpu/README.md; /tmp/l1b
# built first. Where a
# labeling job's 1.5 s go now, and what the warm-up's rows under a shared prefix cost a decode job:
# - labeling (512 rows, ~1.5k-token instruction, 8 new tokens; traced): a throwaway job, then on
#   one warm cache: default, without the warm-up's shared-prefix rows, without any warm-up,
#   default again; and a cold job;
# - the decode job (1,024 rows x 128 -> 256 tokens, default flags, traced): default, and without
#   the warm-up's shared-prefix rows.
OUT=${OUT:-/tmp/out}
python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from bench_labeling import write_rows
write_rows(Path('/tmp/rows512.jsonl'), 512, 1000)"
label() {  # name cache [env]
    env $3 python3 scripts/trace_job.py run /tmp/rows512.jsonl --quiet --max-tokens 8 --model /tmp/l1b \
        --job-dir /tmp/label-$1 --cache-dir /tmp/$2 2> $OUT/label-trace-$1.txt
    cp /tmp/label-$1/report.json $OUT/label-report-$1.json
    python3 -c "import json; r = json.load(open('/tmp/label-$1/report.json'))['runs'][-1]
print('labeling $1: job wall', r['wall_s'], 's,', round(r['rows_done'] / r['wall_s']), 'rows/s,',
      'peak', round(r['peak_memory_bytes'] / 2**30, 2), 'GiB')"
}
label throwaway cache0
label cold c1
label warm-default c1
label warm-no-backend-warm-up c1 TRACE_NO_BACKEND_WARM_UP=1
label warm-no-warm-up c1 TRACE_NO_WARM_UP=1
label warm-default-2 c1
python3 scripts/bench_decode_job.py /tmp/decode --model /tmp/l1b --rows 1024 \
    --systems batchrun --trace 2>&1 | tail -2
TRACE_NO_BACKEND_WARM_UP=1 python3 scripts/bench_decode_job.py /tmp/decode2 --model /tmp/l1b \
    --rows 1024 --systems batchrun --trace 2>&1 | tail -2
for d in decode decode2; do
    cp /tmp/$d/decode_job.json $OUT/$d.json
    grep -v "Engine.step\|TextBackend.next\|prompt 0 rows\|Feeder.take 0" /tmp/$d/trace-*.txt | head -40 > $OUT/$d-trace-head.txt
done
ls -la $OUT
