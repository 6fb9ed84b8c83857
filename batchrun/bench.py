"""Side-by-side throughput: the same rows through sequential mlx-lm, mlx-lm's batch_generate,
and batchrun's engine, in one process, on one model. Reported as ratios; absolute numbers only
mean something on the machine that produced them.
"""

from __future__ import annotations

import platform
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from batchrun.cache import make_prefix_cache
from batchrun.cache.layout import block_layout
from batchrun.engine.backends.tokens import common_length
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import SamplingParams
from batchrun.models import LoadedModel, load_model
from batchrun.models.random_model import SHAPES, build, corpus
from batchrun.models.weights import WeightPlan, plan_and_apply


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


ENGINE_OPTIONS: dict = {}  # more EngineConfig fields for batchrun's runs (the CLI's flags)

WORKLOADS = {
    # name: (prompt tokens low, high, new tokens low, high or None for --max-tokens)
    "short": (16, 32, None),
    "mixed": (8, 1500, (16, 256)),
    "mixed512": (8, 512, None),
    "labeling": (None, None, None),
}


def make_workload(tokenizer, name: str, rows: int, max_tokens: int, seed: int = 0) -> Workload:
    """Prompts cut from the synthetic corpus: `short` 16-32 tokens; `mixed` 8-1,500 tokens with
    16-256 new tokens each; `mixed512` 8-512 tokens; `labeling` a shared ~1,000-token
    instruction followed by a short row text."""
    rng = random.Random(seed)
    ids = [t for line in corpus(seed=seed + 1, n=20000)
           for t in tokenizer.encode(line + " ", add_special_tokens=False)]
    if name == "labeling":
        shared, prompts = ids[:1000], []
        for _ in range(rows):
            start = rng.randrange(1000, len(ids) - 40)
            prompts.append(shared + ids[start: start + rng.randint(12, 40)])
        return Workload(name, prompts, [max_tokens] * rows)
    low, high, new = WORKLOADS[name]
    prompts, new_tokens = [], []
    for _ in range(rows):
        n = rng.randint(low, high)
        start = rng.randrange(0, len(ids) - n)
        prompts.append(ids[start: start + n])
        new_tokens.append(rng.randint(*new) if new else max_tokens)
    return Workload(name, prompts, new_tokens)


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


def run_hand_cached(lm: LoadedModel, w: Workload, concurrency: int) -> Measurement:
    """A careful mlx-lm user: the prompts' common prefix prefilled once, a copy of its KV cache
    given to every row, and batch_generate over the rest of each prompt."""
    import copy

    from mlx_lm.generate import batch_generate
    from mlx_lm.models.cache import make_prompt_cache

    start = time.perf_counter()
    n = common_length(w.prompts)
    cache = make_prompt_cache(lm.model)
    if n:
        lm.model(mx.array(w.prompts[0][:n])[None], cache=cache)
        mx.eval([c.state for c in cache])
    out = batch_generate(lm.model, lm.tokenizer, [p[n:] for p in w.prompts],
                         prompt_caches=[copy.deepcopy(cache) for _ in w.prompts],
                         max_tokens=w.max_tokens, completion_batch_size=concurrency,
                         return_token_ids=True)
    return Measurement("mlx-lm batch_generate, prefix prefilled once", time.perf_counter() - start,
                       w.prompt_tokens, sum(len(t) for t in out.token_ids))


_planned: dict[str, tuple[LoadedModel, WeightPlan]] = {}


def planned(lm: LoadedModel) -> tuple[LoadedModel, WeightPlan]:
    """The model as batchrun's engine holds it (its weight plan, ENGINE_OPTIONS' `weights`):
    a second copy, loaded once, so that the mlx-lm systems run the model as loaded."""
    mode = ENGINE_OPTIONS.get("weights", "auto")
    key = f"{lm.path}:{mode}"
    if key not in _planned:
        copy = load_model(lm.path)
        _planned[key] = copy, plan_and_apply(copy.model, mode)
        if not _planned[key][1].changed:  # as loaded: the peers' copy serves
            _planned[key] = lm, _planned[key][1]
    return _planned[key]


def run_batchrun(lm: LoadedModel, w: Workload, concurrency: int, cache_dir: Path | None = None,
                 name: str = "batchrun engine", shared_prefix: bool = True) -> Measurement:
    """batchrun's engine; with `cache_dir`, a prefix cache backed by that folder."""
    lm, plan = planned(lm)
    cache = None
    if cache_dir is not None:
        cache = make_prefix_cache(plan.cache_key(lm.fingerprint), 1 << 30, cache_dir,
                                  layout=block_layout(lm.model))
    config = EngineConfig(max_concurrency=concurrency, shared_prefix=shared_prefix,
                          **ENGINE_OPTIONS)
    engine = Engine(lm.model, lm.tokenizer, config, lm.context_length, prefix_cache=cache,
                    model_fingerprint=lm.fingerprint, weight_plan=plan)
    start = time.perf_counter()
    for prompt, max_tokens in zip(w.prompts, w.max_tokens, strict=True):
        engine.add_tokens(prompt, SamplingParams(max_tokens=max_tokens))
    outs = engine.run()
    wall = time.perf_counter() - start
    engine.close()
    return Measurement(name, wall, w.prompt_tokens, sum(o.completion_tokens for o in outs))


def run_prefix_cold_warm(lm: LoadedModel, w: Workload, concurrency: int,
                         shared_prefix: bool = True) -> list[Measurement]:
    """A cold prefix cache (empty folder), then a warm one: a fresh in-memory cache over the
    folder the cold run filled, as a second process would see it."""
    how = "" if shared_prefix else ", a copy per row"
    with tempfile.TemporaryDirectory() as folder:
        cold = run_batchrun(lm, w, concurrency, Path(folder),
                            f"batchrun + prefix cache (cold{how})", shared_prefix)
        warm = run_batchrun(lm, w, concurrency, Path(folder),
                            f"batchrun + prefix cache (warm{how})", shared_prefix)
    return [cold, warm]


SYSTEMS = {
    "sequential": lambda lm, w, c: [run_sequential(lm, w)],
    "batch_generate": lambda lm, w, c: [run_batch_generate(lm, w, c)],
    "batchrun": lambda lm, w, c: [run_batchrun(lm, w, c)],
    "hand_cached": lambda lm, w, c: [run_hand_cached(lm, w, c)],
    "prefix": run_prefix_cold_warm,
    "prefix_copies": lambda lm, w, c: run_prefix_cold_warm(lm, w, c, shared_prefix=False),
}


def model_for(model: str | None, shape: str | None, cache_dir: Path,
              quantize: str = "none") -> LoadedModel:
    """The model to measure: `model`, or the random-weight `shape` (quantized as `quantize`
    says: families.QUANTIZATIONS), built once into `cache_dir`."""
    if shape:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        path = cache_dir / (f"shape-{shape}" + ("" if quantize == "none" else f"-{quantize}"))
        if not (path / "config.json").exists():
            build(path, shape, quantize=quantize)
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
        results.extend(SYSTEMS[name](lm, w, concurrency))
    return results


def table(results: list[Measurement], baseline: str = "mlx-lm stream_generate (sequential)"
          ) -> str:
    base = next((r for r in results if r.system == baseline), results[0])
    rows = [f"{'system':40} {'wall s':>8} {'gen tok/s':>10} {'all tok/s':>10} {'vs seq':>7}"]
    for r in results:
        rows.append(f"{r.system:40} {r.wall_s:8.2f} {r.tokens_per_s:10.1f} "
                    f"{r.total_tokens_per_s:10.1f} {base.wall_s / r.wall_s:6.2f}x")
    by = {r.system: r for r in results}
    if "mlx-lm batch_generate" in by:
        for r in results:
            if r.system.startswith("batchrun"):
                ratio = by["mlx-lm batch_generate"].wall_s / r.wall_s
                rows.append(f"{r.system} vs batch_generate: {ratio:.2f}x")
    return "\n".join(rows)


def machine() -> dict:
    import os

    from batchrun import blas

    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "device": str(mx.default_device()), "device_name": mx.device_info().get("device_name"),
            "blas": blas.activate().describe(), "date": time.strftime("%Y-%m-%d")}


def as_dict(results: list[Measurement]) -> list[dict]:
    return [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results]
