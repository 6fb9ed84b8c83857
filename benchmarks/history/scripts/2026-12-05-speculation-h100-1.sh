#!/bin/bash
# Issue 18 on the device with the committed demo pair: gpu_session24.sh (the session-22 call,
# whose extract workload now runs 12 n-gram guesses too), profiling extraction with 6 and 12
# n-gram guesses and essays with the draft's 6. Set-up line: shared/gpu/README.md.
PROFILES="extract ngram 6;extract ngram 12;long draft 6" bash scripts/gpu_session24.sh
