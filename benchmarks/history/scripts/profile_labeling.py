"""Where a labeling job's time and memory go, in one process: the engine's steps one by one.

    python scripts/profile_labeling.py OUT_DIR [--model PATH] [--rows 512] [--max-tokens 8]
        [--variants default,step256,...] [--profile]

The `labeling` workload of `batchrun bench` (a shared ~1,000-token prefix, 12-40 tokens a row).
After a warm-up, the careful mlx-lm user (the prefix prefilled once, copied into every row), then
for each variant a cold run (empty prefix-cache folder) and a warm run (a new cache over the
filled folder). Each engine step is recorded: wall time, whether it ran prompt work, the running
batch, memory before and its peak. Variants change one engine knob (VARIANTS). With --profile,
one more warm run under cProfile (top functions by own time). Writes OUT_DIR/profile.json and
prints a summary.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

import batchrun.engine.shared_prefix as shared_prefix  # noqa: E402
from batchrun.bench import make_workload, run_hand_cached, warm_up  # noqa: E402
from batchrun.cache import make_prefix_cache  # noqa: E402
from batchrun.cache.layout import block_layout  # noqa: E402
from batchrun.engine import text as text_backend  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.request import EngineConfig, SamplingParams  # noqa: E402
from batchrun.models import load_model  # noqa: E402


def knob(key: str) -> tuple:
    """(module, attribute name) of a variant's key."""
    module, _, name = key.rpartition(".")
    return {"": shared_prefix, "text": text_backend}[module], name


# name -> {attribute: value} set for that variant's runs: shared_prefix's, or "text.NAME"
# for the text backend's (engine/text.py)
VARIANTS = {
    "default": {},
    "notails": {"text.SHARED_TAILS": False},  # rows compute what they share past blocks
    "step256": {"OWN_STEP": 256},  # mlx-lm's own step for the rows' KV
    "chunks64m": {"MAX_SCORE_ELEMENTS": 1 << 26},
    "chunks4m": {"MAX_SCORE_ELEMENTS": 1 << 22},
    "unbounded": {"EVAL_CHUNKS_ABOVE": 1 << 62},  # the lazy graph holds every chunk
    "chunks16m": {"EVAL_CHUNK_ELEMENTS": 1 << 24},  # smaller evaluated chunks, more syncs
    "chunks128m": {"EVAL_CHUNK_ELEMENTS": 1 << 27},
    "async": {"ASYNC_CHUNKS": True},  # chunks scheduled without waiting for each
    "lowp": {"LOW_PRECISION_SCORES": True},  # bf16 scores and weights, float32 statistics
    "lowp_async": {"LOW_PRECISION_SCORES": True, "ASYNC_CHUNKS": True},
    "lowp_64m": {"LOW_PRECISION_SCORES": True, "EVAL_CHUNK_ELEMENTS": 1 << 26},
    "async_window4": {"ASYNC_CHUNKS": True, "ASYNC_WINDOW": 4},
    "lowp_async_window4": {"LOW_PRECISION_SCORES": True, "ASYNC_CHUNKS": True,
                           "ASYNC_WINDOW": 4},
    "lowp_async_128m": {"LOW_PRECISION_SCORES": True, "ASYNC_CHUNKS": True,
                        "EVAL_CHUNK_ELEMENTS": 1 << 27},
}


def gib(n: int) -> float:
    return round(n / 2**30, 3)


def run(lm, prompts, max_tokens: int, folder: Path, config: EngineConfig) -> dict:
    cache = make_prefix_cache(lm.fingerprint, 1 << 30, folder, layout=block_layout(lm.model))
    engine = Engine(lm.model, lm.tokenizer, config, lm.context_length, prefix_cache=cache,
                    model_fingerprint=lm.fingerprint)
    steps = []
    backend_next = engine.backend.next

    def timed_next():
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        prompt_work, out = backend_next()
        mx.synchronize()
        steps.append({"s": round(time.perf_counter() - start, 5), "prompt": prompt_work,
                      "running": len(engine.scheduler.running), "active_gib": gib(before),
                      "peak_gib": gib(mx.get_peak_memory())})
        return prompt_work, out

    engine.backend.next = timed_next
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_tokens(prompt, SamplingParams(max_tokens=max_tokens))
    outs = engine.run()
    wall = time.perf_counter() - start
    s = engine.stats
    engine.close()
    return {"wall_s": round(wall, 3), "rows_per_s": round(len(prompts) / wall, 1),
            "steps": len(steps), "in_backend_s": round(sum(x["s"] for x in steps), 3),
            "prompt_steps_s": round(sum(x["s"] for x in steps if x["prompt"]), 3),
            "decode_steps_s": round(sum(x["s"] for x in steps if not x["prompt"]), 3),
            "prefill_time_s": round(s.prefill_time, 3), "mean_batch": round(
                s.mean_batch_size, 1), "peak_gib": max((x["peak_gib"] for x in steps),
                                                       default=0.0),
            "cached_tokens": s.cached_tokens, "completion_tokens": sum(
                o.completion_tokens for o in outs), "step_log": steps,
            "tokens": [o.token_ids for o in sorted(outs, key=lambda o: o.request_id)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--variants", default="default")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lm = load_model(args.model)
    w = make_workload(lm.tokenizer, "labeling", args.rows, args.max_tokens)
    config = EngineConfig(max_concurrency=args.max_concurrency)
    warm_up(lm, w)
    result: dict = {"rows": args.rows, "device": str(mx.default_device()),
                    "weights_gib": gib(mx.get_active_memory())}
    mx.reset_peak_memory()
    peer = run_hand_cached(lm, w, args.max_concurrency or args.rows)
    result["peer"] = {"wall_s": round(peer.wall_s, 3), "peak_gib": gib(mx.get_peak_memory())}
    print(f"peer: {peer.wall_s:.3f} s, peak {result['peer']['peak_gib']} GiB", flush=True)
    defaults = {k: getattr(*knob(k)) for v in VARIANTS.values() for k in v}
    first = None  # the first run's tokens: every other run is compared with them
    for name in args.variants.split(","):
        for key, value in {**defaults, **VARIANTS[name]}.items():
            setattr(*knob(key), value)
        with tempfile.TemporaryDirectory() as folder:
            for phase in ("cold", "warm"):
                r = run(lm, w.prompts, args.max_tokens, Path(folder), config)
                tokens = r.pop("tokens")
                first = first or tokens
                r["rows_differing_from_first_run"] = sum(
                    a != b for a, b in zip(tokens, first, strict=True))
                result[f"{name}/{phase}"] = r
                print(f"{name}/{phase}: " + ", ".join(f"{k} {v}" for k, v in r.items()
                                                      if k != "step_log"), flush=True)
            if args.profile and name == "default":
                profiler = cProfile.Profile()
                profiler.enable()
                run(lm, w.prompts, args.max_tokens, Path(folder), config)
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
                (args.out / "profile-warm.txt").write_text(text.getvalue())
                print(text.getvalue()[:6000], flush=True)
    for key, value in defaults.items():
        setattr(shared_prefix, key, value)
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
