"""What the job loop's per-row work costs while the feeder's threads build rows (issue 13;
BENCHMARKS.md, session 10): the loop's hashing of a 1.7k-token prompt releases the GIL, and the
loop then waits for the building threads to hand it back.

    python scripts/probe_submit_gil.py [--threads 8]

400 labeling rows (a ~1,000-token instruction, the demo tokenizer): ms a row for engine.add_tokens
with the whole prompt hashed in the loop (as before: _prompt_digest there) and without it (as
now: the digest comes with the row), with no building thread and with --threads of them
tokenizing rows all along.
"""

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)

# isort: split
import orjson  # noqa: E402
from bench_labeling import write_rows  # noqa: E402

from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.request import EngineConfig, SamplingParams  # noqa: E402
from batchrun.job.runner import _payload_key, _prompt_digest  # noqa: E402
from batchrun.models import RANDOM_DEMO_MODEL, load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        write_rows(path, 400, 1000)
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    lm = load_model(str(RANDOM_DEMO_MODEL))
    tokenizer = lm.tokenizer

    def build(row):
        return tokenizer.apply_chat_template(row["messages"], tokenize=True,
                                             add_generation_prompt=True)

    prompts = [build(r) for r in rows]
    stop = threading.Event()

    def builder():
        i = 0
        while not stop.is_set():
            build(rows[i % len(rows)])
            i += 1

    def loop_ms(hashing: bool) -> float:
        engine = Engine(lm.model, tokenizer, EngineConfig(max_concurrency=1024),
                        lm.context_length)
        start = time.perf_counter()
        for p in prompts:
            if hashing:
                _payload_key(_prompt_digest(p), SamplingParams(max_tokens=8))
            engine.add_tokens(p, SamplingParams(max_tokens=8))
        return (time.perf_counter() - start) / len(prompts) * 1e3

    for n in (0, args.threads):
        stop.clear()
        threads = [threading.Thread(target=builder, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        print(f"{n} building threads: {loop_ms(True):.3f} ms a row hashing the prompt in the "
              f"loop, {loop_ms(False):.3f} without", flush=True)
        stop.set()
        for t in threads:
            t.join()


if __name__ == "__main__":
    main()
