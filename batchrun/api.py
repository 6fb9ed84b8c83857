"""batchrun from Python: `Engine.load(...)` for the batched engine, `Job(...)` for a batch job
with the command line's job folder, resume and exactly-once output.

    import batchrun
    engine = batchrun.Engine.load()                     # the demo model; or model="path or id"
    outs = engine.generate(["Once upon", [{"role": "user", "content": "hi"}]], max_tokens=8)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from batchrun.engine.config import EngineConfig
from batchrun.engine.load import load_engine
from batchrun.io.files import fsync_folder
from batchrun.job.dry_run import PROBE_ROWS, DryRun, count_and_probe
from batchrun.job.errors import UsageError
from batchrun.job.options import RunOptions
from batchrun.job.plan import GENERATION_CONFIG_KEYS, IMAGE_COLUMN_NEEDS_VISION, STDIN, plan
from batchrun.models import MissingExtra  # re-exported: the CLI catches it


class Engine:
    """The batched engine (the seed's API: add_request, step, abort, run, generate, stats,
    prefix-cache save / load / clear). `load` picks the backend from the model: mlx-vlm for a
    vision-language model, mlx-lm otherwise."""

    @staticmethod
    def load(model: str | None = None, *, vision: bool | None = None,
             config: EngineConfig | None = None, **engine_options) -> Any:
        """Load `model` (a folder or Hugging Face id; None: the bundled demo model).
        `engine_options` are EngineConfig's fields (max_concurrency, memory_utilization,
        prefix_cache, cache_dir, ...). `vision` forces (True) or forbids (False) the vision
        backend; by default the model's config decides."""
        return load_engine(model, config or EngineConfig(**engine_options), vision)


class Job:
    """A batch job over an input file, with the command line's job folder: resumable, every
    row exactly once, results in input order.

        job = batchrun.Job("reviews.parquet", job_dir="jobs/x", choices=["pos", "neg"])
        report = job.run()
        for record in job.results(): ...

    `options` are `run`'s, under the flags' names (`max_tokens=`, `media_timeout=`), or whole
    parts of RunOptions (`sampling=SamplingOptions(...)`, batchrun.job.options); `job.options`
    holds them in parts (`job.options.sampling.max_tokens`).

    `input` "-" reads JSONL rows from `stdin` (default: this process's): they are spooled into
    the job folder first (`<job_dir>/stdin.jsonl`), so the job resumes like any other.
    """

    def __init__(self, input: str | Path, *, stdin: BinaryIO | None = None, **options):
        self.options = RunOptions.from_flat(**options)
        self.from_stdin = str(input) == STDIN
        self._stdin = stdin
        self._stdin_taken = False  # spooled into the job folder (once: check() may repeat)
        self._spool_written = False  # this Job wrote the spool, for a job that had not begun
        self.spec, self.config, self.constraint, self.defaults_from = \
            plan(Path(input), self.options)
        self.input = self.spec.input
        self.runner = None
        self.report: dict | None = None
        self._model_fp: str | None = None

    @property
    def engine(self):
        return self.runner.engine if self.runner is not None else None

    def sampling_defaults(self) -> list[tuple[str, Any, str]]:
        """(field, value, where it comes from: "flag", "generation_config.json" or
        "batchrun") of each sampling default the model's generation config may set."""
        defaults = self.spec.rows.defaults
        return [(name, getattr(defaults, name), self.defaults_from[name])
                for name in GENERATION_CONFIG_KEYS.values()]

    def check(self) -> None:
        """Refuse, before the model loads, an output or job folder this job may not use
        (JobError / JobConflict from batchrun.job.errors): another process running it, a job
        folder holding a different job (saying what differs), files that are not this job's.
        Rows from stdin are spooled into the job folder here."""
        from batchrun.job.spec import check_paths

        if self.from_stdin and not self._stdin_taken:
            self._take_stdin()
            self._stdin_taken = True
        try:
            self._refuse_if_running()
            self._refuse_linked_output()
            self._refuse_another_job()
            check_paths(self.spec)
        except BaseException:
            self.discard_spool()
            raise

    def discard_spool(self) -> None:
        """Remove the rows this Job spooled from stdin when no job began with them (no
        job.json): a start that failed leaves nothing to block the next one."""
        spec = self.spec
        if self._spool_written and not (spec.job_dir / "job.json").exists():
            spec.input.unlink(missing_ok=True)
            self._spool_written = False

    def _refuse_linked_output(self) -> None:
        """An output that is a link (or not a file) is said as such, before it could read as a
        different job's output (job.json compares outputs as resolved places)."""
        from batchrun.job import ownership
        from batchrun.job.errors import JobConflict

        spec = self.spec
        try:
            if spec.output == spec.results_path and spec.output.parent == spec.job_dir:
                ownership.check_job_file(spec.output)
            else:
                ownership.check_output_file(spec.output)
        except ownership.OutputConflict as e:
            raise JobConflict(str(e)) from None

    def _refuse_if_running(self) -> None:
        from batchrun.job.errors import JobError
        from batchrun.job.listing import running_pid
        from batchrun.job.state import DamagedFile

        try:
            pid = running_pid(self.spec.job_dir)
        except DamagedFile:
            return  # not a lock file: the path checks say so, with the fix
        if pid is not None:
            raise JobError(f"job folder {self.spec.job_dir} is in use by another batchrun "
                           f"process (pid {pid}); wait for it or use another --job-dir")

    def _refuse_another_job(self) -> None:
        """The job folder's job.json against this job (input, options and, fingerprinted
        without loading it, the model), in words."""
        from batchrun.job.errors import JobConflict
        from batchrun.job.ownership import OutputConflict
        from batchrun.job.spec import different_job, job_changes, saved_manifest

        spec = self.spec
        old = saved_manifest(spec.job_dir)
        if old is None or spec.restart:
            return
        try:
            options = spec.options()
        except OutputConflict:
            return  # an output path that cannot be resolved: the path checks say so
        changes = job_changes(old, spec.input_fingerprint, options, self.model_fp(),
                              self.options.model, self.defaults_from)
        if changes:
            raise JobConflict(different_job(spec.job_dir, changes))

    def model_fp(self) -> str | None:
        """The model's fingerprint, from its files (not loaded); None if they cannot be found
        here (loading the model then says why)."""
        if self._model_fp is None:
            from batchrun.models import local_path, model_fingerprint

            try:
                self._model_fp = model_fingerprint(local_path(self.options.model))
            except Exception:
                return None
        return self._model_fp

    def _take_stdin(self) -> None:
        """Spool stdin into the job folder (its input from now on). The same rows as the
        spooled ones resume the job; other rows are refused while the job folder holds a job
        (unless restart), and never replace a file batchrun may not have written."""
        from batchrun.io.readers import spool
        from batchrun.job import manifest as mf
        from batchrun.job import ownership
        from batchrun.job.errors import JobConflict, JobError
        from batchrun.job.spec import different_job, saved_manifest

        spec = self.spec
        target = spec.input
        manifest = saved_manifest(spec.job_dir)
        try:
            ownership.check_job_dir(spec.job_dir, manifest is not None)
            ownership.check_job_file(target)
        except ownership.OutputConflict as e:
            raise JobConflict(str(e)) from None
        self._refuse_if_running()
        if manifest is not None and not spec.restart and not target.exists():
            # A job of a file's rows (a stdin job keeps its spool): refused before any write.
            raise JobConflict(different_job(spec.job_dir, [
                f"the input changed: {manifest['input'].get('path')} -> rows from stdin"]))
        partial = target.with_name(f".{target.name}.partial")
        stream = self._stdin if self._stdin is not None else _stdin_bytes()
        try:
            spec.job_dir.mkdir(parents=True, exist_ok=True)
            digest = spool(stream, partial)
            if target.is_file() and mf.file_sha256(target) == digest:
                return  # the rows the job already has: it resumes
            if target.exists() and manifest is not None and not spec.restart:
                raise JobConflict(different_job(spec.job_dir, [
                    f"the input changed: the rows on stdin differ from those the job read "
                    f"({target})"]))
            if target.exists() and manifest is None and not spec.restart:
                # a start that stopped before the job began left it, or it is not batchrun's
                raise JobConflict(
                    f"{target} holds other rows than those on stdin, and {spec.job_dir} holds "
                    f"no job yet: pass --restart to replace them, another --job-dir, or move "
                    f"{target} away")
            os.replace(partial, target)
            self._spool_written = manifest is None or spec.restart
            fsync_folder(spec.job_dir)
        except OSError as e:
            raise JobError(f"cannot keep the rows from stdin in {target}: "
                           f"{e.strerror or e}") from None
        finally:
            partial.unlink(missing_ok=True)
        spec._input_fingerprint = spec._rows_total = None  # the new rows

    def finished(self):
        """The job folder's durable progress when this same job (input and options: `check`;
        the model's files: fingerprinted, not loaded) already has a record for every row, so
        nothing is left to run; else None."""
        from batchrun.job.listing import report_problem
        from batchrun.job.state import DamagedFile, JobState, file_digest, read_json

        spec = self.spec
        if spec.restart or not (spec.job_dir / "job.json").is_file():
            return None
        try:
            progress = JobState(spec.job_dir, spec.results_path, spec.errors_path).saved()
            saved = read_json(spec.job_dir / "job.json")
            report = read_json(spec.job_dir / "report.json")
            if report is None or report_problem(report):
                return None  # a run writes it, or rewrites a damaged one
            if saved["model"]["fingerprint"] != self.model_fp():
                return None  # other weights: the run refuses the job, saying so
        except (DamagedFile, KeyError, TypeError):
            return None  # the run's recovery says what is wrong, and rewrites it
        total = spec.rows_total
        if progress is None or progress.spill_bytes or progress.next_index != total \
                or progress.rows_done + progress.rows_failed != total:
            return None
        for path, size, digest in ((spec.results_path, progress.results_bytes,
                                    progress.results_sha256),
                                   (spec.errors_path, progress.errors_bytes,
                                    progress.errors_sha256)):
            if (path.stat().st_size if path.is_file() else 0) != size or not digest \
                    or file_digest(path, size).hexdigest() != digest:
                return None  # the files and state.json disagree: the run's recovery mends it
        if spec.parquet_output and not spec.output.is_file():
            return None
        return progress

    def prepare(self, dry_run: bool = False) -> None:
        """Check the paths and load the model (or start the Ray runner). For a dry run: load
        the model here, without the disk prefix cache, and leave the job folder alone."""
        if dry_run:
            if self.runner is None:
                self.config = dataclasses.replace(self.config, cache_dir=None)
                self.runner = _local_runner(self)
            return
        self.check()
        if self.runner is None:
            if self.config.speculate == "draft":  # said here, not by every Ray worker
                from batchrun.models import DraftModelError, ModelError, check_local, resolve

                try:
                    check_local(resolve(self.config.draft_model))
                except ModelError as e:
                    raise DraftModelError(f"the draft model {self.config.draft_model} could "
                                          f"not be loaded: {e}") from None
            try:
                self.runner = (_ray_runner if self.options.ray.address else _local_runner)(self)
            except Exception:  # a bad model: Ctrl-C keeps the spool (the hint names it)
                self.discard_spool()
                raise

    def run(self) -> dict:
        """Process every pending row; returns report.json's content. Raises
        batchrun.job.errors.Interrupted after Ctrl-C (progress kept)."""
        self.prepare()
        try:
            self.report = self.runner.run()
        except Exception:
            self.discard_spool()
            raise
        return self.report

    def close(self) -> None:
        """Done with the job's model: the prefix cache's pending blocks are written and the
        engine lets go of its threads and its cache folder (a later run loads the model
        again; with Ray, its actors hold the models and end with the cluster)."""
        if self.runner is not None and not self.options.ray.address:  # Ray's are its actors'
            self.runner.engine.close()
        self.runner = None

    def results(self) -> Iterator[dict]:
        """Every row's record in input order: its result, or its error record."""
        from batchrun.io.readers import read_rows
        from batchrun.job.recovery import ordered_records

        rows = read_rows(self.spec.input, 0, self.spec.rows.limits.row_bytes)
        yield from ordered_records(self.spec.results_path, self.spec.errors_path, rows)

    def status(self) -> dict:
        """Progress so far: report.json's figures with state.json's counts (the durable rows,
        those finished ahead of a slow row included), and whether a process is running the
        job now."""
        from batchrun.job.listing import read_job

        if not (self.spec.job_dir / "job.json").is_file():
            return {"running": False}
        summary = read_job(self.spec.job_dir)
        return {**summary.figures(), "running": summary.status == "running"}

    def dry_run(self, probe_rows: int = PROBE_ROWS) -> DryRun:
        """Load the model, read every row and count its prompt tokens, measure how many a
        prefix cache would reuse, and time `probe_rows` rows through the engine to estimate the
        job's time. Writes no job folder, no output and no prefix-cache entry."""
        if self.from_stdin:
            raise UsageError("a dry run reads a file: spool stdin to one first")
        self.prepare(dry_run=True)
        try:
            return count_and_probe(self.engine, self.spec, probe_rows)
        finally:
            self.engine.close()


def _stdin_bytes() -> BinaryIO:
    import sys

    return sys.stdin.buffer


def _local_runner(job: Job):
    """The job runner with the model loaded in this process (a text or a vision engine)."""
    from batchrun.engine.decoding.tool_grammar import ToolForm
    from batchrun.job.limits import image_cache
    from batchrun.job.runner import JobRunner

    o, spec = job.options, job.spec
    engine = load_engine(o.model, job.config, o.media.vision or None)
    spec.rows.limits = spec.rows.limits.for_context(engine.context_length)
    if engine.backend.accepts_images:
        spec.rows.images = image_cache(spec.rows.limits)
    elif o.media.image_column:
        raise UsageError(IMAGE_COLUMN_NEEDS_VISION)
    if job.constraint is not None:
        from batchrun.engine.types import ConstraintError

        try:
            engine.check_constraint(job.constraint)
        except ConstraintError as e:
            raise UsageError(str(e)) from None
    spec.rows.check_constraint = engine.check_constraint
    spec.rows.tool_form = ToolForm.of(engine.markup, engine.encode_text)
    return JobRunner(engine, spec, o.model or "demo", engine.model_path, device_name())


def _ray_runner(job: Job):
    """The job runner for a Ray address: the model is loaded by the Ray actors, not here."""
    try:
        import ray  # noqa: F401
    except ImportError:
        from batchrun.job.distributed import ray_missing

        raise MissingExtra(ray_missing()) from None
    from batchrun.job.distributed import RayJobRunner
    from batchrun.models import is_vision_config, local_path, model_fingerprint, read_config

    o = job.options
    path = local_path(o.model)  # the snapshot the actors will load: fingerprinted
    vision = o.media.vision or is_vision_config(read_config(path))
    return RayJobRunner(job.spec, o.model, o.model or "demo", path, model_fingerprint(path),
                        job.config, f"ray {o.ray.address}", o.ray, vision)


def device_name() -> str:
    import mlx.core as mx

    device = mx.default_device()
    return f"{device.type.name} ({mx.device_info().get('device_name', '')})"
