#!/bin/bash
# Session 26's last call: the speculation tests on CUDA (the compiled draft's guesses against
# each row's own, greedy output with and without speculation), then issue 18's four targets
# at the session's final engine (gpu_session26.sh). Set-up line: shared/gpu/README.md.
OUT=${OUT:-/tmp/out}
if python3 -c "import pytest" 2>/dev/null; then
  python3 -m pytest -q -p no:cacheprovider tests/test_speculate.py 2>&1 | tail -4
else
  echo "no pytest on this machine: the tests are not run"
fi
bash scripts/gpu_session26.sh
