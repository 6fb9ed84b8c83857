"""Run a batch job: rows in, one result or one error record out per row, in input order.

Data flows one way: reader -> feeder (parse, render, tokenize) -> engine -> ordered writer.
The feeder keeps the engine's queue full while rows remain, so the running batch stays at its
concurrency limit until the input runs out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from tqdm import tqdm

from batchrun.engine.engine import Engine
from batchrun.engine.request import FinishReason, Output
from batchrun.io.jsonl import RawRow, open_binary, read_jsonl
from batchrun.io.results import OrderedWriter
from batchrun.job.feeder import Feeder
from batchrun.job.rows import RowError, RowOptions, Task, build_task

PROGRESS_INTERVAL_S = 0.5


@dataclass(slots=True)
class JobPaths:
    job_dir: Path
    output: Path

    @property
    def errors(self) -> Path:
        return self.job_dir / "errors.jsonl"

    @classmethod
    def for_input(cls, input_path: Path, job_dir: Path | None, output: Path | None) -> JobPaths:
        job_dir = job_dir or Path("jobs") / input_stem(input_path)
        return cls(job_dir, output or job_dir / "results.jsonl")


def input_stem(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl.gz", ".jsonl", ".parquet", ".toml", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


@dataclass(slots=True)
class JobSummary:
    rows_total: int = 0
    rows_done: int = 0
    rows_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    errors: list[RowError] = field(default_factory=list)


def count_rows(path: Path) -> int:
    with open_binary(path) as f:
        return sum(1 for line in f if line.strip())


class JobRunner:
    def __init__(self, engine: Engine, input_path: Path, paths: JobPaths, rows: RowOptions,
                 quiet: bool = False):
        self.engine = engine
        self.input_path = input_path
        self.paths = paths
        self.rows = rows
        self.quiet = quiet
        self.summary = JobSummary()
        self._pending: dict[int, Task] = {}

    def run(self) -> JobSummary:
        self.paths.job_dir.mkdir(parents=True, exist_ok=True)
        self.paths.output.parent.mkdir(parents=True, exist_ok=True)
        self.summary.rows_total = count_rows(self.input_path)
        started = time.perf_counter()
        engine = self.engine
        target = engine.max_concurrency + engine.config.prefill_batch_size
        feeder = Feeder(read_jsonl(self.input_path), self._build, lookahead=2 * target)
        writer = OrderedWriter(self.paths.output, mode="wb")
        errors = open(self.paths.errors, "wb")
        bar = tqdm(total=self.summary.rows_total, unit="row", disable=self.quiet,
                   dynamic_ncols=True, smoothing=0.1)
        last = 0.0
        try:
            while True:
                wanted = target - engine.num_waiting
                for item in feeder.take(wanted, block=not engine.has_work()):
                    if isinstance(item, RowError):
                        self._fail(item, writer, errors)
                        bar.update(1)
                    else:
                        self._pending[engine.add_tokens(item.prompt_ids, item.params)] = item
                if not engine.has_work() and feeder.exhausted:
                    break
                for out in engine.step():
                    self._finish(out, writer, errors)
                    bar.update(1)
                now = time.perf_counter()
                if now - last >= PROGRESS_INTERVAL_S:
                    last = now
                    bar.set_postfix_str(self._rates(now - started), refresh=False)
        finally:
            feeder.close()
            writer.close()
            errors.close()
            bar.close()
        self.summary.wall_s = time.perf_counter() - started
        return self.summary

    def _build(self, raw: RawRow) -> Task | RowError:
        if raw.error is not None:
            return RowError(raw.index, raw.line, str(raw.index), "invalid_json", raw.error)
        return build_task(raw.value, raw.index, raw.line, self.engine.prompts, self.rows)

    def _finish(self, out: Output, writer: OrderedWriter, errors) -> None:
        task = self._pending.pop(out.request_id)
        if out.finish_reason is FinishReason.ERROR:
            self._fail(RowError(task.index, task.line, task.custom_id, "request_failed",
                                out.error or "failed"), writer, errors)
            return
        self.summary.rows_done += 1
        self.summary.prompt_tokens += out.prompt_tokens
        self.summary.completion_tokens += out.completion_tokens
        writer.put(task.index, orjson.dumps(result_record(task, out)) + b"\n")

    def _fail(self, error: RowError, writer: OrderedWriter, errors) -> None:
        self.summary.rows_failed += 1
        self.summary.errors.append(error)
        errors.write(orjson.dumps(error_record(error)) + b"\n")
        writer.skip(error.index)

    def _rates(self, elapsed: float) -> str:
        stats = self.engine.stats
        tokens = self.engine.generated_tokens
        return (f"{tokens / elapsed:,.0f} tok/s, batch {self.engine.num_running}, "
                f"mean batch {stats.mean_batch_size:.1f}")


def result_record(task: Task, out: Output) -> dict:
    record = {
        "custom_id": task.custom_id,
        "index": task.index,
        "text": out.text,
        "finish_reason": out.finish_reason.value,
        "usage": {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
        },
    }
    if out.logprobs is not None:
        record["logprobs"] = out.logprobs
    return record


def error_record(error: RowError) -> dict:
    return {
        "custom_id": error.custom_id,
        "index": error.index,
        "line": error.line,
        "error": {"code": error.code, "message": error.message},
    }
