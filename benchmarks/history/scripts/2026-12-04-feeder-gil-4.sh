#!/bin/bash
# Session 15's fourth H200 call (set-up line: shared/gpu/README.md; /tmp/l1b built first): where
# a process's first forward (~0.3-0.4 s more than its second) goes: fresh processes with the
# CUDA driver's compiled-kernel cache as it is, then with a 4 GiB cache, then disabled; MLX's own
# PTX cache folder listed, and the GPU architectures named in MLX's libraries. Results: the
# printed lines.
python3 -c "import mlx.core as mx; print(mx.__version__)"
ls -la ~/.nv 2>&1 | head -5
for i in 1 2 3; do python3 scripts/probe_first_forward.py --model /tmp/l1b; done
for i in 1 2 3; do CUDA_CACHE_MAXSIZE=4294967296 python3 scripts/probe_first_forward.py --model /tmp/l1b; done
for i in 1 2; do CUDA_CACHE_DISABLE=1 python3 scripts/probe_first_forward.py --model /tmp/l1b; done
du -sh /tmp/mlx/*/ptx 2>/dev/null; ls /tmp/mlx/*/ptx 2>/dev/null | wc -l
python3 - <<'PY'
import glob, os, subprocess
import mlx.core as mx
folder = os.path.dirname(mx.__file__)
for lib in glob.glob(os.path.join(folder, "lib", "*.so*")) + glob.glob(os.path.join(folder, "*.so")):
    out = subprocess.run(["bash", "-c", f"strings -a {lib} | grep -o 'sm_[0-9]*a\\?\\b' | sort | uniq -c | sort -rn | head -5"], capture_output=True, text=True).stdout
    print(os.path.basename(lib), os.path.getsize(lib) // 2**20, "MiB:", out.replace("\n", " "))
PY
