"""Which mixture-of-experts operations fail on this device past how many routed rows.

    python scripts/probe_expert_rows.py OUT_DIR [--tokens 8191,8192,16384,112000]

Each case runs in its own process (a failed CUDA launch may abort it): the parts of mlx-lm's
SwitchGLU (argsort of the routed rows, the gather of their inputs, gather_mm and gather_qmm
over sorted rows) and the whole block, in bf16 and 4-bit, at each token count (8 experts a
token of 64: the qwen3_moe bench shape), and the block as batchrun runs it on CUDA (sliced to
models/weights.CUDA_ROUTED_ROWS). Writes OUT_DIR/expert_rows.json: each case's status, first
error line and seconds.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

D, INTER, EXPERTS, K = 2048, 768, 64, 8
PARTS = ("argsort", "gather", "gather_mm", "gather_qmm", "block-bf16", "block-4bit",
         "sliced-bf16", "sliced-4bit")


def case(part: str, tokens: int) -> None:
    import batchrun  # noqa: F401

    # isort: split
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from batchrun.models.weights import CUDA_ROUTED_ROWS, slice_experts

    mx.random.seed(0)
    x = mx.random.normal((tokens, D)).astype(mx.bfloat16)
    indices = mx.random.randint(0, EXPERTS, (tokens, K)).astype(mx.uint32)
    mx.eval(x, indices)
    flat = indices.flatten()
    if part == "argsort":
        out = mx.argsort(flat)
    elif part == "gather":
        order = mx.argsort(flat)
        mx.eval(order)
        out = x[order // K]
    elif part in ("gather_mm", "gather_qmm"):
        order = mx.argsort(flat)
        rows = x[order // K][:, None, :]
        idx = flat[order]
        w = (mx.random.normal((EXPERTS, INTER, D)) * 0.02).astype(mx.bfloat16)
        mx.eval(rows, idx, w)
        if part == "gather_mm":
            out = mx.gather_mm(rows, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)
        else:
            qw, scales, biases = mx.quantize(w, 64, 4)
            mx.eval(qw, scales, biases)
            out = mx.gather_qmm(rows, qw, scales, biases, rhs_indices=idx, transpose=True,
                                group_size=64, bits=4, sorted_indices=True)
    else:
        block = SwitchGLU(D, INTER, EXPERTS)
        block.set_dtype(mx.bfloat16)
        if part.endswith("4bit"):
            nn.quantize(block, 64, 4)
        mx.eval(block.parameters())
        if part.startswith("sliced"):
            slice_experts(block, CUDA_ROUTED_ROWS)
        out = block(x[None], indices[None])
    start = time.perf_counter()
    mx.eval(out)
    print(json.dumps({"seconds": round(time.perf_counter() - start, 4),
                      "shape": list(out.shape)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokens", default="8191,8192,16384,112000")
    ap.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        case(args.case[0], int(args.case[1]))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for tokens in map(int, args.tokens.split(",")):
        for part in PARTS:
            proc = subprocess.run([sys.executable, __file__, str(args.out), "--case", part,
                                   str(tokens)], capture_output=True, text=True, timeout=300)
            ok = proc.returncode == 0
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            result = {"part": part, "tokens": tokens, "routed_rows": tokens * K, "ok": ok,
                      **(json.loads(proc.stdout.splitlines()[-1]) if ok else
                         {"rc": proc.returncode, "error": (lines or [""])[-1][:300]})}
            print(json.dumps(result), flush=True)
            results.append(result)
    (args.out / "expert_rows.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
