"""Build a random-weight Llama-shaped model folder (batchrun/models/random_model.py).

    python -m tools.demo_models.build sample_data/demo-model          # the demo model
    python -m tools.demo_models.build /tmp/m150 --shape 150m          # ~150M params, fp32
    python -m tools.demo_models.build /tmp/l1b --shape llama-1b       # Llama-3.2-1B's shape
"""

from __future__ import annotations

import argparse

from batchrun.models.random_model import SHAPES, build


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build(args.out, args.shape, args.seed))


if __name__ == "__main__":
    main()
