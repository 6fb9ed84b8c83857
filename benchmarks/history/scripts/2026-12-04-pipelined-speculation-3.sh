#!/bin/bash
# Session 18's third H200 call (set-up line: shared/gpu/README.md): issue 18's speculation
# workloads on the pair in sample_data (or PAIR), all in one run after a throwaway: tail and full 15
# times (jobs of 0.1-0.5 s), few, essays (8 x 256) and extract 5 times.
# PAIR=FOLDER: the pair in FOLDER/target and FOLDER/draft (--target, --draft) instead.
# Results: $OUT/spec/speculate.json and the printed table.
OUT=${OUT:-/tmp/out}
ARGS=${PAIR:+--target $PAIR/target --draft $PAIR/draft}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads few,tail $ARGS \
    > /dev/null
python3 scripts/bench_speculate.py $OUT/spec --reps 5 $ARGS \
    --workloads tail:15,full:15,few,essays,extract 2>&1 | tail -24
