#!/bin/bash
# Session 19's H200 call (set-up line: shared/gpu/README.md): gpu_session18c.sh's speculation
# workloads on the pair in sample_data (or PAIR), then where a forced n-gram step's time goes on
# the extraction rows (probe_spec_profile.py, 8 guesses: per-step times and host profiles).
# Results: $OUT/spec/speculate.json, $OUT/profile-extract-ngram8.txt and the printed tables.
OUT=${OUT:-/tmp/out}
bash scripts/gpu_session18c.sh
python3 scripts/probe_spec_profile.py extract ngram 8 > $OUT/profile-extract-ngram8.txt 2>&1
head -4 $OUT/profile-extract-ngram8.txt
