#!/bin/bash
# Session 16's sixth H200 call (set-up line: shared/gpu/README.md): issue 18's speculation
# workloads with many repetitions, so that the tail's and the full batch's differences stand
# out of the noise of jobs of 0.1-0.4 s: tail and full 15 times, few and long 5 times.
# Results: $OUT/spec/speculate.json and the printed table.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py $OUT/spec-throwaway --reps 1 --workloads tail,full > /dev/null
python3 scripts/bench_speculate.py $OUT/spec --reps 15 --workloads tail,full 2>&1 | tail -12
python3 scripts/bench_speculate.py $OUT/spec-long --reps 5 --workloads few,long 2>&1 | tail -12
rm -rf $OUT/spec-throwaway
