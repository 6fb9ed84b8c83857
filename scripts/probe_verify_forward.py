"""What one forward of the demo target costs at 1 .. K+1 tokens a row (issue 18): the
verification forward of a speculative step against a plain decode step's, on a live batch
cache of 8 extraction rows (bench_speculate.py's), each forward's KV trimmed off again.

Per width: the host's time to build the graph, the device's time to run it (evaluated
synchronously), and the two pipelined as plain decoding runs them (the next forward built
while the last one runs); then a speculative step's rollback, and the demo draft's 1, 4 and 6
guesses on the same rows. Prints one line per measure; `--dtype float16` casts the target.

    python scripts/probe_verify_forward.py [--k 8] [--reps 50] [--dtype float32]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx  # noqa: E402
from bench_speculate import extraction  # noqa: E402
from mlx.utils import tree_map  # noqa: E402

from batchrun.engine.config import EngineConfig  # noqa: E402
from batchrun.engine.decoding.speculate import DraftModel, rollback  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.types import SamplingParams  # noqa: E402
from batchrun.models import DEMO_DRAFT_MODEL, DEMO_MODEL, load_model  # noqa: E402


def live_batch(lm, rows: int, decoded: int):
    """An engine's generation batch of `rows` extraction rows, `decoded` tokens into their
    answers."""
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=rows,
                                                         prefix_cache=False),
                    lm.context_length)
    for c in extraction(rows):
        engine.add_request(messages=c, params=SamplingParams(max_tokens=1000, min_tokens=999))
    batch = None
    while batch is None or batch._num_tokens[0] < decoded:
        engine.step()
        batch = engine.backend._gen._generation_batch
        batch = batch if batch.uids else None
    return batch


def timed(model, cache, inputs, reps: int) -> tuple[float, float, float]:
    """Median ms: building the graph, running it synchronously, and pipelined a step."""
    build, run = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = model(inputs, cache=cache)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        for c in cache:
            c.trim(inputs.shape[1])
        build.append(t1 - t0)
        run.append(t2 - t1)
    start = time.perf_counter()
    last = None
    for _ in range(reps):
        out = mx.argmax(model(inputs, cache=cache)[:, -1], axis=-1)
        mx.async_eval(out)
        for c in cache:
            c.trim(inputs.shape[1])
        if last is not None:
            last.tolist()
        last = out
    last.tolist()
    piped = (time.perf_counter() - start) / reps
    return statistics.median(build) * 1e3, statistics.median(run) * 1e3, piped * 1e3


def timed_rollback(model, cache, inputs, reps: int) -> tuple[float, float]:
    """Median ms of a forward then a speculative step's rollback (rows dropping 0 .. width - 1
    of the width's tokens), both evaluated: the rollback's build and its run."""
    width = inputs.shape[1]
    drop = [i % width for i in range(inputs.shape[0])]
    build, run = [], []
    for _ in range(reps):
        mx.eval(model(inputs, cache=cache))
        t0 = time.perf_counter()
        rollback(cache, drop)
        t1 = time.perf_counter()
        mx.eval([c.state for c in cache])
        t2 = time.perf_counter()
        build.append(t1 - t0)
        run.append(t2 - t1)
    return statistics.median(build) * 1e3, statistics.median(run) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    lm = load_model(str(DEMO_MODEL))
    if args.dtype != "float32":
        dtype = getattr(mx, args.dtype)
        lm.model.update(tree_map(lambda p: p.astype(dtype), lm.model.parameters()))
    batch = live_batch(lm, args.rows, 20)
    cache, model = batch.prompt_cache, lm.model
    print(f"device {mx.default_device()}, {args.rows} rows, cache length {cache[0]._idx}, "
          f"{args.dtype}", flush=True)
    for width in range(1, args.k + 2):
        inputs = mx.ones((len(batch.uids), width), dtype=mx.int32)
        timed(model, cache, inputs, 5)  # compile, warm
        build, run, piped = timed(model, cache, inputs, args.reps)
        print(f"{width} tokens a row: build {build:.2f} ms, run {run:.2f} ms, "
              f"pipelined {piped:.2f} ms a step", flush=True)
    for width in (2, 5, args.k + 1):
        inputs = mx.ones((len(batch.uids), width), dtype=mx.int32)
        timed_rollback(model, cache, inputs, 3)
        build, run = timed_rollback(model, cache, inputs, args.reps)
        print(f"rollback after {width} tokens a row: build {build:.2f} ms, run {run:.2f} ms, "
              f"cache length {cache[0]._idx}", flush=True)
    draft = DraftModel(load_model(str(DEMO_DRAFT_MODEL)).model)
    draft.sync(batch.uids, batch.tokens)
    last, pending = [t[-1] for t in batch.tokens], mx.ones((len(batch.uids),), mx.uint32)
    for k in (1, 4, 6):
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            mx.eval(draft.propose(last, pending, k, lambda lp, j: mx.argmax(lp, axis=-1)))
            times.append(time.perf_counter() - start)
            draft.rollback([k + 1] * len(last))
        print(f"the draft's {k} guesses (the demo draft): "
              f"{statistics.median(times) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
