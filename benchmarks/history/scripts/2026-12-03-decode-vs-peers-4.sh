#!/bin/bash
# Session 10's fourth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): the
# labeling jobs of gpu_session10b.sh after the job loop stopped hashing whole prompts (a throwaway
# job, then cold and warm 512-row jobs and a warm 4,096-row job, traced).
OUT=${OUT:-/tmp/out}
python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from bench_labeling import write_rows
write_rows(Path('$OUT/rows512.jsonl'), 512, 1000); write_rows(Path('$OUT/rows4096.jsonl'), 4096, 1000)"
label() {  # name rows cache
    python3 scripts/trace_job.py run $OUT/$2.jsonl --quiet --max-tokens 8 --model /tmp/l1b \
        --job-dir $OUT/label-$1 --cache-dir $OUT/$3 2> $OUT/label-trace-$1.txt
    python3 -c "import json; r = json.load(open('$OUT/label-$1/report.json'))['runs'][-1]
print('labeling $1: job wall', r['wall_s'], 's,', round(r['rows_done'] / r['wall_s']), 'rows/s,',
      'peak', round(r['peak_memory_bytes'] / 2**30, 2), 'GiB')"
}
label throwaway rows512 cache0
label cold rows512 c1
label warm rows512 c1
label big-warm rows4096 c1
label big-warm2 rows4096 c1
rm -rf $OUT/cache0 $OUT/c1 $OUT/label-*/results.jsonl $OUT/rows*.jsonl
tar czf $OUT/all.tgz -C $OUT --exclude=all.tgz .
find $OUT -mindepth 1 -not -name all.tgz -delete
