"""What a speculative step's parts cost on this machine, and speculation on a few rows with the
draft forced on (issue 18; BENCHMARKS.md "Speculative decoding").

    python scripts/probe_speculation.py costs   # forwards by tokens a row, draft forwards, roll
    python scripts/probe_speculation.py rows    # 1, 2, 4, 8 greedy questions, 3 reps each

costs: the trained demo pair on 8 rows after a 100-token context: a target forward of L tokens a
row (L = 1, 2, 4, 7) and a draft forward, each evaluated with its argmax, 50 times, mean ms; and
rolling 12 batch-cache arrays (8 rows x 4 heads x 256 slots x 48) by per-row shifts, as
speculate.rollback does for 6 layers' keys and values. rows: the engine alone, the sample
questions without the weather-tool rows, max_tokens 256; plain, the draft forced on with 4 and
6 guesses (every narrow step speculates), the draft measured per width (the default); median
of three, as speedups over plain.
"""

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
from mlx_lm.models.cache import BatchKVCache  # noqa: E402

from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.request import EngineConfig, SamplingParams  # noqa: E402
from batchrun.engine.speculate import rollback  # noqa: E402
from batchrun.models import DEMO_DRAFT_MODEL, DEMO_MODEL, load_model  # noqa: E402


def forward_ms(model, rows: int, tokens: int, context: int = 100, reps: int = 50) -> float:
    caches = [BatchKVCache([0] * rows) for _ in model.layers]
    model(mx.zeros((rows, context), mx.uint32), cache=caches)
    mx.eval([c.state for c in caches])
    x = mx.ones((rows, tokens), mx.uint32)
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(mx.argmax(model(x, cache=caches), -1))
        for c in caches:
            c.trim(tokens)
    return (time.perf_counter() - start) / reps * 1e3


def roll_ms(reps: int = 50) -> float:
    caches = []
    for _ in range(6):
        c = BatchKVCache([0] * 8)
        kv = mx.random.normal((8, 4, 160, 48))
        c.update_and_fetch(kv, kv)  # 256 slots
        caches.append(c)
    mx.eval([c.state for c in caches])
    start = time.perf_counter()
    for _ in range(reps):
        rollback(caches, [0, 1, 2, 3, 4, 4, 2, 0])
        mx.eval([c.state for c in caches])
    return (time.perf_counter() - start) / reps * 1e3


def costs() -> None:
    target, draft = load_model(str(DEMO_MODEL)), load_model(str(DEMO_DRAFT_MODEL))
    for tokens in (1, 2, 4, 7):
        print(f"8 rows, {tokens} tokens a row: target {forward_ms(target.model, 8, tokens):.2f} "
              f"ms, draft {forward_ms(draft.model, 8, tokens):.2f} ms")
    print(f"rolling 6 layers' keys and values of 8 rows: {roll_ms():.2f} ms")


def rows() -> None:
    from bench_speculate import questions

    lm = load_model(str(DEMO_MODEL))
    chats = questions(8, tools=False)
    systems = {"plain": ("off", 4, True), "draft4 forced": ("draft", 4, False),
               "draft6 forced": ("draft", 6, False), "draft4 measured": ("draft", 4, True)}

    def run(n, method, k, adaptive):
        config = EngineConfig(max_concurrency=8, speculate=method, draft_tokens=k,
                              draft_model=str(DEMO_DRAFT_MODEL) if method == "draft" else None,
                              prefix_cache=False)
        engine = Engine(lm.model, lm.tokenizer, config, lm.context_length)
        if engine.speculator:
            engine.speculator.adaptive = adaptive
        for chat in chats[:n]:
            engine.add_request(messages=chat, params=SamplingParams(max_tokens=256))
        start = time.perf_counter()
        engine.run()
        return time.perf_counter() - start

    for n in (1, 2, 4, 8):
        walls = {name: [] for name in systems}
        for _ in range(3):
            for name, system in systems.items():
                walls[name].append(run(n, *system))
        base = statistics.median(walls["plain"])
        print(f"{n} rows: " + ", ".join(f"{name} {base / statistics.median(w):.2f}x"
                                        for name, w in walls.items()))


if __name__ == "__main__":
    {"costs": costs, "rows": rows}[sys.argv[1]]()
