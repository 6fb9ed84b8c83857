#!/bin/bash
# Session 11's fifth H200 call, at commit 6de0d4a (reverted after it; set-up line: shared/gpu/README.md; /tmp/l1b built first): the
# labeling jobs of gpu_session11d.sh after the engine's warm-up met cascade attention on a few
# zeros (shared_prefix.warm_up): a throwaway job, cold and warm twice each, 4,096 rows warm.
# Results: $OUT/traces.tgz and the printed summary.
OUT=${OUT:-/tmp/out}
W=/tmp/work; rm -rf $W; mkdir -p $W/keep
python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from bench_labeling import write_rows
write_rows(Path('$W/rows512.jsonl'), 512, 1000); write_rows(Path('$W/rows4096.jsonl'), 4096, 1000)"
label() {  # name rows cache
    python3 scripts/trace_job.py run $W/$2.jsonl --quiet --max-tokens 8 --model /tmp/l1b \
        --job-dir $W/label-$1 --cache-dir $W/$3 2> $W/keep/label-trace-$1.txt
    cp $W/label-$1/report.json $W/keep/label-report-$1.json
    python3 -c "import json; r = json.load(open('$W/label-$1/report.json'))['runs'][-1]
print('labeling $1: job wall', r['wall_s'], 's,', round(r['rows_done'] / r['wall_s']), 'rows/s,',
      'peak', round(r['peak_memory_bytes'] / 2**30, 2), 'GiB')"
    grep -i "warning" $W/keep/label-trace-$1.txt | head -2
}
label throwaway rows512 cache0
label cold-1 rows512 c1
label warm-1 rows512 c1
label cold-2 rows512 c2
label warm-2 rows512 c2
label warm-3 rows512 c2
label big-warm rows4096 c1
tar czf $OUT/traces.tgz -C $W/keep .
