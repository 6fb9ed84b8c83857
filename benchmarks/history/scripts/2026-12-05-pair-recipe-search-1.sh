#!/bin/bash
# Session 21's H200 call (set-up line: shared/gpu/README.md): which long-answer recipe trains a
# pair that passes the demo tests, over several seeds, before one is trained on the 2-core CPU
# (where a try takes ~1 h). Each recipe below is trained on the GPU (its arithmetic differs
# from the CPU's, so a seed's outcome does not carry over; a recipe's pass rate is the signal)
# and judged by scripts/probe_pair.py. All run at once; the call ends by its deadline.
# Results: $OUT/results.jsonl (one probe line per pair) and $OUT/logs.txt.
OUT=${OUT:-/tmp/out}
C=/tmp/cand
mkdir -p $C
RECIPES=${RECIPES:-"b3 192,4,512,6,2 3000 3
b4 192,4,512,6,2 3000 4
b5 192,4,512,6,2 3000 5
l0 192,4,512,6,2 4500 0
l1 192,4,512,6,2 4500 1
d0 192,6,512,6,2 3000 0
d1 192,6,512,6,2 3000 1
w0 256,4,640,8,2 3000 0
w1 256,4,640,8,2 3000 1
w2 256,4,640,8,2 3000 2"}
one() {  # name shape steps seed
    python3 -m batchrun.models.train $C/$1/target $C/$1/draft --long-answers --steps $3 \
        --draft-steps ${DRAFT_STEPS:-1200} --seed $4 --target-shape $2 > $C/$1.log 2>&1 &&
    BATCHRUN_CACHE_DIR=$C/$1/cache python3 scripts/probe_pair.py $C/$1/target $C/$1/draft \
        --json $C/$1.json >> $C/$1.log 2>&1
}
export -f one; export C DRAFT_STEPS
echo "$RECIPES" | timeout ${DEADLINE:-480} xargs -P ${PARALLEL:-10} -L 1 bash -c 'one "$@"' _
for f in $C/*.log; do echo "== $f"; grep -v Warning $f | tail -4; done > $OUT/logs.txt
for f in $C/*.log; do echo "$(basename $f) $(grep -c '^step' $f) $(grep '^step' $f | tail -1)"; done
cat $C/*.json 2>/dev/null | tee $OUT/results.jsonl
