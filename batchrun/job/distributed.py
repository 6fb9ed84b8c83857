"""A job sharded over a Ray cluster: `batchrun run INPUT --ray ADDRESS|local`.

The driver keeps everything that makes a job a job -- the job folder, the lock, the manifest,
the ordered sink and the commit protocol -- and hands slices of rows to Ray actors. Each actor
loads the model once and runs batchrun's own engine on its slices (continuous batching, prefix
cache, constraints, images: the single-machine row code, job.runner.RowWork), returning one
record per row. So the guarantees are the single machine's:
- results in input order, every row exactly once (the sink refuses an index written twice);
- a killed driver resumes from the committed frontier (slices already written are not
  recomputed; a slice in flight at the kill is);
- a worker that dies has its slice retried on another; a slice is small (--ray-slice-rows), so
  a lost worker costs little;
- slices are handed out as workers ask (enough in flight to fill an actor's batch, plus one),
  so a faster worker takes more;
  inside a worker, a slice's rows join the batch still decoding the previous one's;
- a slice travels as bytes the driver pickled itself, so a row that cannot be sent (nested
  deeper than the pickler's recursion limit) is found here and becomes that row's error;
- a local cluster (`--ray local`) is the job's own: stopped on every exit, and what a killed
  driver left of it is killed on the next start (job/ray_local.py).

Ray's own checkpointing (Ray Data's CheckpointConfig) keys on row ids and writes unordered part
files; the job folder's commit protocol already gives ordered, exactly-once output, so it is
kept. Ray is optional: `pip install -e '.[ray]'`.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import signal
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from batchrun.engine.config import EngineConfig
from batchrun.engine.decoding.tool_grammar import ToolForm
from batchrun.engine.stats import EngineStats, SpeculationStats
from batchrun.io.jsonl import RawRow
from batchrun.job.errors import JobError, stop_signals
from batchrun.job.options import RayOptions
from batchrun.job.rows import RowError, is_openai_line, read_error
from batchrun.job.runner import COMMIT_INTERVAL_S, JobRunner, RowWork
from batchrun.job.spec import JobSpec
from batchrun.models import extra_hint

MIN_IN_FLIGHT = 2  # slices an actor holds at once, their rows in one running batch
# What pickling a parsed row can raise: too deep for the recursion limit, or (defensively)
# a value the pickler refuses.
UNSENDABLE = (RecursionError, pickle.PicklingError, TypeError, ValueError, OverflowError)


def ray_missing() -> str:
    return f"--ray needs Ray: {extra_hint('ray')}"


@dataclass(slots=True)
class Usage:
    """A row's token counts, as the ordered sink reads them from outputs."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class _SliceJob:
    """One run_slice call: its rows, the records collected so far, and a done signal."""

    def __init__(self, rows: list[RawRow]):
        self.rows = rows
        self.records: list[tuple[int, bytes, bool, Usage | None]] = []
        self.remaining = len(rows)
        self.done = threading.Event()
        self.error: BaseException | None = None


class _RoutingSink:
    """The worker's sink: each record goes to the slice its row came in."""

    def __init__(self):
        self.owner: dict[int, _SliceJob] = {}

    def put(self, index: int, line: bytes, is_error: bool, outs=()) -> None:
        usage = None
        if outs:
            usage = Usage(outs[0].prompt_tokens, outs[0].cached_tokens,
                          sum(o.completion_tokens for o in outs))
        job = self.owner.pop(index)
        job.records.append((index, line, is_error, usage))
        job.remaining -= 1
        if job.remaining == 0:
            job.done.set()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


STAT_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens", "prefill_time",
               "decode_time", "decode_tokens", "decode_steps", "batch_size_sum",
               "peak_memory_bytes")


class SliceWorker(RowWork):
    """Runs slices of rows on one model loaded once (the body of a Ray actor).

    Ray calls `run_slice` from several threads at once; one engine thread owns the
    engine and the row code, takes each slice's rows into the running batch as they arrive, and
    hands every record back to the call its row came in. So a slice's rows join a batch that
    is still decoding the previous slice's: the batch does not drain between slices.
    """

    def __init__(self, model: str | None, config: EngineConfig, row_options, model_name: str,
                 created: int, vision: bool, job_id: str | None = None):
        import batchrun  # noqa: F401  (the BLAS routing, before MLX, in this worker too)
        from batchrun.engine.load import load_engine

        self.engine = load_engine(model, config, vision)
        row_options = dataclasses.replace(
            row_options, limits=row_options.limits.for_context(self.engine.context_length))
        if self.engine.backend.accepts_images:
            from batchrun.job.limits import image_cache

            row_options = dataclasses.replace(row_options, images=image_cache(row_options.limits))
        self.row_options = dataclasses.replace(
            row_options, check_constraint=self.engine.check_constraint,
            tool_form=ToolForm.of(self.engine.markup, self.engine.encode_text))
        self.model_name = model_name
        self.created = created
        self.job_id = job_id
        self._init_work()
        self._inbox: queue.Queue[_SliceJob] = queue.Queue()
        self._sink = _RoutingSink()
        self._ttfts_sent = 0
        self._report_lock = threading.Lock()
        self._failure: BaseException | None = None  # what stopped the engine thread
        threading.Thread(target=self._drive, name="batchrun-engine", daemon=True).start()

    def run_slice(self, payload: bytes) -> dict:
        """Every row of the slice (pickled rows) to a record, with the engine's figures so far."""
        job = _SliceJob(pickle.loads(payload))
        self._inbox.put(job)
        while not job.done.wait(1.0):
            if self._failure is not None:  # the engine thread is gone: never wait for it
                raise self._failure
        if job.error is not None:
            raise job.error
        with self._report_lock:  # each TTFT is reported once, by whichever call comes first
            stats = self.engine.stats
            ttfts = stats.ttfts[self._ttfts_sent:]
            self._ttfts_sent += len(ttfts)
        figures = {name: getattr(stats, name) for name in STAT_FIELDS}
        figures["ttfts"] = ttfts
        figures["speculation"] = dataclasses.astuple(stats.speculation)
        return {"records": job.records, "stats": figures, "pid": os.getpid(),
                "node": _node_ip()}

    def _drive(self) -> None:
        """The engine thread: admit arriving slices, step the engine, route records."""
        bar = _NoBar()
        while True:
            try:
                self._admit(bar)
                for out in self.engine.step():
                    self._finish(out, self._sink, bar)
            except BaseException as e:  # fail every waiting call: the driver sees the error
                self._failure = e  # and every later call (run_slice)
                for waiting in set(self._sink.owner.values()):
                    waiting.error = e
                    waiting.done.set()
                return

    def _admit(self, bar) -> None:
        """Take the slices that arrived (waiting for one while the engine is idle)."""
        try:
            job = self._inbox.get(block=not self.engine.has_work())
            while True:
                self._take(job, bar)
                job = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _take(self, job: _SliceJob, bar) -> None:
        if not job.rows:
            job.done.set()
            return
        for raw in job.rows:
            self._sink.owner[raw.index] = job
        for raw in job.rows:
            if raw.error is not None:
                item = read_error(raw, self.row_options.id_column)
            else:
                item = self._build_task(raw)
            self._submit(item, self._sink, bar)

    def ping(self) -> int:
        return os.getpid()


def _not_sendable(raw: RawRow, custom_id: str, e: BaseException) -> RowError:
    reason = "it is nested too deeply" if isinstance(e, RecursionError) \
        or "recursion" in str(e) else f"{type(e).__name__}: {e}"
    return RowError(raw.index, raw.line, custom_id, "row_not_sendable",
                    f"the row on line {raw.line} cannot be sent to a Ray worker ({reason}); "
                    "nest its values less deeply, or run the job without --ray")


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests of the worker alone)
        return "local"


@dataclass(slots=True)
class WorkerFigures:
    """What one actor did, for report.json's `workers`."""

    actor: int
    node: str = ""
    pid: int = 0
    slices: int = 0
    rows: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0
    failed_slices: int = 0
    alive: bool = True

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["busy_s"] = round(self.busy_s, 3)
        d["completion_tokens_per_s"] = round(self.completion_tokens / self.busy_s, 2) \
            if self.busy_s else 0.0
        return d


@dataclass(slots=True)
class _StatsView:
    """The driver's view of the engines' work: figures summed over the workers' slices, shaped
    like the engine's so the report code is the same."""

    stats: EngineStats = field(default_factory=EngineStats)
    max_concurrency: int = 0
    model_fingerprint: str = ""
    config: EngineConfig = field(default_factory=EngineConfig)

    def sample_timeline(self, force: bool = False) -> None:
        pass

    @property
    def generated_tokens(self) -> int:
        return self.stats.completion_tokens

    num_running = 0  # the actors' batches are theirs: the bar shows none
    num_waiting = 0


class RayJobRunner(JobRunner):
    """The job runner with Ray actors in place of the local engine."""

    def __init__(self, spec: JobSpec, model: str | None, model_name: str, model_path: str,
                 fingerprint: str, config: EngineConfig, device: str, ray_options: RayOptions,
                 vision: bool = False, on_result=None):
        from batchrun.engine.config import DEVICE_DEFAULTS

        per_actor = config.max_concurrency or DEVICE_DEFAULTS["cpu"][0]
        view = _StatsView(max_concurrency=per_actor * ray_options.actors,
                          model_fingerprint=fingerprint, config=config)
        # Slices in flight per actor: enough rows to fill its batch, and one more ready.
        self.in_flight = max(MIN_IN_FLIGHT, -(-per_actor // ray_options.slice_rows) + 1)
        super().__init__(view, spec, model_name, model_path, device)
        self.model = model
        self.config = config
        self.ray_options = ray_options
        self.vision = vision
        self.workers: list[WorkerFigures] = []
        self._actor_stats: dict[int, dict] = {}
        self._on_result = on_result  # tests: called with (runner, actors) after each slice
        self._own_ray = False
        self._cluster = None  # the local cluster this driver started, if any

    def _run(self, progress):
        import ray

        # SIGTERM and SIGHUP stop the job like Ctrl-C (the runner handles SIGINT): every path
        # out of here, a second signal's KeyboardInterrupt included, stops the cluster we
        # started.
        main_thread = threading.current_thread() is threading.main_thread()
        stops = stop_signals((signal.SIGTERM, signal.SIGHUP))
        if main_thread:
            previous = {s: signal.signal(s, self._on_signal) for s in stops}
        try:
            self._start_ray()
            if main_thread:  # ray.init put its own (crash-report-and-die) handler in
                for s in stops:
                    signal.signal(s, self._on_signal)
            return super()._run(progress)
        finally:
            try:
                if self._cluster is not None:
                    self._cluster.stop()
                elif self._own_ray:
                    ray.shutdown()
            finally:
                if main_thread:
                    for s, handler in previous.items():
                        signal.signal(s, handler)

    def _start_ray(self) -> None:
        """Join the cluster: one already joined in this process, ADDRESS, or a local one. A
        local cluster a killed run of this job left behind is reaped first."""
        import ray

        from batchrun.job import ray_local

        ray_local.reap(self.spec.job_dir)
        if ray.is_initialized():
            return
        self._own_ray = True
        if self.ray_options.address == "local":
            self._cluster = ray_local.LocalCluster(self.spec.job_dir)
            self._cluster.start(num_cpus=max(os.cpu_count() or 1, int(
                self.ray_options.num_cpus * self.ray_options.actors + 0.999)))
        else:  # not ours: joined, never shut down beyond our connection
            ray.init(address=self.ray_options.address, log_to_driver=False)

    def _loop(self, progress, sink, bar, commit) -> None:
        """Hand slices to actors as they free up; write their records through the sink."""
        import ray

        opts = self.ray_options
        actor_class = ray.remote(num_cpus=opts.num_cpus, num_gpus=opts.num_gpus,
                                 max_restarts=0, max_concurrency=self.in_flight)(SliceWorker)
        row_options = dataclasses.replace(self.spec.rows, check_constraint=None, images=None)
        actors = [actor_class.remote(self.model, self.config, row_options, self.model_name,
                                     self.created, self.vision, self.job_id)
                  for _ in range(opts.actors)]
        self.workers = [WorkerFigures(i) for i in range(opts.actors)]
        live = set(range(opts.actors))
        load: dict[int, int] = {i: 0 for i in live}
        retry: deque[bytes] = deque()
        slices = self._slices(progress.next_index, sink, bar)
        flying: dict[Any, tuple[int, bytes]] = {}
        exhausted = False
        while not self._interrupted:
            while live and (retry or not exhausted):
                actor = min(live, key=load.__getitem__)
                if load[actor] >= self.in_flight:
                    break
                payload = retry.popleft() if retry else next(slices, None)
                if payload is None:
                    exhausted = True
                    break
                flying[actors[actor].run_slice.remote(payload)] = (actor, payload)
                load[actor] += 1
            if not flying:
                if not live and (retry or not exhausted):
                    raise JobError("every Ray worker died; progress is saved: resume the job")
                break
            done, _ = ray.wait(list(flying), num_returns=1, timeout=COMMIT_INTERVAL_S)
            for ref in done:
                actor, payload = flying.pop(ref)
                load[actor] -= 1
                try:
                    result = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
                    # The worker died with this slice: another one runs it again.
                    self.workers[actor].failed_slices += 1
                    self.workers[actor].alive = False
                    live.discard(actor)
                    retry.append(payload)
                    continue
                self._absorb(actor, result, sink, bar)
                if self._on_result is not None:
                    self._on_result(self, actors)
            commit()

    def _slices(self, start: int, sink, bar):
        """Slices of the rows from `start` on that have no record yet, pickled for the actors;
        duplicate ids are caught here, where every row is seen, and written as errors at once."""
        rows: list[RawRow] = []
        for raw in self.pending_rows(start):
            if raw.error is None:
                duplicate = self._check_id(raw)
                if duplicate is not None:
                    self._write_error(duplicate, sink, openai=duplicate.openai)
                    bar.update(1)
                    continue
            rows.append(raw)
            if len(rows) >= self.ray_options.slice_rows:
                yield from self._pack(rows, sink, bar)
                rows = []
        if rows:
            yield from self._pack(rows, sink, bar)

    def _pack(self, rows: list[RawRow], sink, bar):
        """The slice as the bytes sent to an actor (none if no row can go). A row that cannot
        be pickled is written as its own error; the others go."""
        try:
            payload = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
        except UNSENDABLE:  # find the rows at fault: rare, so only then is a row pickled twice
            payload = None
        if payload is not None:
            yield payload
            return
        sendable = []
        for raw in rows:
            try:
                pickle.dumps([raw], protocol=pickle.HIGHEST_PROTOCOL)  # at the depth it goes
            except UNSENDABLE as e:
                self._write_error(_not_sendable(raw, self._expected_id(raw), e), sink,
                                  openai=is_openai_line(raw.value))
                bar.update(1)
            else:
                sendable.append(raw)
        if sendable:
            yield pickle.dumps(sendable, protocol=pickle.HIGHEST_PROTOCOL)

    def _absorb(self, actor: int, result: dict, sink, bar) -> None:
        for index, line, is_error, usage in result["records"]:
            sink.put(index, line, is_error, [usage] if usage is not None else ())
        bar.update(len(result["records"]))
        figures = result["stats"]  # the actor's engine so far
        self._actor_stats[actor] = figures
        s = self.engine.stats
        for name in STAT_FIELDS:
            values = [f[name] for f in self._actor_stats.values()]
            setattr(s, name, max(values) if name == "peak_memory_bytes" else sum(values))
        s.speculation = SpeculationStats(*(
            sum(column) for column in zip(*(f.get("speculation", (0, 0, 0))
                                            for f in self._actor_stats.values()), strict=True)))
        s.ttfts.extend(figures["ttfts"])
        s.requests_finished += len(result["records"])
        w = self.workers[actor]
        w.node, w.pid = result["node"], result["pid"]
        w.slices += 1
        w.rows += len(result["records"])
        w.completion_tokens = figures["completion_tokens"]
        w.busy_s = figures["prefill_time"] + figures["decode_time"]

    def _snapshot(self, sink, runs, started, wall, status):
        pending, report = super()._snapshot(sink, runs, started, wall, status)
        report["workers"] = [w.as_dict() for w in self.workers]
        report["runs"][-1]["workers"] = report["workers"]
        return pending, report
