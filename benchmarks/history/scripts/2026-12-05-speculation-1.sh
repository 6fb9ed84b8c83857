#!/bin/bash
# Session 26: issue 18's four targets on one device in one call, with the draft's compiled
# forward (speculate.CompiledForward) beside its uncompiled one (draft6u, draft8u, interleaved
# in the essays workload: target a), 15 reps each after a throwaway. Set-up line:
# shared/gpu/README.md. Results: $OUT/spec15, $OUT/tail15 and the printed tables.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads essays > /dev/null
python3 scripts/bench_speculate.py $OUT/spec15 --reps 15 --workloads essays,extract 2>&1 | tail -14
python3 scripts/bench_speculate.py $OUT/tail15 --workloads tail:15,full:15 2>&1 | tail -5
