#!/bin/bash
# Issue 18 on the H200 with the committed (CPU-trained) demo pair, most needed first: the
# session-22 call (essays and extract 5 reps after a throwaway, then tail and full 15 reps
# each), then where a speculative step's time goes on this device (probe_spec_profile.py, one
# run for each of PROFILES, `;`-separated; by default extraction with 6 and 8 n-gram guesses,
# essays with the draft's 6). Set-up line: shared/gpu/README.md. Results under $OUT and the
# printed tables.
OUT=${OUT:-/tmp/out}
PROFILES=${PROFILES:-"extract ngram 6;extract ngram 8;long draft 6"}
bash scripts/gpu_session22.sh
mkdir -p $OUT/profile
IFS=';' read -ra runs <<< "$PROFILES"
for args in "${runs[@]}"; do
  f=$OUT/profile/$(echo $args | tr ' ' '-').txt
  python3 scripts/probe_spec_profile.py $args > $f 2>&1
  echo "== probe_spec_profile.py $args"; head -4 $f
done
