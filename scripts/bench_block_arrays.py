"""How long making a disk cache block's arrays takes, one copy a tensor against one a block:

    python scripts/bench_block_arrays.py [--blocks 27] [--layers 16]

Synthetic blocks of a 1B Llama's shape (64 tokens, 8 KV heads of 64, bf16) through
blockfile.arrays_of; prints seconds for all blocks each way.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)
from batchrun.cache.blockfile import Verified, arrays_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=27)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    size = 8 * 64 * 64 * 2
    names = [f"{kind}.{i}" for i in range(args.layers) for kind in ("keys", "values")]
    table = {n: {"dtype": "BF16", "shape": [1, 8, 64, 64],
                 "data_offsets": [i * size, (i + 1) * size]} for i, n in enumerate(names)}
    rng = np.random.default_rng(0)
    blocks = [Verified(table, {}, memoryview(rng.integers(0, 255, size * len(names),
                                                          dtype=np.uint8).tobytes()))
              for _ in range(args.blocks)]
    arrays_of(blocks[0], True)
    arrays_of(blocks[0], False)  # first use compiles nothing later runs pay
    for whole in (False, True, False, True):
        start = time.perf_counter()
        for block in blocks:
            arrays_of(block, whole)
        print(f"{'one copy a block ' if whole else 'one copy a tensor'}: "
              f"{time.perf_counter() - start:.3f} s for {args.blocks} blocks", flush=True)


if __name__ == "__main__":
    main()
