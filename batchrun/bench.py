"""Side-by-side throughput: the same rows through sequential mlx-lm, mlx-lm's batch_generate,
and batchrun's engine, in one process, on one model. Reported as ratios; absolute numbers only
mean something on the machine that produced them.
"""

from __future__ import annotations

import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from batchrun.engine.engine import Engine
from batchrun.engine.request import EngineConfig, SamplingParams
from batchrun.models import LoadedModel, load_model
from batchrun.models.build import SHAPES, build, corpus


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass(slots=True)
class Measurement:
    system: str
    wall_s: float
    prompt_tokens: int
    completion_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.completion_tokens) / self.wall_s


def make_workload(tokenizer, name: str, rows: int, max_tokens: int, seed: int = 0) -> Workload:
    """Prompts cut from the synthetic corpus; `mixed`: 8-512 prompt tokens, `short`: 16-32."""
    rng = random.Random(seed)
    ids = [t for line in corpus(seed=seed + 1, n=20000)
           for t in tokenizer.encode(line + " ", add_special_tokens=False)]
    low, high = {"mixed": (8, 512), "short": (16, 32)}[name]
    prompts = []
    for _ in range(rows):
        n = rng.randint(low, high)
        start = rng.randrange(0, len(ids) - n)
        prompts.append(ids[start: start + n])
    return Workload(name, prompts, [max_tokens] * rows)


def run_sequential(lm: LoadedModel, w: Workload) -> Measurement:
    from mlx_lm.generate import stream_generate

    start = time.perf_counter()
    completion = 0
    for prompt, max_tokens in zip(w.prompts, w.max_tokens, strict=True):
        *_, last = stream_generate(lm.model, lm.tokenizer, prompt, max_tokens=max_tokens)
        completion += last.generation_tokens - (last.finish_reason == "stop")  # EOS not counted
    return Measurement("mlx-lm stream_generate (sequential)", time.perf_counter() - start,
                       w.prompt_tokens, completion)


def run_batch_generate(lm: LoadedModel, w: Workload, concurrency: int) -> Measurement:
    from mlx_lm.generate import batch_generate

    start = time.perf_counter()
    out = batch_generate(lm.model, lm.tokenizer, w.prompts, max_tokens=w.max_tokens,
                         completion_batch_size=concurrency, return_token_ids=True)
    completion = sum(len(t) for t in out.token_ids)
    return Measurement("mlx-lm batch_generate", time.perf_counter() - start, w.prompt_tokens,
                       completion)


def run_batchrun(lm: LoadedModel, w: Workload, concurrency: int) -> Measurement:
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=concurrency),
                    lm.context_length)
    start = time.perf_counter()
    for prompt, max_tokens in zip(w.prompts, w.max_tokens, strict=True):
        engine.add_tokens(prompt, SamplingParams(max_tokens=max_tokens))
    outs = engine.run()
    wall = time.perf_counter() - start
    engine.close()
    return Measurement("batchrun engine", wall, w.prompt_tokens,
                       sum(o.completion_tokens for o in outs))


SYSTEMS = {
    "sequential": lambda lm, w, c: run_sequential(lm, w),
    "batch_generate": run_batch_generate,
    "batchrun": run_batchrun,
}


def model_for(model: str | None, shape: str | None, cache_dir: Path) -> LoadedModel:
    if shape:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        path = cache_dir / f"shape-{shape}"
        if not (path / "config.json").exists():
            build(path, shape)
        return load_model(str(path))
    return load_model(model)


def warm_up(lm: LoadedModel, w: Workload) -> None:
    """Compile kernels and fault in weights before any system is timed."""
    short = Workload("warmup", w.prompts[:4], [4] * min(4, len(w.prompts)))
    run_batchrun(lm, short, 4)
    run_sequential(lm, Workload("warmup", w.prompts[:1], [4]))


def benchmark(lm: LoadedModel, w: Workload, systems: list[str], concurrency: int
              ) -> list[Measurement]:
    warm_up(lm, w)
    results = []
    for name in systems:
        mx.clear_cache()
        results.append(SYSTEMS[name](lm, w, concurrency))
    return results


def table(results: list[Measurement], baseline: str = "mlx-lm stream_generate (sequential)"
          ) -> str:
    base = next((r for r in results if r.system == baseline), results[0])
    rows = [f"{'system':40} {'wall s':>8} {'gen tok/s':>10} {'all tok/s':>10} {'vs seq':>7}"]
    for r in results:
        rows.append(f"{r.system:40} {r.wall_s:8.2f} {r.tokens_per_s:10.1f} "
                    f"{r.total_tokens_per_s:10.1f} {base.wall_s / r.wall_s:6.2f}x")
    by = {r.system: r for r in results}
    if "mlx-lm batch_generate" in by and "batchrun engine" in by:
        ratio = by["mlx-lm batch_generate"].wall_s / by["batchrun engine"].wall_s
        rows.append(f"batchrun vs batch_generate: {ratio:.2f}x")
    return "\n".join(rows)


def machine() -> dict:
    import os

    from batchrun import blas

    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "device": str(mx.default_device()), "device_name": mx.device_info().get("device_name"),
            "blas": blas.activate().describe(), "date": time.strftime("%Y-%m-%d")}


def as_dict(results: list[Measurement]) -> list[dict]:
    return [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results]
