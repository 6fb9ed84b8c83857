#!/bin/bash
# Session 14's H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): warm 512-row
# labeling jobs after session 13's read-ahead fix, interleaved with MLX's CUDA graphs off
# (MLX_USE_CUDA_GRAPHS=0) and with the warm-up skipped; one job under cProfile (where the host
# waits in a wave's first decode step); then the speculation tests on CUDA after the step
# measures changed. Needs pytest in /tmp/site. Results: $OUT/keep.tgz and the printed lines.
OUT=${OUT:-/tmp/out}
W=/tmp/work1; rm -rf $W; mkdir -p $W/keep
source scripts/gpu_lib.sh
labeling_rows
label throwaway rows512 c1
for i in 1 2; do
    label default-$i rows512 c1
    label nographs-$i rows512 c1 MLX_USE_CUDA_GRAPHS=0
    label nowarmup-$i rows512 c1 TRACE_NO_WARM_UP=1
done
label default-3 rows512 c1
label profile rows512 c1 TRACE_PROFILE=$W/keep/profile.pstats
python3 -c "import pstats
s = pstats.Stats('$W/keep/profile.pstats'); s.sort_stats('cumulative').print_stats(45)
s.sort_stats('tottime').print_stats(25)" > $W/keep/profile.txt 2>&1
grep -A32 "Ordered by: internal" $W/keep/profile.txt | cut -c1-160
for name in default-1 default-3 nographs-1; do
    echo "$name, the wave's first steps:"
    grep "GenerationBatch.__init__\|LeanGenerationBatch._step\|LeanGenerationBatch.extend\|PromptProcessingBatch.prompt 510\|PromptProcessingBatch.split\|_extend\|warm_up\|load_many 27" \
        $W/keep/label-trace-$name.txt | head -14
done
python3 -m pytest -q -p no:cacheprovider tests/test_speculate.py > $W/keep/test-speculate.log 2>&1
echo "speculation tests:"; tail -2 $W/keep/test-speculate.log
grep "^FAILED" $W/keep/test-speculate.log | head -5 | cut -c1-200
pack
