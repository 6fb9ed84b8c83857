#!/bin/bash
# Session 26: the draft's compiled forward (speculate.CompiledForward) against its uncompiled
# one (draft6u, draft8u), interleaved in one run of the essays workload (target a), 10 reps
# after a throwaway; then extract (b). Set-up line: shared/gpu/README.md.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads essays > /dev/null
python3 scripts/bench_speculate.py $OUT/essays10 --reps 10 --workloads essays 2>&1 | tail -8
python3 scripts/bench_speculate.py $OUT/extract5 --reps 5 --workloads extract 2>&1 | tail -7
