#!/bin/bash
# Session 17's second H200 call (set-up line: shared/gpu/README.md): issue 18's speculation
# workloads on the retrained demo pair (essays and reference rows among its lessons), all in
# one run: tail and full 15 times (jobs of 0.1-0.4 s), few, long (8 essays x 256 tokens) and
# extract 5 times, after a throwaway run. Round D ran it on the fourth try of the session's
# pair, when `long` was the essays without min_tokens (now the `essays` workload).
# Results: $OUT/spec/speculate.json and the printed table.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads few,tail > /dev/null
python3 scripts/bench_speculate.py $OUT/spec --reps 5 \
    --workloads tail:15,full:15,few,long,extract 2>&1 | tail -22
