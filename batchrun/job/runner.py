"""Run a batch job: every input row ends as exactly one result or one error record, in input
order, across crashes and restarts.

Data flows one way: reader -> feeder (parse, render, tokenize) -> engine -> ordered sink ->
committed state. The feeder keeps the engine's queue full while rows remain. Identical requests
(same prompt tokens and sampling) are computed once. The sink writes records in input order and
`JobState.commit` makes a prefix durable; a restart truncates to it and resumes after it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import signal
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
from tqdm import tqdm

from batchrun.engine.engine import Engine
from batchrun.engine.types import FinishReason, Output
from batchrun.io.files import remove_stale_temps
from batchrun.io.jsonl import InputError, RawRow
from batchrun.io.parquet_output import ParquetOutput
from batchrun.io.readers import read_rows
from batchrun.job import manifest as mf
from batchrun.job import ownership
from batchrun.job import report as rp
from batchrun.job.committer import BackgroundCommits
from batchrun.job.errors import Interrupted, JobConflict, JobError, stop_signals
from batchrun.job.feeder import Feeder
from batchrun.job.records import error_record, result_record
from batchrun.job.recovery import recover
from batchrun.job.rows import (
    RowError,
    RowOptions,
    Task,
    build_task,
    explicit_id,
    is_openai_line,
    read_error,
    row_id,
)
from batchrun.job.sink import OrderedSink, PendingCommit, Record, make_durable
from batchrun.job.spec import JobSpec, check_paths, check_same_job, input_is_openai, saved_manifest
from batchrun.job.state import DamagedFile, JobLock, JobState, Progress

log = logging.getLogger("batchrun")
COMMIT_INTERVAL_S = 1.0
# Commits (fsyncs, state.json, the report) run beside the engine (job/committer.py) and keep the
# disk busy at most about this share of a job's time: where one takes long (a network disk:
# 1.3-2.3 s measured on the H200 host), they come less often.
COMMIT_SHARE = 0.25
FILL_LINGER_S = 0.05  # an idle engine takes more rows while each comes within this of the last
PROGRESS_INTERVAL_S = 0.5
# Ctrl-C, a stop request, and the terminal closing (SIGHUP): each stops the job resumably.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DONE_CACHE_SIZE = 4096  # recent outputs kept for identical rows further down the input
# Threads that build rows, text and image rows alike. Tokenization keeps the GIL
# (engine/backends/tokens.py's Encoder), so more threads only contend for it with the job loop
# and the warm-up: warm 512-row labeling jobs on the H200 took 0.846-1.111 s (median 0.984)
# with one and 0.891-1.171 s (1.009) with eight (benchmarks/history/BENCHMARKS-2026-12.md).
BUILD_WORKERS = 1
HASH_PIECE = 2032  # bytes hashlib hashes holding the GIL (it lets go from 2,048 on)


class RowWork:
    """Rows -> engine requests -> records: identical requests computed once, n samples per row,
    one result or error record per row. Shared by the single-machine runner and Ray workers
    (job/distributed.py); the owner sets `engine`, `row_options`, `model_name` and `created`."""

    engine: Engine
    row_options: RowOptions
    model_name: str
    created: int
    # The input is an OpenAI batch file: a row that cannot be read gets that file's error shape
    openai_input: bool = False
    job_id: str | None = None  # the job's, so its error records' ids are its own

    def _init_work(self) -> None:
        # engine request id -> (task, sample index) pairs awaiting it
        self._pending: dict[int, list[tuple[Task, int]]] = {}
        self._samples: dict[int, list[Output | None]] = {}  # row index -> its samples so far
        self._inflight: dict[bytes, int] = {}  # payload hash -> engine request id
        self._request_key: dict[int, bytes] = {}
        self._done: OrderedDict[bytes, Output] = OrderedDict()
        self.deduplicated = 0
        self.models_requested: Counter[str] = Counter()  # OpenAI rows' body.model, answered
        self._read_ahead = threading.Event()  # the first row's cached blocks asked for
        # The lowest-indexed row built in this start: (index, its prompt's token ids), for the
        # report's "the prompt the model sees" (decoded at a commit, not on the builders).
        self._first_prompt: tuple[int, list[int]] | None = None
        self._first_text: dict | None = None

    def _build_task(self, raw: RawRow) -> Task | RowError:
        task = build_task(raw.value, raw.index, raw.line, self.engine.prompts, self.row_options)
        if isinstance(task, Task):
            task.prompt_digest = _prompt_digest(
                task.prompt_ids, task.vision.digests if task.vision is not None else ())
            first = self._first_prompt
            if first is None or raw.index < first[0]:  # builders race: the lowest index wins
                self._first_prompt = (raw.index, task.prompt_ids)
            if task.vision is None and not self._read_ahead.is_set():
                # The job's first row (a labeling job's shared instruction): its cached blocks
                # are read from disk while the engine warms up, not after.
                self._read_ahead.set()
                self.engine.read_ahead(task.prompt_ids)
        return task

    def _submit(self, item: Task | RowError, sink, bar) -> None:
        if isinstance(item, RowError):
            self._write_error(item, sink, openai=item.openai)
            bar.update(1)
            return
        self._samples[item.index] = [None] * item.samples
        for sample, params in enumerate(item.sample_params()):
            self._submit_sample(item, sample, params, sink, bar)

    def _submit_sample(self, task: Task, sample: int, params, sink, bar) -> None:
        prompt = task.sample_prompt(sample)
        digest = (task.prompt_digest if prompt is task.prompt_ids else b"") or _prompt_digest(
            prompt, task.vision.digests if task.vision is not None else ())
        key = _payload_key(digest, params)
        if key in self._done:  # identical to a recent request: reuse its output
            self._done.move_to_end(key)
            self.deduplicated += 1
            self._deliver(task, sample, self._done[key], sink, bar)
        elif key in self._inflight:  # identical to a request being computed: wait for it
            self.deduplicated += 1
            self._pending[self._inflight[key]].append((task, sample))
        else:
            request_id = self.engine.add_tokens(prompt, params, task.vision)
            self._pending[request_id] = [(task, sample)]
            self._inflight[key] = request_id
            self._request_key[request_id] = key

    def _finish(self, out: Output, sink, bar) -> None:
        waiting = self._pending.pop(out.request_id)
        key = self._request_key.pop(out.request_id)
        del self._inflight[key]
        if out.finish_reason is not FinishReason.ERROR:
            self._done[key] = out
            if len(self._done) > DONE_CACHE_SIZE:
                self._done.popitem(last=False)
        for task, sample in waiting:
            self._deliver(task, sample, out, sink, bar)

    def _deliver(self, task: Task, sample: int, out: Output, sink, bar) -> None:
        """One sample of a row is done; the row is written when all its samples are."""
        outs = self._samples[task.index]
        outs[sample] = out
        if all(o is not None for o in outs):
            del self._samples[task.index]
            self._write(task, outs, sink)
            bar.update(1)

    def _write(self, task: Task, outs: list[Output], sink) -> None:
        problem = _row_problem(task, outs)
        if problem is not None:
            code, message = problem
            self._write_error(RowError(task.index, task.line, task.custom_id, code, message),
                              sink, openai=task.openai is not None)
            return
        served = self.row_options.served_model_names
        record = result_record(task, outs, served[0] if served else self.model_name,
                               self.created, self._token_bytes, self.engine.markup)
        if task.model is not None:
            self.models_requested[task.model] += 1
        sink.put(task.index, orjson.dumps(record) + b"\n", is_error=False, outs=outs)

    def _token_bytes(self, token: int) -> bytes:
        return self.engine.grammars.token_bytes(token)  # built on first use

    def _write_error(self, error: RowError, sink, openai: bool | None) -> None:
        # A row nothing of which could be read takes the shape of the input's rows
        shape = self.openai_input if openai is None else openai
        record = error_record(error, shape, self.job_id or self.created)
        sink.put(error.index, orjson.dumps(record) + b"\n", is_error=True)



FIRST_PROMPT_TOKENS = 2048  # of the first row's prompt the report keeps


class JobRunner(RowWork):
    def __init__(self, engine: Engine, spec: JobSpec, model_name: str, model_path: str,
                 device: str):
        self.engine = engine
        self.spec = spec
        self.model_name = model_name
        self.model_path = model_path
        self.device = device
        self._write_cost = 0.0  # seconds one atomic write took (prepare)
        if spec.rows.base_dir == Path("."):  # relative image paths start at the input's folder
            spec.rows.base_dir = spec.input.resolve().parent
        self.state = JobState(spec.job_dir, spec.results_path, spec.errors_path)
        self.lock = JobLock(spec.job_dir)
        self.rows_total = 0
        self.manifest: dict = {}
        self.report: dict = {}
        self._init_work()
        self._interrupted = 0  # the signal (STOP_SIGNALS) that asked the job to stop
        self._seen_ids: dict[bytes, int] = {}  # hash of an explicit row id -> its first line
        self._spilled: dict[int, Record] = {}  # rows finished past the frontier, from the spill
        self._digests: tuple = ()  # recovery's running digests of the ordered files
        self._parquet: ParquetOutput | None = None  # -o *.parquet, written as rows commit

    # -- set-up ---------------------------------------------------------------------------------

    def check_paths(self) -> None:
        check_paths(self.spec)

    def prepare(self) -> Progress:
        """Lock the job folder, check that it is the same job and owns its output, and
        recover its progress from the files."""
        spec = self.spec
        spec.job_dir.mkdir(parents=True, exist_ok=True)
        spec.output.parent.mkdir(parents=True, exist_ok=True)
        try:
            held = self.lock.acquire()
        except DamagedFile as e:
            raise JobError(str(e)) from None
        if not held:
            raise JobError(f"job folder {spec.job_dir} is in use by another batchrun process "
                           f"(pid {self.lock.holder()}); wait for it or use another --job-dir")
        self.rows_total = spec.rows_total
        self.openai_input = input_is_openai(spec)
        self.check_paths()
        new = mf.new_manifest(spec.input_fingerprint, self.model_name,
                              self.model_path, self.engine.model_fingerprint,
                              spec.options(), spec.output.resolve())
        old = saved_manifest(spec.job_dir)
        if old is not None and not spec.restart:
            check_same_job(spec, old, new)
            new["created"] = old["created"]
            new["job_id"] = old.get("job_id")  # None in a job.json made before it had one
        try:
            ownership.claim(spec.output, spec.job_dir)
        except ownership.OutputConflict as e:
            raise JobConflict(str(e)) from None
        if spec.restart or old is None:
            self.state.reset()
            for name in ("report.json", "report.html"):
                (spec.job_dir / name).unlink(missing_ok=True)
        self.manifest = new
        start = time.perf_counter()
        mf.save_manifest(spec.job_dir, new)
        # What one atomic write costs on this disk: a commit makes about three.
        self._write_cost = time.perf_counter() - start
        remove_stale_temps(spec.job_dir, ownership.WRITTEN)  # a write a kill cut short
        recovery = recover(self.state, read_rows(spec.input, 0, spec.rows.limits.row_bytes),
                           self._expected_id,
                           self._remember_id)
        if recovery.problems:
            log.warning("%s: %s; resuming from what the files hold", spec.job_dir,
                        "; ".join(recovery.problems))
        self._spilled = recovery.spilled
        self._digests = recovery.digests
        p = recovery.progress
        if p.rows_done + p.rows_failed:
            log.info("resuming: %s of %s rows done (%s failed), %s to go",
                     f"{p.rows_done + p.rows_failed:,}", f"{self.rows_total:,}",
                     f"{p.rows_failed:,}", f"{self.rows_total - p.rows_done - p.rows_failed:,}")
        if spec.parquet_output:
            try:
                self._parquet = ParquetOutput(spec.input, spec.output, spec.results_path,
                                              spec.errors_path)
            except ValueError as e:
                raise JobError(str(e)) from None
            self._parquet.advance(recovery.progress.next_index)
        return recovery.progress

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> dict:
        """Process every pending row; returns report.json's content."""
        try:
            progress = self.prepare()
            return self._run(progress)
        except InputError as e:  # the input turned out damaged part-way: progress is kept
            raise JobError(str(e)) from None
        finally:
            if self._parquet is not None:
                self._parquet.close()  # a no-op after finish(); else drops the partial file
            self.lock.release()

    def _run(self, progress: Progress) -> dict:
        spec = self.spec
        started = time.time()
        t0 = time.perf_counter()
        runs = [] if spec.restart else rp.previous_runs(spec.job_dir)
        self._start_progress = dataclasses.replace(progress)
        status = "completed"
        sink = OrderedSink(spec.results_path, spec.errors_path, self.state.spill_path, progress,
                           self._spilled, self._digests)
        bar = tqdm(total=self.rows_total, initial=progress.rows_done + progress.rows_failed,
                   unit="row", disable=spec.quiet, dynamic_ncols=True, smoothing=0.1)
        last = {"commit": time.perf_counter(), "bar": time.perf_counter(),
                "interval": max(COMMIT_INTERVAL_S, 3 * self._write_cost / COMMIT_SHARE),
                "rows": finished(sink)}
        commits = BackgroundCommits()

        def committed(took: float) -> None:
            last["interval"] = max(COMMIT_INTERVAL_S, took / COMMIT_SHARE)

        def tick() -> None:
            """Start a commit when its interval has passed and rows were written; settle the
            one that finished; refresh the bar."""
            now = time.perf_counter()
            commits.poll()
            if (not commits.busy and now - last["commit"] >= last["interval"]
                    and finished(sink) != last["rows"]):
                last["rows"] = finished(sink)
                last["commit"] = now
                pending, report = self._snapshot(sink, runs, started, now - t0, "running")
                commits.start(lambda: self._make_durable(sink, pending, report),
                              lambda took: (self._settle(sink, pending), committed(took)))
            if now - last["bar"] >= PROGRESS_INTERVAL_S:
                last["bar"] = now
                bar.set_postfix_str(self._rates(now - t0, sink), refresh=False)

        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:  # both stop the job after a last commit
            previous = {s: signal.signal(s, self._on_signal)
                        for s in stop_signals(STOP_SIGNALS)}
        done = False  # every row done: a stop that comes after the last one stops nothing
        try:
            done = self._loop(progress, sink, bar, tick)
            if self._interrupted and not done:
                status = "interrupted"
        except BaseException:
            status = "failed"
            raise
        finally:
            if main_thread:
                for s, handler in previous.items():
                    signal.signal(s, handler)
            bar.close()
            try:
                commits.wait()
            finally:
                self._commit(sink, runs, started, time.perf_counter() - t0, status)
                sink.close()
        if self._interrupted and not done:
            raise Interrupted(self._interrupted)
        if self._parquet is not None:
            self._parquet.finish()
        return self.report

    def _loop(self, progress: Progress, sink: OrderedSink, bar, tick) -> bool:
        """Feed rows to the engine and write what it finishes until every row is done (True)
        or the job is stopped (False)."""
        engine = self.engine
        target = engine.max_concurrency + (engine.config.prefill_batch_size or 8)
        feeder = Feeder(self.pending_rows(progress.next_index), self._build_task,
                        lookahead=2 * target, check=self._check_row,
                        workers=BUILD_WORKERS)
        try:
            engine.warm_up()  # the feeder's threads build the first rows meanwhile
            while not self._interrupted:
                idle = not engine.has_work()
                for item in feeder.take(target - engine.num_waiting, block=idle,
                                        linger=FILL_LINGER_S,
                                        timeout=COMMIT_INTERVAL_S / 10):  # tick, see Ctrl-C
                    self._submit(item, sink, bar)
                if not engine.has_work() and feeder.exhausted:
                    return True
                for out in engine.step():
                    self._finish(out, sink, bar)
                tick()
            return False
        finally:
            feeder.close()

    def _on_signal(self, signum, frame) -> None:
        if self._interrupted:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._interrupted = signum

    def _check_row(self, raw: RawRow) -> RowError | None:
        """The checks that depend on input order, made before the row is built."""
        if raw.error is not None:
            return read_error(raw, self.spec.rows.id_column)
        return self._check_id(raw)

    @property
    def row_options(self) -> RowOptions:
        return self.spec.rows

    @property
    def created(self) -> int:
        return self.manifest["created"]

    @property
    def job_id(self) -> str | None:
        return self.manifest.get("job_id")

    def _check_id(self, raw: RawRow) -> RowError | None:
        """A row whose explicit id an earlier row already used is an error (the later one).
        The first row in input order owns the id, whatever order rows are seen in (a resumed
        job first sees the rows that have records, which may be later duplicates)."""
        custom_id = explicit_id(raw.value, self.spec.rows.id_column)
        if custom_id is None:
            return None
        key = hashlib.blake2b(custom_id.encode(), digest_size=8).digest()
        first = self._seen_ids.get(key)
        if first is None or raw.line <= first:
            self._seen_ids[key] = raw.line
            return None
        return RowError(raw.index, raw.line, custom_id, "duplicate_custom_id",
                        f"custom_id {custom_id!r} is already used by the row on line {first}: "
                        "give every row its own id", is_openai_line(raw.value))

    def pending_rows(self, start: int) -> Iterator[RawRow]:
        """The input rows from `start` on that have no record yet (spilled rows are done)."""
        for raw in read_rows(self.spec.input, start, self.spec.rows.limits.row_bytes):
            if raw.index not in self._spilled:
                yield raw

    def _expected_id(self, raw: RawRow) -> str:
        """The custom_id the row's record carries."""
        return row_id(raw.value, raw.index, self.spec.rows.id_column)

    def _remember_id(self, raw: RawRow) -> None:
        """A row that already has its record: later rows must still not reuse its id."""
        if raw.error is None:
            self._check_id(raw)

    def _commit(self, sink: OrderedSink, runs: list[dict], started: float, wall: float,
                status: str) -> None:
        """Commit on this thread (the last one of a run)."""
        pending, report = self._snapshot(sink, runs, started, wall, status)
        self._make_durable(sink, pending, report, html_too=status != "running")
        self._settle(sink, pending)

    def _snapshot(self, sink: OrderedSink, runs: list[dict], started: float, wall: float,
                  status: str) -> tuple[PendingCommit, dict]:
        """What a commit records: the sink's progress and the report it makes."""
        pending = sink.flush()
        progress = pending.progress
        self.engine.sample_timeline(force=status != "running")
        start = self._start_progress
        run = rp.run_entry(started, status, self.engine.stats,
                           progress.rows_done - start.rows_done,
                           progress.rows_failed - start.rows_failed,
                           self.engine.max_concurrency, wall)
        run["models_requested"] = dict(self.models_requested)
        if self._first_prompt is not None:
            index, ids = self._first_prompt
            if self._first_text is None or self._first_text["index"] != index:
                self._first_text = {"index": index, "text": self.engine.tokenizer.decode(
                    ids[:FIRST_PROMPT_TOKENS])}
            run["first_prompt"] = self._first_text
        run["speculation"] = rp.speculation_settings(self.engine.config)
        plan = getattr(self.engine, "weight_plan", None)
        run["weights"] = plan.to_dict() if plan is not None else None
        self.report = rp.build_report(self.manifest, progress, self.rows_total, [*runs, run],
                                      self.device)
        self.report["weights"] = run["weights"]  # how this start held the model's weights
        requested: Counter[str] = Counter()
        for entry in self.report["runs"]:
            requested.update(entry.get("models_requested") or {})
        self.report["models_requested"] = dict(requested)  # body.model of the answered rows
        return pending, self.report

    def _make_durable(self, sink: OrderedSink, pending: PendingCommit, report: dict,
                      html_too: bool = False) -> None:
        """The commit's disk work (may run on the commit thread)."""
        make_durable(sink, self.state, pending)
        rp.write_report(self.spec.job_dir, report, html_too=html_too)

    def _settle(self, sink: OrderedSink, pending: PendingCommit) -> None:
        """After a commit, on the job loop's thread."""
        sink.settle(pending)
        if self._parquet is not None:
            self._parquet.advance(pending.progress.next_index)

    def _rates(self, elapsed: float, sink: OrderedSink) -> str:
        """The bar's figures, each named: generated tokens a second, rows in the batch, rows
        queued for it (waiting for room: memory, the prefill's token budget), and rows
        finished ahead of an earlier row (safe on disk, written to the output once the earlier
        rows are)."""
        tokens = self.engine.generated_tokens
        waiting = self.engine.num_waiting
        queued = f", {waiting:,} queued" if waiting else ""
        ahead = f", {sink.held:,} done ahead" if sink.held else ""
        return (f"{tokens / elapsed:,.0f} tok/s, {self.engine.num_running:,} in batch"
                f"{queued}{ahead}")


def finished(sink: OrderedSink) -> int:
    """Rows with a record, in order or spilled."""
    return sink.progress.rows_done + sink.progress.rows_failed


def _row_problem(task: Task, outs: list[Output]) -> tuple[str, str] | None:
    """(code, message) when a row's outputs cannot make a result record."""
    for out in outs:
        if out.finish_reason is FinishReason.ERROR:
            return "request_failed", out.error or "the request failed"
    constraint = task.params.constraint
    for out in outs:
        if out.constraint_error is not None:
            return ("constraint_incomplete",
                    f"the grammar engine gave up on {constraint.describe()} after "
                    f"{out.completion_tokens} tokens ({out.constraint_error}): simplify it")
        if out.constraint_complete is False:
            return ("constraint_incomplete",
                    f"the answer ended ({out.finish_reason.value}, {out.completion_tokens} "
                    f"tokens) before it matched {constraint.describe()}: raise max_tokens "
                    f"(now {task.params.max_tokens}) or loosen the constraint")
    return None


def _prompt_digest(prompt_ids: list[int], images: tuple[str, ...] = ()) -> bytes:
    """The prompt's tokens and images (an image's placeholder tokens are the same for every
    image, so its content hash is part of it). Computed where the row is built, in pieces that
    hashlib hashes without letting go of the GIL (it lets go from 2,048 bytes on): on a build
    thread, each let-go waited out the interpreter's switch interval behind the job loop's
    Python, 1.7 ms a 1,800-token prompt against 0.06 ms (this project's CPU)."""
    h = hashlib.blake2b(digest_size=16)
    for data in ("|".join(images).encode(), np.asarray(prompt_ids, dtype="<i8").tobytes()):
        view = memoryview(data)
        for start in range(0, len(view), HASH_PIECE):
            h.update(view[start:start + HASH_PIECE])
    return h.digest()


def _payload_key(prompt_digest: bytes, params) -> bytes:
    """Identical requests: the same prompt (its _prompt_digest) and sampling."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(params).encode())  # every field (all in the dataclass's repr); astuple's
    # deep copy cost 8x as much, a row, in the job loop
    h.update(prompt_digest)
    return h.digest()
