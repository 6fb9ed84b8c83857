#!/bin/bash
# Session 18's second H200 call (set-up line: shared/gpu/README.md), with a retrained pair in
# sample_data/demo-trained and demo-draft (session 18's try 5, not committed): issue 18's
# 8 x 256 essays and extraction rows before and after the pipelined speculative step
# (gpu_session18a.sh's alternating processes, 5 reps each), then where a speculative step's
# time goes (probe_spec_profile.py: essays with the draft, extraction with n-grams).
OUT=${OUT:-/tmp/out}
NO_PROFILE=1 WORKLOADS=essays,extract REPS=5 OUT=$OUT bash scripts/gpu_session18a.sh 2>&1 | grep -v "^python3"
python3 scripts/probe_spec_profile.py long draft 6 2>&1 | head -4
python3 scripts/probe_spec_profile.py extract ngram 6 2>&1 | head -4
