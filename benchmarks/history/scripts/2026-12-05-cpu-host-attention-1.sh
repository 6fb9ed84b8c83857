#!/bin/bash
# The next H200 call for issue 18 (set-up line: shared/gpu/README.md), on the committed demo
# pair, most needed first (the call may be cut short): the essays (8 x 256, target a) and
# extract (target b) workloads 5 times after a throwaway; then the tail (c) and full (d)
# workloads 15 times each.
# Results: $OUT/spec/speculate.json, $OUT/tail/speculate.json and the printed tables.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads essays > /dev/null
python3 scripts/bench_speculate.py $OUT/spec --reps 5 --workloads essays,extract 2>&1 | tail -12
python3 scripts/bench_speculate.py $OUT/tail --workloads tail:15,full:15 2>&1 | tail -5
