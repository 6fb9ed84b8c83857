#!/bin/bash
# Session 21's second H200 call (set-up line: shared/gpu/README.md), on the committed long-answer
# pair, most needed first (the call may be cut short): issue 18's essays (8 x 256) and extract
# workloads 5 times after a throwaway; the tail and full workloads 15 times; then whether
# training is deterministic on this machine (the committed pair's command again, its weights'
# hashes against sample_data's).
# Results: $OUT/spec/speculate.json, $OUT/tail/speculate.json, the printed tables and
# $OUT/retrain.txt.
OUT=${OUT:-/tmp/out}
python3 scripts/bench_speculate.py /tmp/spec-throwaway --reps 1 --workloads essays > /dev/null
python3 scripts/bench_speculate.py $OUT/spec --reps 5 --workloads essays,extract 2>&1 | tail -11
python3 scripts/bench_speculate.py $OUT/tail --workloads tail:15,full:15 2>&1 | tail -5
python3 -m batchrun.models.train /tmp/re/target /tmp/re/draft --long-answers --steps 6000 \
    --draft-steps 1200 --seed 6 > $OUT/retrain.txt 2>&1
tail -1 $OUT/retrain.txt
for role in target draft; do
    sample=sample_data/demo-$([ $role = target ] && echo trained || echo draft)
    sha256sum $sample/model.safetensors /tmp/re/$role/model.safetensors | tee -a $OUT/retrain.txt
done
