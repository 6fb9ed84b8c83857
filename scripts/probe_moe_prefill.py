"""Which prefill of a mixture-of-experts model fails on this device, and where.

    python scripts/probe_moe_prefill.py MODEL OUT_DIR [--rows 256,512,866] [--tokens 130]

Each case in its own process: the model (as batchrun holds it: its weight plan applied) over
ROWS x TOKENS random tokens with fresh caches, then the router's top-k alone (mlx-lm's
argpartition over the gates) at the same size. Writes OUT_DIR/moe_prefill.json: each case's
status, first error line and seconds.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def case(model_path: str, part: str, rows: int, tokens: int) -> None:
    import batchrun  # noqa: F401

    # isort: split
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from batchrun.models.weights import plan_and_apply

    model, _ = load(model_path)
    plan_and_apply(model, "auto")
    mx.random.seed(0)
    ids = mx.random.randint(0, 1000, (rows, tokens))
    if part == "forward":
        out = model(ids, cache=make_prompt_cache(model))[:, -1]
    else:
        experts = getattr(model.args, "num_experts", 64)
        k = getattr(model.args, "num_experts_per_tok", 8)
        gates = mx.random.normal((rows, tokens, experts)).astype(mx.bfloat16)
        out = mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k]
    start = time.perf_counter()
    mx.eval(out)
    print(json.dumps({"seconds": round(time.perf_counter() - start, 4)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", default="256,512,866")
    ap.add_argument("--tokens", type=int, default=130)
    ap.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        case(args.model, args.case[0], int(args.case[1]), args.tokens)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for rows in map(int, args.rows.split(",")):
        for part in ("router", "forward"):
            proc = subprocess.run([sys.executable, __file__, args.model, str(args.out),
                                   "--tokens", str(args.tokens), "--case", part, str(rows)],
                                  capture_output=True, text=True, timeout=300)
            ok = proc.returncode == 0
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            result = {"part": part, "rows": rows, "tokens": args.tokens, "ok": ok,
                      **(json.loads(proc.stdout.splitlines()[-1]) if ok else
                         {"rc": proc.returncode, "error": (lines or [""])[-1][:300]})}
            print(json.dumps(result), flush=True)
            results.append(result)
    (args.out / "moe_prefill.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
