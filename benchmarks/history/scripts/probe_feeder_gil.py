"""How row building fares while another thread runs Python (as the engine's thread does): the
feeder's 512 labeling rows with 1, 2 and 8 build threads beside an idle, an MLX-bound and a
Python-bound thread; and one tokenizer call of each kind on a build thread beside a
Python-bound one (transformers' encode lets go of the GIL; the Rust tokenizer's single-text
encode does not).

    python scripts/probe_feeder_gil.py [--rows 512]
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

import mlx.core as mx  # noqa: E402
from bench_labeling import write_rows  # noqa: E402

from batchrun.engine.prompt import PromptBuilder  # noqa: E402
from batchrun.io.readers import read_rows  # noqa: E402
from batchrun.job.feeder import Feeder  # noqa: E402
from batchrun.job.rows import RowOptions, build_task  # noqa: E402
from batchrun.job.runner import _prompt_digest  # noqa: E402
from batchrun.models import load_model  # noqa: E402


def python_bound(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def mixed(stop: threading.Event) -> None:
    """Python, then an MLX evaluation (which lets go of the GIL), over and over."""
    a = mx.random.normal((256, 256))
    while not stop.is_set():
        x = 0
        for i in range(3000):
            x += i
        for _ in range(5):
            a = mx.tanh(a @ a * 1e-3)
        mx.eval(a)


def beside(kind, work) -> float:
    """Seconds `work` takes on a thread of its own beside a `kind` thread (None: alone)."""
    stop, seconds = threading.Event(), []
    other = threading.Thread(target=kind, args=(stop,)) if kind else None
    if other:
        other.start()
        time.sleep(0.01)

    def timed():
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)

    worker = threading.Thread(target=timed)
    worker.start()
    worker.join()
    stop.set()
    if other:
        other.join()
    return seconds[0]


def feed(path: Path, rows: int, tokenizer, workers: int) -> None:
    """The feeder builds every row (a fresh tokenizer cache: as a job starts)."""
    prompts = PromptBuilder(tokenizer)

    def build(raw):
        task = build_task(raw.value, raw.index, raw.line, prompts, RowOptions())
        task.prompt_digest = _prompt_digest(task.prompt_ids)
        return task

    feeder = Feeder(read_rows(path, 0), build, lookahead=4 * rows, workers=workers)
    n = 0
    while n < rows:
        n += len(feeder.take(rows, True, 0.0))
    feeder.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    args = ap.parse_args()
    lm = load_model(None)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rows.jsonl"
        write_rows(path, args.rows, 1000)
        for name, kind in (("idle", None), ("mixed", mixed), ("python", python_bound)):
            for workers in (1, 2, 8):
                seconds = beside(kind, lambda w=workers: feed(path, args.rows, lm.tokenizer, w))
                print(f"feeder beside a {name} thread, {workers} build threads: "
                      f"{seconds:.3f} s", flush=True)
        prompts = PromptBuilder(lm.tokenizer)
        texts = [prompts.render(raw.value["messages"])[-200:] for raw in read_rows(path, 0)]
        tokenizer = lm.tokenizer
        backend = tokenizer.backend_tokenizer
        calls = {
            "transformers' encode": lambda: [tokenizer.encode(t, add_special_tokens=False)
                                             for t in texts],
            "the Rust tokenizer's encode": lambda: [backend.encode(t, add_special_tokens=False)
                                                    for t in texts],
        }
        for name, work in calls.items():
            print(f"{len(texts)} x {name}: alone {beside(None, work) * 1e3:.1f} ms, beside a "
                  f"Python-bound thread {beside(python_bound, work) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
