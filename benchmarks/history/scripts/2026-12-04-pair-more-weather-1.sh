#!/bin/bash
# Session 19's H200 call (set-up line: shared/gpu/README.md): where an n-gram step's time goes
# on the GPU. The extraction and few workloads of bench_speculate.py on the pair in sample_data,
# 7 reps after a throwaway, then probe_spec_profile.py's forced n-gram steps on the extraction
# rows (8 guesses: per-step times and host profiles of plain and speculative runs).
# Results: $OUT/spec/speculate.json, $OUT/profile-extract-ngram8.txt and the printed tables.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads extract > /dev/null
python3 scripts/bench_speculate.py $OUT/spec --reps 7 --workloads extract,few 2>&1 | tail -11
python3 scripts/probe_spec_profile.py extract ngram 8 > $OUT/profile-extract-ngram8.txt 2>&1
head -4 $OUT/profile-extract-ngram8.txt
