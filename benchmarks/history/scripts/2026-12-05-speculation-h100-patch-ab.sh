#!/bin/bash
# A change's speculation figures against the code before it, on one device in one call
# (issue 18): PATCH (a diff of batchrun/, e.g. `git diff A B -- batchrun`) is taken back out
# of a copy of this tree, and bench_speculate.py's essays and extract workloads (5 reps each)
# run in the copy and here in turn, twice, after a throwaway run. Set-up line:
# shared/gpu/README.md.
#   bash scripts/gpu_ab.sh PATCH
# Results: $OUT/{before,after}-{1,2}/speculate.json and the printed tables.
set -e
OUT=${OUT:-/tmp/out}
PATCH=$(realpath "$1")
HERE=$PWD
rm -rf /tmp/before && mkdir /tmp/before
cp -r batchrun scripts sample_data pyproject.toml /tmp/before/
(cd /tmp/before && patch -s -R -p1 < "$PATCH")
python3 scripts/bench_speculate.py /tmp/throwaway --reps 1 --workloads essays > /dev/null
for i in 1 2; do
  echo "== before, run $i"
  (cd /tmp/before && python3 scripts/bench_speculate.py $OUT/before-$i --reps 5 \
     --workloads essays,extract 2>&1 | tail -12)
  echo "== after, run $i"
  (cd "$HERE" && python3 scripts/bench_speculate.py $OUT/after-$i --reps 5 \
     --workloads essays,extract 2>&1 | tail -12)
done
