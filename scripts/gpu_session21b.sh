#!/bin/bash
# Session 21's second H200 call (set-up line: shared/gpu/README.md): issue 18's speculation
# workloads on the committed long-answer pair (scripts/gpu_session18c.sh: tail and full 15
# times, few, essays and extract 5 times, after a throwaway), then whether training is
# deterministic on this machine: the committed pair's command run again, its weights' hashes
# against sample_data's.
# Results: $OUT/spec/speculate.json, the printed table and $OUT/retrain.txt.
OUT=${OUT:-/tmp/out}
OUT=$OUT bash scripts/gpu_session18c.sh
python3 -m batchrun.models.train /tmp/re/target /tmp/re/draft --long-answers --steps 6000 \
    --draft-steps 1200 --seed 6 > $OUT/retrain.txt 2>&1
tail -1 $OUT/retrain.txt
for role in target draft; do
    sample=sample_data/demo-$([ $role = target ] && echo trained || echo draft)
    sha256sum $sample/model.safetensors /tmp/re/$role/model.safetensors | tee -a $OUT/retrain.txt
done
