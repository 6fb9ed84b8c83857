#!/usr/bin/env bash
# Choices against free answers on the same rows, and rows keeping their computed prompts on and
# off for a decode job, on the lent GPU (BENCHMARKS.md, "Labeling throughput" and "Prefix
# cache"). Run from the repository root after the wheel set-up of shared/gpu/README.md (or, on a
# machine still warm from it, alone). Writes under $OUT: log.txt, labeling-free.json,
# labeling-choices.json, decode-keep.json, decode-nokeep.json.
#
#     bash scripts/bench_choices_gpu.sh
#
# CPU dry run: BC_SIZE=tiny BC_ROWS=16 BC_WORDS=100 BC_DEC_ROWS=16 BC_TOKENS=8 bash ...
set -u
: "${OUT:?OUT must name the results folder}"
PY=${PYTHON:-python3}
if [ -d /tmp/site ] && [[ ":${PYTHONPATH:-}:" != *:/tmp/site:* ]]; then
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  SP=$($PY -c 'import site;print(site.getsitepackages()[0])')
  export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}
fi
export PYTHONUNBUFFERED=1
W=${BC_WORK:-/tmp/bc}
SIZE=${BC_SIZE:-bench}
ROWS=${BC_ROWS:-2048}
WORDS=${BC_WORDS:-2000}      # ~3,000 tokens: the shared instruction
DEC_ROWS=${BC_DEC_ROWS:-1024}
TOKENS=${BC_TOKENS:-256}
CHOICES=positive,negative,neutral
M=$W/qwen3-bf16
mkdir -p "$W" "$OUT"
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
    || echo cpu) git $(git rev-parse --short HEAD 2>/dev/null)"
  [ -f "$M/config.json" ] || $PY -m batchrun.models.build "$M" --family qwen3 --size "$SIZE" \
    --quantize none --seed 0 >/dev/null
  # A throwaway job first: the machine's first process compiles the kernels.
  $PY -c "import sys; sys.path.insert(0, 'scripts')
from pathlib import Path; from bench_labeling import write_rows
write_rows(Path('$W/prime.jsonl'), 16, $WORDS)"
  $PY -m batchrun run "$W/prime.jsonl" --quiet --model "$M" --job-dir "$W/prime-job" \
    --cache-dir "$W/prime-cache" --restart --max-tokens 8 --choices "$CHOICES" 2>&1 | tail -n 2
  for kind in free choices; do
    flags=""; [ $kind = choices ] && flags="--choices $CHOICES"
    timeout 200 $PY scripts/bench_labeling.py "$W/lab-$kind" --model "$M" --rows "$ROWS" \
      --instruction "$WORDS" --max-tokens 8 --concurrency 1024 --systems batchrun \
      "--flags=$flags" | tail -n 3
    cp "$W/lab-$kind/labeling.json" "$OUT/labeling-$kind.json"
  done
  for keep in 1 0; do
    name=$([ $keep = 1 ] && echo keep || echo nokeep)
    BATCHRUN_KEEP_PROMPTS=$keep timeout 150 $PY scripts/bench_decode_job.py "$W/dec-$name" \
      --model "$M" --rows "$DEC_ROWS" --max-tokens "$TOKENS" --systems batchrun | tail -n 2
    cp "$W/dec-$name/decode_job.json" "$OUT/decode-$name.json"
  done
} 2>&1 | tee -a "$OUT/log.txt"
