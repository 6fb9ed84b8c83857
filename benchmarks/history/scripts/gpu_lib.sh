# Shell helpers the H200 session scripts share (source it; $W is the work folder, with $W/keep
# for what comes back).
label() {  # name rows cache [env...]: one traced labeling job of 8 new tokens on /tmp/l1b
    # (with $TRACE another copy of trace_job.py: scripts/trace_job.py of another tree)
    local name=$1 rows=$2 cache=$3; shift 3
    env "$@" python3 ${TRACE:-scripts/trace_job.py} run $W/$rows.jsonl --quiet --max-tokens 8 \
        --model /tmp/l1b --job-dir $W/label-$name --cache-dir $W/$cache \
        2> $W/keep/label-trace-$name.txt
    cp $W/label-$name/report.json $W/keep/label-report-$name.json
    python3 -c "import json; r = json.load(open('$W/label-$name/report.json'))['runs'][-1]
print('labeling $name: job wall', r['wall_s'], 's,', round(r['rows_done'] / r['wall_s']),
      'rows/s, peak', round(r['peak_memory_bytes'] / 2**30, 2), 'GiB')"
    grep -i "warning" $W/keep/label-trace-$name.txt | head -2
}
labeling_rows() {  # the 512- and 4,096-row labeling inputs (~1.5k-token instruction)
    python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from bench_labeling import write_rows
write_rows(Path('$W/rows512.jsonl'), 512, 1000); write_rows(Path('$W/rows4096.jsonl'), 4096, 1000)"
}
pack() {  # everything kept, gzipped traces, as one archive under $OUT
    gzip -f $W/keep/*.txt 2>/dev/null
    tar czf $OUT/keep.tgz -C $W/keep .
}
ab() {  # n rows cache name_a env_a name_b env_b: n interleaved pairs of labeling jobs
    # (an env is one VAR=value, or - for none), then both sides' job walls on one line each
    local n=$1 rows=$2 cache=$3 a=$4 ea=$5 b=$6 eb=$7 i
    [ "$ea" = - ] && ea=BATCHRUN_AB=a
    [ "$eb" = - ] && eb=BATCHRUN_AB=b
    for i in $(seq 1 $n); do
        label $a-$i $rows $cache $ea
        label $b-$i $rows $cache $eb
    done
    medians $n $a $b
}
medians() {  # n side...: each side's job walls (label-report-SIDE-1..n) and their median
    local n=$1 side; shift
    for side in "$@"; do
        python3 -c "import json, statistics
walls = [json.load(open(f'$W/keep/label-report-$side-{i}.json'))['runs'][-1]['wall_s']
         for i in range(1, $n + 1)]
print('$side:', ' / '.join(f'{w:.3f}' for w in walls), 'median', round(statistics.median(walls), 3))"
    done
}
