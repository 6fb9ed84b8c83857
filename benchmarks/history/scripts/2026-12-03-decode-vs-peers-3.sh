#!/bin/bash
# Session 10's third H200 call (set-up line: shared/gpu/README.md): issue 18's speculative
# decoding workloads on the trained demo pair (scripts/bench_speculate.py), where the tiny
# models' steps cost their kernel launches rather than their arithmetic.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py $OUT/speculate --reps 3 > $OUT/speculate.log 2>&1
echo "exit $?"; tail -14 $OUT/speculate.log
tar czf $OUT/all.tgz -C $OUT --exclude=all.tgz .
find $OUT -mindepth 1 -not -name all.tgz -delete
