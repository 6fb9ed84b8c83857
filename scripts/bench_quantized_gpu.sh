#!/usr/bin/env bash
# Quantized (4-bit, group 64) vs bf16 models on the lent GPU: the weight plan's effect on the
# labeling and decode workloads of BENCHMARKS.md, each system a fresh process.
#
#     bash scripts/bench_quantized_gpu.sh dense   # qwen3 bench shape: 4-bit and its bf16 twin
#     bash scripts/bench_quantized_gpu.sh moe     # qwen3_moe bench shape: bf16 and 4-bit
#     bash scripts/bench_quantized_gpu.sh probe moedecode agree   # the follow-ups below
#     bash scripts/bench_quantized_gpu.sh sliding # gemma3 and gpt_oss bench shapes, bf16
#     bash scripts/bench_quantized_gpu.sh hybrid  # qwen3_5 and granite_hybrid bench shapes, bf16
#     bash scripts/bench_quantized_gpu.sh choices # choices against free answers; kept prompts
#
# Run from the repository root after the wheel set-up line of shared/gpu/README.md (or, on a
# machine still warm from it, alone: the environment is set up again from /tmp/site). Models are
# built with random weights under $BQ_WORK (/tmp/bq) and kept there for a later call on the same
# machine. Each phase writes three files under $OUT: log-PHASE.txt (everything), results-PHASE.jsonl
# (one JSON line an item: the benchmark script's JSON, the report's weight plan, rc, seconds) and
# models-PHASE.txt (batchrun's model lines), and prints a compact summary at the end.
#
# Items, in priority order, each under `timeout` and skipped when the call's budget ($BQ_BUDGET
# seconds from the script's start, default 570) has too little left:
#   dense: builds; a throwaway run per model and weight mode (the first process compiles kernels;
#          its model line recorded); labeling (512 rows, ~1,000-word instruction, 8 new tokens,
#          batchrun cold/warm and the peer) for 4-bit auto, 4-bit --weights quantized, bf16;
#          decode (1,024 rows x 256 tokens, batchrun and batch_generate@256,1024) for 4-bit auto,
#          bf16, then 4-bit --weights quantized (batchrun only).
#   moe:   builds, throwaways, labeling and decode for bf16 and 4-bit (auto weights).
#   probe: which expert operations fail past how many routed rows (probe_expert_rows.py).
#   moedecode: the moe phase's decode items alone (builds and throwaways first; the 4-bit model
#          by batchrun only).
#   agree: greedy tokens of batchrun (auto weights) against mlx-lm's own generation of the
#          model as loaded, on the labeling rows (check_greedy_agreement.py; $BQ_AGREE_ROWS of
#          them): qwen3 bf16 (the baseline), qwen3 4-bit, then the 4-bit mixture of experts.
#   agreetrained: the same comparison on a trained checkpoint, whose next-token distributions
#          are peaked as a real model's are: sample_data/demo-trained converted by mlx-lm to
#          bf16 and to 4-bit (group 64) from bf16; the bf16 baselines (here and in agree) also
#          read mlx-lm's batch_generate against its generate_step.
#   sliding: labeling (batchrun cold/warm, the peer) for the sliding-window shapes (gemma3 and
#          gpt_oss, bf16): rows start from cached blocks, each holding its copy of them.
#   hybrid: labeling (batchrun cold/warm, the peer) for the hybrid recurrent shapes (qwen3_5,
#          granite_hybrid, bf16: state snapshots, the chunked gated-delta rule), then qwen3_5's
#          decode against batch_generate.
#   choices: --choices against free 8-token answers on the same rows (qwen3 bf16; 2,048 rows
#          under a ~3,000-token instruction: $BQ_CHOICE_ROWS, $BQ_CHOICE_WORDS), then the decode
#          job with rows keeping their computed prompts and without (BATCHRUN_KEEP_PROMPTS=0).
#   hybridfix: the gated-delta decode step kernel against mlx-lm's rule
#          (probe_gated_delta_step.py), then qwen3_5's labeling (batchrun cold/warm, the peer)
#          and its decode against batch_generate, and with the kernel off.
#   recheck: the short form of hybridfix and choices for a call with little device time: the
#          kernel probe, qwen3_5's labeling (batchrun only), then the decode job with kept
#          prompts (batchrun only; the figure to read against dec-nokeep's).
#   hybridprof: where qwen3_5's labeling job spends its time: the labeling rows run cold and
#          warm through scripts/trace_job.py (a line an engine step and prefill call) with the
#          job loop under cProfile; the trace and the profile's top functions go under $OUT.
# Sizes can be shrunk for a dry run on a CPU: BQ_SIZE=tiny BQ_LAB_ROWS=8 BQ_LAB_WORDS=100
# BQ_TOKENS=8 BQ_DEC_ROWS=8 BQ_DEC_CONC=8 ...
set -u
[ $# -ge 1 ] || { echo "usage: $0 dense|moe [...]" >&2; exit 2; }
: "${OUT:?OUT must name the results folder}"

PY=${PYTHON:-python3}
if [ -d /tmp/site ] && [[ ":${PYTHONPATH:-}:" != *:/tmp/site:* ]]; then
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  SP=$($PY -c 'import site;print(site.getsitepackages()[0])')
  export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}
fi
export PYTHONUNBUFFERED=1
W=${BQ_WORK:-/tmp/bq}
BUDGET=${BQ_BUDGET:-570}
SIZE=${BQ_SIZE:-bench}
LAB_ROWS=${BQ_LAB_ROWS:-512}
LAB_WORDS=${BQ_LAB_WORDS:-1000}      # ~1,500 tokens (BENCHMARKS.md, "Labeling throughput")
LAB_TOKENS=${BQ_LAB_TOKENS:-8}
LAB_CONC=${BQ_LAB_CONC:-512}
DEC_ROWS=${BQ_DEC_ROWS:-1024}
DEC_TOKENS=${BQ_TOKENS:-256}
DEC_CONC=${BQ_DEC_CONC:-256,1024}
mkdir -p "$W/models" "$OUT"

left() { echo $((BUDGET - SECONDS)); }

# item PHASE NAME LIMIT NEED CMD...: run CMD under timeout (LIMIT, or what the budget has left);
# skip it when less than NEED seconds are left. Appends a status line to results.
item() {
  local phase=$1 name=$2 limit=$3 need=$4; shift 4
  local res=$OUT/results-$phase.jsonl l t0 rc
  l=$(left)
  if [ "$l" -lt "$need" ]; then
    echo "== $name: SKIPPED ($l s left, needs ~$need)"
    echo "{\"item\": \"$name\", \"skipped\": true, \"left_s\": $l}" >>"$res"
    return 1
  fi
  [ "$limit" -gt $((l - 5)) ] && limit=$((l - 5))
  echo "== $name (limit ${limit}s, t=${SECONDS}s): $*"
  t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$W/$name.out" 2>"$W/$name.err"
  rc=$?
  cat "$W/$name.out"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  if [ $rc -ne 0 ]; then
    echo "-- $name stderr (tail):"; tail -n 25 "$W/$name.err"
    local why; why=$(grep -v '^\s*$' "$W/$name.err" | tail -n 1 | tr -d '"\\' | cut -c1-300)
    [ $rc -eq 124 ] && why="timed out after ${limit} s; $why"
    echo "{\"item\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"error\": \"$why\"}" >>"$res"
  fi
  ITEM_S=$((SECONDS - t0))
  [ $rc -eq 0 ] && case $name in probe-*|agree-*)
    echo "{\"item\": \"$name\", \"rc\": 0, \"seconds\": $ITEM_S}" >>"$res" ;; esac
  return $rc
}

# build NAME FAMILY QUANT: a random-weight model under $W/models/NAME (kept if already there).
build() {
  local d=$W/models/$1
  [ -f "$d/config.json" ] && { echo "== $1 already built"; return 0; }
  rm -rf "$d"
  $PY -m batchrun.models.build "$d" --family "$2" --size "$SIZE" --quantize "$3" --seed 0 \
    && du -sh "$d"
}

# builds PHASE A FAMILY_A QUANT_A B FAMILY_B QUANT_B: two models built side by side.
builds() {
  local phase=$1
  local t0=$SECONDS
  echo "== builds $2 $5 (t=${SECONDS}s)"
  timeout -k 5 400 bash -c "$(declare -f build); W=$W SIZE=$SIZE PY=$PY; build $2 $3 $4" \
    >"$W/build-$2.log" 2>&1 &
  local p1=$!
  timeout -k 5 400 bash -c "$(declare -f build); W=$W SIZE=$SIZE PY=$PY; build $5 $6 $7" \
    >"$W/build-$5.log" 2>&1 &
  local p2=$!
  wait $p1; local r1=$?; wait $p2; local r2=$?
  cat "$W/build-$2.log" "$W/build-$5.log" | grep -v '^\s*$' | tail -n 8
  echo "== builds: rc=$r1,$r2 in $((SECONDS - t0)) s"
  echo "{\"item\": \"build $2 $5\", \"rc\": [$r1, $r2], \"seconds\": $((SECONDS - t0))}" \
    >>"$OUT/results-$phase.jsonl"
  [ $r1 -eq 0 ] && [ $r2 -eq 0 ]
}

# prime PHASE NAME MODEL [FLAGS...]: a throwaway 16-row job (kernels compiled, caches warm);
# records batchrun's model line and the run's seconds.
prime() {
  local phase=$1 name=$2 model=$3; shift 3
  [ -f "$W/prime.jsonl" ] || $PY -c "
import sys; sys.path.insert(0, 'scripts')
from pathlib import Path
from bench_labeling import write_rows
write_rows(Path('$W/prime.jsonl'), 16, $LAB_WORDS)"
  rm -rf "$W/prime-cache-$name"
  if item "$phase" "prime-$name" 180 30 $PY -m batchrun run "$W/prime.jsonl" --quiet \
      --max-tokens "$LAB_TOKENS" --model "$model" --job-dir "$W/prime-job-$name" \
      --cache-dir "$W/prime-cache-$name" --restart "$@"; then
    { echo "[$name] ${*:-(default flags)}  first-process run: ${ITEM_S} s"
      grep -E '^(model|device|weights|batch|BLAS):' "$W/prime-$name.err"; echo; } \
      | tee -a "$OUT/models-$phase.txt"
  fi
}

# record PHASE NAME DIR FILE: the benchmark's JSON and each batchrun job's weight plan.
record() {
  $PY - "$1" "$2" "$3" "$4" "$OUT/results-$1.jsonl" <<'EOF'
import json, sys
from pathlib import Path
phase, name, d, f, res = sys.argv[1:]
d = Path(d)
data = json.loads((d / f).read_text())
data.pop("table", None)
weights = {}
for report in sorted(d.glob("job-*/report.json")):
    weights[report.parent.name] = json.loads(report.read_text()).get("weights")
with open(res, "a") as out:
    out.write(json.dumps({"item": name, "rc": 0, **data, "weights": weights}) + "\n")
EOF
}

# labeling PHASE NAME MODEL SYSTEMS [FLAGS]
labeling() {
  local phase=$1 name=$2 model=$3 systems=$4 flags=${5:-}
  rm -rf "$W/lab-$name"
  item "$phase" "lab-$name" 300 75 $PY scripts/bench_labeling.py "$W/lab-$name" --model "$model" \
    --rows "$LAB_ROWS" --instruction "$LAB_WORDS" --max-tokens "$LAB_TOKENS" \
    --concurrency "$LAB_CONC" --systems "$systems" "--flags=$flags" \
    && record "$phase" "lab-$name" "$W/lab-$name" labeling.json
}

# decode PHASE NAME MODEL SYSTEMS [FLAGS]
decode() {
  local phase=$1 name=$2 model=$3 systems=$4 flags=${5:-}
  rm -rf "$W/dec-$name"
  item "$phase" "dec-$name" 300 90 $PY scripts/bench_decode_job.py "$W/dec-$name" --model "$model" \
    --rows "$DEC_ROWS" --max-tokens "$DEC_TOKENS" --concurrency "$DEC_CONC" \
    --systems "$systems" "--flags=$flags" \
    && record "$phase" "dec-$name" "$W/dec-$name" decode_job.json
}

summary() {
  $PY - "$OUT/results-$1.jsonl" "$LAB_ROWS" <<'EOF'
import json, sys
from pathlib import Path
path, rows = sys.argv[1], int(sys.argv[2])
print(f"\n===== summary: {path}")
for line in (Path(path).read_text().splitlines() if Path(path).exists() else []):
    r = json.loads(line)
    name = r["item"]
    if r.get("skipped"):
        print(f"{name}: skipped ({r['left_s']} s left)")
        continue
    if r.get("error") is not None or r.get("rc") not in (0, [0, 0]):
        print(f"{name}: rc={r.get('rc')} {r.get('seconds')} s {r.get('error', '')}")
        continue
    if name.startswith("build") or name.startswith("prime"):
        print(f"{name}: ok in {r.get('seconds')} s")
        continue
    if "wall_s" in r and isinstance(r["wall_s"], dict):  # labeling
        print(f"{name}  (flags: {r['flags'] or 'default'})")
        for sys_name, wall in r["wall_s"].items():
            job = r["details"].get(sys_name, {}).get("wall_s") or 0
            peak = r["details"].get(sys_name, {}).get("peak_memory_bytes", 0) / 2**30
            n = r.get("rows") or rows
            print(f"  {sys_name:40} process {wall:7.2f} s  job {job:7.3f} s  "
                  f"{n / job if job else 0:7.1f} rows/s (job)  peak {peak:6.2f} GiB")
    elif "results" in r:  # decode
        print(f"{name}  (flags: {r['flags'] or 'default'})")
        for x in r["results"]:
            peak = x.get("peak_memory_bytes", 0) / 2**30
            print(f"  {x['system']:22} job {x['wall_s']:7.2f} s  {x['tokens']:7d} tok  "
                  f"{x['tokens_per_s']:8.0f} tok/s  peak {peak:6.2f} GiB"
                  + (f"  process {x['process_s']:6.2f} s" if "process_s" in x else ""))
    else:
        print(f"{name}: ok in {r.get('seconds')} s")
    plans = {k: (v or {}).get("held") for k, v in (r.get("weights") or {}).items()}
    if plans:
        print(f"  weight plans: {plans}")
EOF
  echo; cat "$OUT/models-$1.txt" 2>/dev/null
}

dense() {
  local q=$W/models/qwen3-4bit b=$W/models/qwen3-bf16
  builds dense qwen3-4bit qwen3 4bit qwen3-bf16 qwen3 none || return 1
  prime dense q4-auto "$q"
  prime dense q4-quantized "$q" --weights quantized
  prime dense bf16 "$b"
  # 1. labeling
  labeling dense q4-auto "$q" batchrun,peer
  labeling dense q4-quantized "$q" batchrun "--weights quantized"
  labeling dense bf16 "$b" batchrun,peer
  # 2. decode
  decode dense q4-auto "$q" batchrun,batch_generate
  decode dense bf16 "$b" batchrun,batch_generate
  decode dense q4-quantized "$q" batchrun "--weights quantized"
}

moe() {
  local q=$W/models/moe-4bit b=$W/models/moe-bf16
  builds moe moe-bf16 qwen3_moe none moe-4bit qwen3_moe 4bit || return 1
  prime moe moe-bf16 "$b"
  prime moe moe-q4-auto "$q"
  labeling moe moe-bf16 "$b" batchrun,peer
  labeling moe moe-q4-auto "$q" batchrun,peer
  decode moe moe-bf16 "$b" batchrun,batch_generate
  decode moe moe-q4-auto "$q" batchrun,batch_generate
}

probe() {
  item probe probe-experts 300 60 $PY scripts/probe_expert_rows.py "$OUT/probe" \
    --tokens "${BQ_PROBE_TOKENS:-8192,16384,112000}"
}

moedecode() {
  local q=$W/models/moe-4bit b=$W/models/moe-bf16
  builds moedecode moe-bf16 qwen3_moe none moe-4bit qwen3_moe 4bit || return 1
  prime moedecode moe-bf16 "$b"
  prime moedecode moe-q4-auto "$q"
  decode moedecode moe-bf16 "$b" batchrun,batch_generate
  # The 4-bit target is against the bf16 batchrun figure just measured.
  decode moedecode moe-q4-auto "$q" batchrun
}

agree() {
  local q=$W/models/qwen3-4bit b=$W/models/qwen3-bf16 m=$W/models/moe-4bit
  local rows=${BQ_AGREE_ROWS:-$LAB_ROWS}
  # The bf16 twin first: what batching alone does to a random-weight model's greedy tokens,
  # the baseline the 4-bit model's share is read against.
  builds agree qwen3-bf16 qwen3 none qwen3-4bit qwen3 4bit || return 1
  item agree agree-bf16 300 100 $PY scripts/check_greedy_agreement.py "$b" "$OUT/agree-bf16" \
    --rows "$rows" --instruction "$LAB_WORDS" --max-tokens "$LAB_TOKENS" --mlx-lm-batched 256
  item agree agree-q4 300 100 $PY scripts/check_greedy_agreement.py "$q" "$OUT/agree-q4" \
    --rows "$rows" --instruction "$LAB_WORDS" --max-tokens "$LAB_TOKENS"
  build moe-4bit qwen3_moe 4bit || return 1
  item agree agree-moe-q4 300 120 $PY scripts/check_greedy_agreement.py "$m" \
    "$OUT/agree-moe-q4" --rows "$rows" --instruction "$LAB_WORDS" --max-tokens "$LAB_TOKENS"
}

agreetrained() {
  local t=$W/models/trained-bf16 q=$W/models/trained-q4
  local rows=${BQ_AGREE_ROWS:-$LAB_ROWS}
  rm -rf "$t" "$q"
  item agreetrained convert-trained 120 30 $PY -m mlx_lm convert --hf-path \
    sample_data/demo-trained --mlx-path "$t" --dtype bfloat16 || return 1
  item agreetrained convert-trained-q4 120 30 $PY -m mlx_lm convert --hf-path \
    sample_data/demo-trained --mlx-path "$q" --dtype bfloat16 -q --q-bits 4 \
    --q-group-size 64 || return 1
  item agreetrained agree-trained-bf16 200 40 $PY scripts/check_greedy_agreement.py "$t" \
    "$OUT/agree-trained-bf16" --rows "$rows" --instruction "$LAB_WORDS" \
    --max-tokens "$LAB_TOKENS" --mlx-lm-batched "$rows"
  item agreetrained agree-trained-q4 200 40 $PY scripts/check_greedy_agreement.py "$q" \
    "$OUT/agree-trained-q4" --rows "$rows" --instruction "$LAB_WORDS" \
    --max-tokens "$LAB_TOKENS"
}

sliding() {
  local g=$W/models/gemma3-bf16 o=$W/models/gptoss-bf16
  builds sliding gemma3-bf16 gemma3 none gptoss-bf16 gpt_oss none || return 1
  prime sliding gemma3-bf16 "$g"
  prime sliding gptoss-bf16 "$o"
  labeling sliding gemma3-bf16 "$g" batchrun,peer
  labeling sliding gptoss-bf16 "$o" batchrun,peer
}

hybrid() {
  local q=$W/models/qwen35-bf16 r=$W/models/granite-bf16
  builds hybrid qwen35-bf16 qwen3_5 none granite-bf16 granite_hybrid none || return 1
  prime hybrid qwen35-bf16 "$q"
  prime hybrid granite-bf16 "$r"
  labeling hybrid qwen35-bf16 "$q" batchrun,peer
  labeling hybrid granite-bf16 "$r" batchrun,peer
  decode hybrid qwen35-bf16 "$q" batchrun,batch_generate
}

choices() {
  local b=$W/models/qwen3-bf16 LAB_ROWS=${BQ_CHOICE_ROWS:-2048} \
    LAB_WORDS=${BQ_CHOICE_WORDS:-2000} LAB_CONC=1024
  local pick="--choices positive,negative,neutral"
  build qwen3-bf16 qwen3 none || return 1
  prime choices bf16 "$b" $pick
  labeling choices free "$b" batchrun
  labeling choices choices "$b" batchrun "$pick"
  decode choices keep "$b" batchrun
  BATCHRUN_KEEP_PROMPTS=0 decode choices nokeep "$b" batchrun
}

hybridfix() {
  local q=$W/models/qwen35-bf16
  item hybridfix probe-gated-delta-step 120 30 $PY scripts/probe_gated_delta_step.py \
    "$OUT/gated-delta-step"
  build qwen35-bf16 qwen3_5 none || return 1
  prime hybridfix qwen35-bf16 "$q"
  labeling hybridfix qwen35-bf16 "$q" batchrun,peer
  decode hybridfix qwen35-bf16 "$q" batchrun,batch_generate
  BATCHRUN_GATED_DELTA_KERNEL=0 decode hybridfix qwen35-nokernel "$q" batchrun
}

recheck() {
  local q=$W/models/qwen35-bf16 b=$W/models/qwen3-bf16
  item recheck probe-gated-delta-step 60 20 $PY scripts/probe_gated_delta_step.py \
    "$OUT/gated-delta-step" --rows 128,1024
  builds recheck qwen35-bf16 qwen3_5 none qwen3-bf16 qwen3 none || return 1
  prime recheck qwen35-bf16 "$q"
  labeling recheck qwen35-bf16 "$q" batchrun
  prime recheck bf16 "$b"
  decode recheck keep "$b" batchrun
}

hybridprof() {
  local q=$W/models/qwen35-bf16 d=$W/prof
  build qwen35-bf16 qwen3_5 none || return 1
  prime hybridprof qwen35-bf16 "$q"
  rm -rf "$d"; mkdir -p "$d"
  $PY -c "
import sys; sys.path.insert(0, 'scripts')
from pathlib import Path
from bench_labeling import write_rows
write_rows(Path('$d/rows.jsonl'), $LAB_ROWS, $LAB_WORDS)"
  local run
  for run in cold warm; do
    TRACE_PROFILE=$OUT/prof-$run.pstats item hybridprof "trace-$run" 240 60 \
      $PY scripts/trace_job.py run "$d/rows.jsonl" --quiet --max-tokens "$LAB_TOKENS" \
      --model "$q" --job-dir "$d/job-$run" --cache-dir "$d/cache" --restart
    cp "$W/trace-$run.err" "$OUT/trace-$run.txt" 2>/dev/null
    $PY -c "
import json, sys
r = json.load(open('$d/job-$run/report.json'))['runs'][-1]
print({k: r.get(k) for k in ('wall_s', 'mean_batch_size', 'prefill_time_s', 'decode_time_s')})"
    [ -f "$OUT/prof-$run.pstats" ] && $PY -c "
import pstats
s = pstats.Stats('$OUT/prof-$run.pstats')
s.sort_stats('tottime').print_stats(30)
s.sort_stats('cumulative').print_stats(45)" >"$OUT/prof-$run.txt" 2>&1
  done
}

for phase in "$@"; do
  case $phase in
    dense|moe|probe|moedecode|agree|agreetrained|sliding|hybrid|choices|hybridfix|recheck|\
      hybridprof) ;;
    *) echo "unknown phase $phase (dense, moe, probe, moedecode, agree, agreetrained, sliding," \
         "hybrid," \
         "choices, hybridfix, recheck, hybridprof)" >&2
       exit 2 ;;
  esac
  {
    echo "== phase $phase: $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,memory.total \
      --format=csv,noheader 2>/dev/null || echo no nvidia-smi), git $(git rev-parse --short HEAD \
      2>/dev/null) (+ working-tree changes: $(git status --porcelain 2>/dev/null | wc -l) files)"
    $PY -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', \
mlx_lm.__version__, mx.default_device())"
    $phase
    echo "== phase $phase done at t=${SECONDS}s"
    summary "$phase"
  } 2>&1 | tee -a "$OUT/log-$phase.txt"
done
