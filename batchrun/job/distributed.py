"""A job sharded over a Ray cluster: `batchrun run INPUT --ray ADDRESS|local`.

The driver keeps everything that makes a job a job -- the job folder, the lock, the manifest,
the ordered sink and the commit protocol -- and hands slices of rows to Ray actors. Each actor
loads the model once and runs batchrun's own engine on its slices (continuous batching, prefix
cache, constraints, images: the single-machine row code, job.runner.RowWork), returning one
record per row. So the guarantees are the single machine's:
- results in input order, every row exactly once (the sink refuses an index written twice);
- a killed driver resumes from the committed frontier (slices already written are not
  recomputed; a slice in flight at the kill is);
- a worker that dies has its slice retried on another; a slice is small (SLICE_ROWS), so a lost
  worker costs little;
- slices are handed out as workers ask (at most IN_FLIGHT each), so a faster worker takes more.

Ray's own checkpointing (Ray Data's CheckpointConfig) keys on row ids and writes unordered part
files; the job folder's commit protocol already gives ordered, exactly-once output, so it is
kept. Ray is optional: `pip install 'batchrun[ray]'`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from batchrun.engine.request import EngineConfig, EngineStats
from batchrun.io.jsonl import RawRow
from batchrun.job.rows import RowError
from batchrun.job.runner import (
    COMMIT_INTERVAL_S,
    JobError,
    JobRunner,
    JobSpec,
    RowWork,
    read_rows,
)

SLICE_ROWS = 64  # rows per slice: an actor batches within a slice, so not too few
IN_FLIGHT = 2  # slices an actor holds at once: one running, one ready to start


def ray_missing() -> str:
    return "--ray needs Ray: pip install 'batchrun[ray]'"


@dataclass(slots=True)
class RayOptions:
    address: str  # "local" starts a cluster in this process
    actors: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    slice_rows: int = SLICE_ROWS


@dataclass(slots=True)
class Usage:
    """A row's token counts, as the ordered sink reads them from outputs."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class _CollectSink:
    """The worker's sink: records in completion order, for the driver's ordered sink."""

    def __init__(self):
        self.records: list[tuple[int, bytes, bool, Usage | None]] = []

    def put(self, index: int, line: bytes, is_error: bool, outs=()) -> None:
        usage = None
        if outs:
            usage = Usage(outs[0].prompt_tokens, outs[0].cached_tokens,
                          sum(o.completion_tokens for o in outs))
        self.records.append((index, line, is_error, usage))


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


class SliceWorker(RowWork):
    """Runs slices of rows on one model loaded once (the body of a Ray actor)."""

    def __init__(self, model: str | None, config: EngineConfig, row_options, model_name: str,
                 created: int, vision: bool):
        import batchrun  # noqa: F401  (the BLAS routing, before MLX, in this worker too)
        from batchrun.engine.engine import Engine

        if vision:
            from batchrun.engine.vision import VisionEngine
            from batchrun.io.media import ImageCache

            self.engine = VisionEngine.load(model, config)
            row_options = dataclasses.replace(row_options, images=ImageCache())
        else:
            self.engine = Engine.load(model, config)
        self.row_options = dataclasses.replace(row_options,
                                               check_constraint=self.engine.check_constraint)
        self.model_name = model_name
        self.created = created
        self._init_work()

    def run_slice(self, rows: list[RawRow]) -> dict:
        """Every row of the slice to a record; with this slice's engine figures."""
        sink, bar = _CollectSink(), _NoBar()
        before = dataclasses.replace(self.engine.stats, ttfts=[], timeline=[])
        ttfts = len(self.engine.stats.ttfts)
        start = time.perf_counter()
        for raw in rows:
            if raw.error is not None:
                item = RowError(raw.index, raw.line, str(raw.index), "invalid_json", raw.error)
            else:
                item = self._build_task(raw)
            self._submit(item, sink, bar)
        while self.engine.has_work():
            for out in self.engine.step():
                self._finish(out, sink, bar)
        after = self.engine.stats
        delta = {name: getattr(after, name) - getattr(before, name) for name in (
            "prompt_tokens", "cached_tokens", "completion_tokens", "prefill_time",
            "decode_time", "decode_steps", "batch_size_sum")}
        delta["peak_memory_bytes"] = after.peak_memory_bytes
        delta["ttfts"] = after.ttfts[ttfts:]
        return {"records": sink.records, "stats": delta, "busy_s": time.perf_counter() - start,
                "pid": os.getpid(), "node": _node_ip()}

    def ping(self) -> int:
        return os.getpid()


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

    num_running = 0


class RayJobRunner(JobRunner):
    """The job runner with Ray actors in place of the local engine."""

    def __init__(self, spec: JobSpec, model: str | None, model_name: str, model_path: str,
                 fingerprint: str, config: EngineConfig, device: str, ray_options: RayOptions,
                 vision: bool = False, on_result=None):
        from batchrun.engine.engine import MAX_AUTO_CONCURRENCY

        per_actor = config.max_concurrency or MAX_AUTO_CONCURRENCY
        view = _StatsView(max_concurrency=per_actor * ray_options.actors,
                          model_fingerprint=fingerprint, config=config)
        super().__init__(view, spec, model_name, model_path, device)
        self.model = model
        self.config = config
        self.ray_options = ray_options
        self.vision = vision
        self.workers: list[WorkerFigures] = []
        self._on_result = on_result  # tests: called with (runner, actors) after each slice
        self._own_ray = False

    def _run(self, progress):
        import ray

        self._start_ray()
        try:
            return super()._run(progress)
        finally:
            if self._own_ray:
                ray.shutdown()

    def _start_ray(self) -> None:
        """Join the cluster: one already joined in this process, ADDRESS, or a local one."""
        import ray

        if ray.is_initialized():
            return
        self._own_ray = True
        if self.ray_options.address == "local":
            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     num_cpus=max(os.cpu_count() or 1, int(self.ray_options.num_cpus
                                                           * self.ray_options.actors + 0.999)))
        else:
            ray.init(address=self.ray_options.address, log_to_driver=False)

    def _loop(self, progress, sink, bar, commit) -> None:
        """Hand slices to actors as they free up; write their records through the sink."""
        import ray

        opts = self.ray_options
        actor_class = ray.remote(num_cpus=opts.num_cpus, num_gpus=opts.num_gpus,
                                 max_restarts=0)(SliceWorker)
        row_options = dataclasses.replace(self.spec.rows, check_constraint=None, images=None)
        actors = [actor_class.remote(self.model, self.config, row_options, self.model_name,
                                     self.created, self.vision) for _ in range(opts.actors)]
        self.workers = [WorkerFigures(i) for i in range(opts.actors)]
        live = set(range(opts.actors))
        load: dict[int, int] = {i: 0 for i in live}
        retry: deque[list[RawRow]] = deque()
        slices = self._slices(progress.next_index, sink, bar)
        flying: dict[Any, tuple[int, list[RawRow]]] = {}
        exhausted = False
        while not self._interrupted:
            while live and (retry or not exhausted):
                actor = min(live, key=load.__getitem__)
                if load[actor] >= IN_FLIGHT:
                    break
                rows = retry.popleft() if retry else next(slices, None)
                if rows is None:
                    exhausted = True
                    break
                flying[actors[actor].run_slice.remote(rows)] = (actor, rows)
                load[actor] += 1
            if not flying:
                if not live and (retry or not exhausted):
                    raise JobError("every Ray worker died; progress is saved: resume the job")
                break
            done, _ = ray.wait(list(flying), num_returns=1, timeout=COMMIT_INTERVAL_S)
            for ref in done:
                actor, rows = flying.pop(ref)
                load[actor] -= 1
                try:
                    result = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
                    # The worker died with this slice: another one runs it again.
                    self.workers[actor].failed_slices += 1
                    self.workers[actor].alive = False
                    live.discard(actor)
                    retry.append(rows)
                    continue
                self._absorb(actor, result, sink, bar)
                if self._on_result is not None:
                    self._on_result(self, actors)
            commit()

    def _slices(self, start: int, sink, bar):
        """Slices of rows from `start` on; duplicate ids are caught here, where every row is
        seen, and written as errors at once."""
        rows: list[RawRow] = []
        for raw in read_rows(self.spec.input, start):
            if raw.error is None:
                duplicate = self._check_id(raw)
                if duplicate is not None:
                    self._write_error(duplicate, sink, openai=False)
                    bar.update(1)
                    continue
            rows.append(raw)
            if len(rows) >= self.ray_options.slice_rows:
                yield rows
                rows = []
        if rows:
            yield rows

    def _absorb(self, actor: int, result: dict, sink, bar) -> None:
        for index, line, is_error, usage in result["records"]:
            sink.put(index, line, is_error, [usage] if usage is not None else ())
        bar.update(len(result["records"]))
        s, d = self.engine.stats, result["stats"]
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "prefill_time",
                     "decode_time", "decode_steps", "batch_size_sum"):
            setattr(s, name, getattr(s, name) + d[name])
        s.peak_memory_bytes = max(s.peak_memory_bytes, d["peak_memory_bytes"])
        s.ttfts.extend(d["ttfts"])
        s.requests_finished += len(result["records"])
        w = self.workers[actor]
        w.node, w.pid = result["node"], result["pid"]
        w.slices += 1
        w.rows += len(result["records"])
        w.completion_tokens += d["completion_tokens"]
        w.busy_s += result["busy_s"]

    def _commit(self, sink, runs, started, wall, status) -> None:
        super()._commit(sink, runs, started, wall, status)
        self.report["workers"] = [w.as_dict() for w in self.workers]
        self.report["runs"][-1]["workers"] = self.report["workers"]
        from batchrun.job import report as rp

        rp.write_report(self.spec.job_dir, self.report, html_too=status != "running")
