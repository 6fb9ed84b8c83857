"""Seconds a step of the demo trainer on this machine: the committed recipe's lessons
(--long-answers, seed 6) and target shape, N steps from a fresh model, compiles included.

    python scripts/bench_train_steps.py [--steps 120] [--seed 6] [--mlx-exp]

`--mlx-exp`: the packed trainer with MLX's own exp in place of train_kernels.fast_exp (what the
composed exp gains on its own).

It calls only `train.train(model, data, steps, seed)`, so a checkout of an earlier trainer
runs it the same way (the before/after figures of BENCHMARKS.md, "Demo models").
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx  # noqa: E402

from batchrun.models import DEMO_MODEL  # noqa: E402
from tools.demo_models import lessons, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument("--mlx-exp", action="store_true")
    args = parser.parse_args()
    if args.mlx_exp:
        from tools.demo_models import train_kernels

        train_kernels.fast_exp = mx.exp
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(DEMO_MODEL))
    data = train.encode_examples(tokenizer, lessons.examples(args.seed, 20000, True))
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    mx.random.seed(args.seed)
    model = train.make_model(config)
    mx.eval(model.parameters())
    start = time.perf_counter()
    loss = train.train(model, data, args.steps, args.seed, log_every=max(1, args.steps // 4))
    seconds = time.perf_counter() - start
    print(json.dumps({"steps": args.steps, "seconds": round(seconds, 1),
                      "seconds_a_step": round(seconds / args.steps, 3),
                      "last_loss": round(loss, 4)}))


if __name__ == "__main__":
    main()
