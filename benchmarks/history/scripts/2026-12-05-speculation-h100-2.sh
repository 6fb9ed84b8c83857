#!/bin/bash
# Issue 18's four speculation targets on one device in one call, 15 reps each after a
# throwaway (this session's H100 spread 0.51-0.90 s between reps of plain essays, so 5 were
# too few): essays (8 x 256, target a) and extract (b), then tail (c) and full (d).
# Set-up line: shared/gpu/README.md. Results: $OUT/spec15, $OUT/tail15 and the printed tables.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads essays > /dev/null
python3 scripts/bench_speculate.py $OUT/spec15 --reps 15 --workloads essays,extract 2>&1 | tail -12
python3 scripts/bench_speculate.py $OUT/tail15 --workloads tail:15,full:15 2>&1 | tail -5
