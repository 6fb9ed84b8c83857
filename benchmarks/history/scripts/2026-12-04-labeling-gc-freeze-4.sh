#!/bin/bash
# Session 14's fourth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first):
# whether a process's first use of MLX's kernels can hide behind the model's loading
# (probe_warmup_overlap.py: serial against overlap, fresh processes, interleaved, after a
# throwaway of each). Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work4; rm -rf $W; mkdir -p $W/keep
for mode in serial overlap; do
    python3 scripts/probe_warmup_overlap.py --model /tmp/l1b --mode $mode > /dev/null 2>&1
done
for i in 1 2 3 4; do
    for mode in serial overlap; do
        python3 scripts/probe_warmup_overlap.py --model /tmp/l1b --mode $mode \
            2> $W/keep/probe-$mode-$i.err | tee -a $W/keep/probe.jsonl
        tail -2 $W/keep/probe-$mode-$i.err
    done
done
tar czf $OUT/keep.tgz -C $W/keep .
