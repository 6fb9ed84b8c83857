#!/bin/bash
# Session 11's last H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first), on the
# committed engine (prefix kernel, layer-by-layer wide prefills, kernels compiled ahead, the
# warm-up's two plain rows only):
# - labeling (512 rows, ~1.5k-token instruction, 8 new tokens; traced): a throwaway job, then
#   cold and warm twice each, and 4,096 rows warm;
# - the decode job of issue 14 (1,024 rows x 128 -> 256 tokens, default flags), twice;
# - the whole-process labeling comparison side by side: batchrun cold and warm, the careful
#   mlx-lm user (prefix prefilled once), plain batch_generate.
# Results: $OUT/traces.tgz (traces, reports, the benchmarks' JSON) and the printed summary.
OUT=${OUT:-/tmp/out}
W=/tmp/work; mkdir -p $W/keep
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
label big-warm rows4096 c1
python3 scripts/bench_decode_job.py $W/decode --model /tmp/l1b --rows 1024 \
    --systems batchrun,batchrun 2>&1 | tail -3
cp $W/decode/decode_job.json $W/keep/
python3 scripts/bench_labeling.py $W/whole --model /tmp/l1b --rows 512 --instruction 1000 \
    --max-tokens 8 --concurrency 512 --systems batchrun,peer,batch_generate 2>&1 | tail -6
cp $W/whole/labeling.json $W/keep/
tar czf $OUT/traces.tgz -C $W/keep .
ls -la $OUT
