"""Where a speculative step's time goes (issue 18): bench_speculate.py's extraction rows (or
its essays), plain and with n-gram guesses (or the draft) forced on at every step, timed per
engine step and profiled (cProfile, host time: waits on the device show as mx.eval / tolist).

    python scripts/probe_spec_profile.py [extract|long|few] [ngram|draft] [K]
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_speculate import essays, extraction, questions  # noqa: E402

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)
from batchrun.engine.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.types import SamplingParams  # noqa: E402
from batchrun.models import DEMO_DRAFT_MODEL, DEMO_MODEL, load_model  # noqa: E402


def run(lm, chats, params, method, k, profile=None):
    config = EngineConfig(max_concurrency=8, speculate=method, draft_tokens=k, prefix_cache=False,
                          draft_model=str(DEMO_DRAFT_MODEL) if method == "draft" else None)
    engine = Engine(lm.model, lm.tokenizer, config, lm.context_length)
    if engine.speculator is not None:
        engine.speculator.adaptive = False
    for c in chats:
        engine.add_request(messages=c, params=params)
    steps, start = 0, time.perf_counter()
    if profile:
        profile.enable()
    while engine.has_work():
        engine.step()
        steps += 1
    if profile:
        profile.disable()
    wall = time.perf_counter() - start
    s = engine.stats.speculation
    return wall, steps, engine.stats.completion_tokens, s.accepted, s.proposed


def main() -> None:
    workload = sys.argv[1] if len(sys.argv) > 1 else "extract"
    method = sys.argv[2] if len(sys.argv) > 2 else "ngram"
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    lm = load_model(str(DEMO_MODEL))
    chats = {"extract": extraction, "long": essays,
             "few": lambda n: questions(n, tools=False)}[workload](8)
    params = SamplingParams(max_tokens=128 if workload == "extract" else 256)
    run(lm, chats, params, method, k)  # warm-up
    for name, m in (("plain", "off"), (method, method), ("plain", "off"), (method, method)):
        wall, steps, tokens, kept, proposed = run(lm, chats, params, m, k)
        print(f"{name:6} {wall * 1e3:7.1f} ms, {steps} engine steps ({wall / steps * 1e3:.2f} ms "
              f"a step), {tokens} tokens, kept {kept} of {proposed}", flush=True)
    for m in ("off", method):
        profile = cProfile.Profile()
        run(lm, chats, params, m, k, profile)
        print(f"--- profile: {m}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
