#!/bin/bash
# Session 18's first H200 A/B (set-up line: shared/gpu/README.md): bench_speculate.py's few,
# tail and full workloads with the engine before the pipelined speculative step (BASE: a folder
# holding 8b9e723's batchrun/engine/batch.py and speculate.py, made on this side with
#   git show 8b9e723:batchrun/engine/batch.py > BASE/batch.py  (and speculate.py)
# and carried in the tree) and after it, in alternating processes, then the step times of
# scripts/probe_spec_profile.py few draft 6. Results: $OUT/{before,after}{1,2}/speculate.json.
OUT=${OUT:-/tmp/out}
BASE=${BASE:-scratch/base}
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r batchrun scripts sample_data /tmp/base/
cp $BASE/batch.py $BASE/speculate.py /tmp/base/batchrun/engine/
W=${WORKLOADS:-few,tail:9,full:9}
(cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base python3 scripts/bench_speculate.py /tmp/throw \
    --reps 1 --workloads few > /dev/null 2>&1)
for r in 1 2; do
  (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base python3 scripts/bench_speculate.py \
      $OUT/before$r --reps ${REPS:-3} --workloads $W 2>&1 | tail -14 | sed "s/^/before$r /")
  python3 scripts/bench_speculate.py $OUT/after$r --reps ${REPS:-3} --workloads $W 2>&1 \
      | tail -14 | sed "s/^/after$r /"
done
[ -z "$NO_PROFILE" ] && python3 scripts/probe_spec_profile.py few draft 6 2>&1 | head -4
