#!/bin/bash
# Session 18's third H200 call (set-up line: shared/gpu/README.md): issue 18's speculation
# workloads on the pair in sample_data, all in one run after a throwaway: tail and full 15
# times (jobs of 0.1-0.5 s), few, essays (8 x 256) and extract 5 times.
# Results: $OUT/spec/speculate.json and the printed table.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads few,tail > /dev/null
python3 scripts/bench_speculate.py $OUT/spec --reps 5 \
    --workloads tail:15,full:15,few,essays,extract 2>&1 | tail -24
