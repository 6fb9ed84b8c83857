"""Issue 8's benchmark: image rows batched by batchrun vs one at a time with mlx-vlm.

    python scripts/bench_vision.py [--rows 64] [--max-tokens 32] [--concurrency 64]

Both sides get the same rows (the sample images cycled, one image and a short question each,
greedy) on the bundled demo vision model, and both timings include the image preprocessing:
`one at a time` calls `mlx_vlm.generate` per row; `batchrun` loads and prepares every row and
runs them through the VisionEngine's continuous batch. Prints seconds, tokens/s and the ratio.
"""

import argparse
import json
import time
from pathlib import Path

import batchrun  # noqa: F401  (routes MLX to OpenBLAS: must come before mlx.core)

# isort: split
import mlx_vlm

from batchrun.bench import machine
from batchrun.engine.config import EngineConfig
from batchrun.engine.types import SamplingParams
from batchrun.engine.vision_engine import VisionEngine
from batchrun.io.media import ImageCache

ROOT = Path(__file__).resolve().parents[1]


def rows(n: int) -> list[tuple[list[dict], Path]]:
    images = sorted((ROOT / "sample_data" / "images").glob("*.png"))
    out = []
    for i in range(n):
        image = images[i % len(images)]
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(image)}},
            {"type": "text", "text": f"Describe picture {i} in a few words."}]}]
        out.append((messages, image))
    return out


def one_at_a_time(engine: VisionEngine, work, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = 0
    for messages, image in work:
        out = mlx_vlm.generate(engine.model, engine.processor, engine.prompts.render(messages),
                               image=[str(image)], max_tokens=max_tokens, temperature=0.0,
                               verbose=False)
        tokens += out.generation_tokens
    return time.perf_counter() - start, tokens


def batched(engine: VisionEngine, work, max_tokens: int, concurrency: int) -> tuple[float, int]:
    eng = VisionEngine(engine.model, engine.processor, EngineConfig(max_concurrency=concurrency),
                       engine.context_length)
    cache = ImageCache()
    start = time.perf_counter()
    for messages, image in work:
        loaded = [cache.load(str(image), ROOT, "image")]
        eng.add_vision(eng.prompts.prepare(messages, loaded), SamplingParams(max_tokens=max_tokens))
    outs = eng.run()
    return time.perf_counter() - start, sum(o.completion_tokens for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = VisionEngine.load(str(ROOT / "sample_data" / "demo-vision-model"))
    work = rows(args.rows)
    batched(engine, work[:4], 4, 4)  # warm-up
    one_at_a_time(engine, work[:2], 4)
    seq_s, seq_tokens = one_at_a_time(engine, work, args.max_tokens)
    bat_s, bat_tokens = batched(engine, work, args.max_tokens, args.concurrency)
    print(f"{args.rows} image rows, max_tokens {args.max_tokens}, concurrency {args.concurrency}")
    print(f"mlx-vlm one at a time: {seq_s:7.2f} s, {seq_tokens} tokens, "
          f"{seq_tokens / seq_s:8.1f} tok/s")
    print(f"batchrun batched:      {bat_s:7.2f} s, {bat_tokens} tokens, "
          f"{bat_tokens / bat_s:8.1f} tok/s")
    print(f"speed-up: {seq_s / bat_s:.2f}x (time), "
          f"{(bat_tokens / bat_s) / (seq_tokens / seq_s):.2f}x (tokens/s)")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "machine": machine(),
                                        "one_at_a_time": {"s": seq_s, "tokens": seq_tokens},
                                        "batched": {"s": bat_s, "tokens": bat_tokens}},
                                       indent=2))


if __name__ == "__main__":
    main()
