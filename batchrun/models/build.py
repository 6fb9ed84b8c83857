"""Build a random-weight model folder: a family and quantization (families.py), or one of the
demo tokenizer's Llama shapes (random_model.py).

    python -m batchrun.models.build OUT --family qwen3 --size tiny --quantize 4bit
    python -m batchrun.models.build OUT --family qwen3_moe --size bench --dtype bfloat16
    python -m batchrun.models.build OUT --shape 150m --quantize 4bit
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    import batchrun  # noqa: F401  (the BLAS routing, before MLX)
    from batchrun.models.families import FAMILIES, QUANTIZATIONS, SIZES, build_family
    from batchrun.models.random_model import SHAPES, build

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--family", choices=sorted(FAMILIES))
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a Llama shape instead")
    parser.add_argument("--quantize", choices=QUANTIZATIONS, default="none")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weights' dtype before quantizing (default: float32 for tiny, "
                             "bfloat16 for bench)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.family is None) == (args.shape is None):
        parser.error("give one of --family or --shape")
    if args.shape:
        print(build(args.out, args.shape, args.seed, quantize=args.quantize))
        return
    dtype = args.dtype or ("float32" if args.size == "tiny" else "bfloat16")
    print(build_family(args.out, args.family, args.size, args.quantize, dtype, args.seed))


if __name__ == "__main__":
    main()
