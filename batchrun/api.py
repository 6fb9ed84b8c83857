"""batchrun from Python: `Engine.load(...)` for the batched engine, `Job(...)` for a batch job
with the command line's job folder, resume and exactly-once output.

    import batchrun
    engine = batchrun.Engine.load()                     # the demo model; or model="path or id"
    outs = engine.generate(["Once upon", [{"role": "user", "content": "hi"}]], max_tokens=8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun.engine.load import load_engine
from batchrun.engine.request import EngineConfig, SamplingParams
from batchrun.models import MissingExtra  # re-exported: the CLI catches it

_SAMPLING = SamplingParams()


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


INPUT_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".parquet")
# Output suffixes that promise a format batchrun does not write (anything else is JSONL).
OTHER_FORMATS = frozenset({".gz", ".bz2", ".xz", ".zst", ".zip", ".csv", ".tsv", ".json",
                           ".xlsx", ".arrow", ".feather"})


class UsageError(ValueError):
    """An option that cannot work (the command line's exit 2); the message names it."""


@dataclass(slots=True)
class RunOptions:
    """The `run` command's options, under the same names (`--max-tokens` is max_tokens)."""

    model: str | None = None
    output: Path | None = None
    job_dir: Path | None = None
    max_concurrency: int | None = None
    # Sampling defaults for rows that set none: SamplingParams' own.
    max_tokens: int = _SAMPLING.max_tokens
    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    top_k: int = _SAMPLING.top_k
    min_p: float = _SAMPLING.min_p
    seed: int | None = _SAMPLING.seed
    stop: tuple[str, ...] = _SAMPLING.stop
    json_schema: Path | None = None
    choices: str | list[str] | None = None
    regex: str | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    image_column: str | None = None
    media_root: tuple[Path, ...] = ()  # folders image paths may be read from (+ the input's)
    allow_private_urls: bool = False
    media_timeout: float = 30.0
    vision: bool = False
    system: str | None = None
    prompt_template: str | None = None
    id_column: str | None = None
    memory_utilization: float = 0.85
    prefill_batch_size: int | None = None  # None: rows are bounded by tokens (the device's)
    prefill_step_size: int = 2048
    cache_dir: Path | None = None
    no_prefix_cache: bool = False
    no_shared_prefix: bool = False
    restart: bool = False
    quiet: bool = True
    ray_address: str | None = None
    ray_actors: int = 2
    ray_num_cpus: float = 1.0
    ray_num_gpus: float = 0.0
    ray_slice_rows: int = 64


class Job:
    """A batch job over an input file, with the command line's job folder: resumable, every
    row exactly once, results in input order.

        job = batchrun.Job("reviews.parquet", job_dir="jobs/x", choices=["pos", "neg"])
        report = job.run()
        for record in job.results(): ...
    """

    def __init__(self, input: str | Path, **options):
        try:
            self.options = RunOptions(**options)
        except TypeError:
            known = ", ".join(f.name for f in dataclasses.fields(RunOptions))
            unknown = sorted(set(options) - {f.name for f in dataclasses.fields(RunOptions)})
            raise UsageError(f"unknown options {', '.join(unknown)}; known: {known}") from None
        self.input = Path(input)
        self.spec, self.config, self.constraint = _plan(self.input, self.options)
        self.runner = None
        self.report: dict | None = None

    @property
    def engine(self):
        return self.runner.engine if self.runner is not None else None

    def check(self) -> None:
        """Refuse, before the model loads, an output or job folder this job may not use
        (JobError / JobConflict from batchrun.job.runner)."""
        from batchrun.job.runner import check_paths

        check_paths(self.spec)

    def finished(self):
        """The job folder's durable progress when this same job (input and options: `check`;
        the model's files: fingerprinted, not loaded) already has a record for every row, so
        nothing is left to run; else None."""
        from batchrun.job.state import DamagedFile, JobState, read_json
        from batchrun.models import local_path, model_fingerprint

        spec = self.spec
        if spec.restart or not (spec.job_dir / "job.json").is_file():
            return None
        try:
            progress = JobState(spec.job_dir, spec.results_path, spec.errors_path).saved()
            saved = read_json(spec.job_dir / "job.json")
            if read_json(spec.job_dir / "report.json") is None:
                return None  # a run writes it
            if saved["model"]["fingerprint"] != model_fingerprint(local_path(self.options.model)):
                return None  # other weights: the run refuses the job, saying so
        except (DamagedFile, KeyError, TypeError):
            return None  # the run's recovery says what is wrong, and rewrites it
        except Exception:  # the model cannot be found here: loading it says why
            return None
        total = spec.rows_total
        if progress is None or progress.spill_bytes or progress.next_index != total \
                or progress.rows_done + progress.rows_failed != total:
            return None
        for path, size in ((spec.results_path, progress.results_bytes),
                           (spec.errors_path, progress.errors_bytes)):
            if (path.stat().st_size if path.is_file() else 0) != size:
                return None  # the files and state.json disagree: the run's recovery mends it
        if spec.parquet_output and not spec.output.is_file():
            return None
        return progress

    def prepare(self) -> None:
        """Check the paths and load the model (or start the Ray runner)."""
        self.check()
        if self.runner is None:
            self.runner = (_ray_runner if self.options.ray_address else _local_runner)(self)

    def run(self) -> dict:
        """Process every pending row; returns report.json's content. Raises
        batchrun.job.runner.Interrupted after Ctrl-C (progress kept)."""
        self.prepare()
        self.report = self.runner.run()
        return self.report

    def results(self) -> Iterator[dict]:
        """Every row's record in input order: its result, or its error record."""
        from batchrun.job.recovery import ordered_records

        yield from ordered_records(self.spec.results_path, self.spec.errors_path)

    def status(self) -> dict:
        """Progress so far: report.json's figures (rows done / failed / pending, throughput),
        and whether a process is running the job now."""
        from batchrun.job.state import JobLock, read_json

        report = read_json(self.spec.job_dir / "report.json") or {}
        lock = JobLock(self.spec.job_dir)
        running = self.spec.job_dir.is_dir() and not lock.acquire()
        if not running and lock._fd is not None:
            lock.release()
        return {**report, "running": running}


def _plan(input_path: Path, o: RunOptions):
    """The job's spec, engine config and constraint from its options (UsageError if bad)."""
    from batchrun.engine.request import SamplingParams
    from batchrun.job.rows import RowOptions
    from batchrun.job.runner import JobSpec, default_job_dir
    from batchrun.paths import default_cache_dir

    if not input_path.is_file():
        raise UsageError(f"input file not found: {input_path}")
    if not input_path.name.lower().endswith(INPUT_SUFFIXES):
        raise UsageError(f"{input_path}: batchrun reads JSONL ({', '.join(INPUT_SUFFIXES[:-1])}) "
                         f"or Parquet (.parquet), and job files (.toml); rename the file if it "
                         "holds one JSON object a line")
    if o.prompt_template is not None and not o.prompt_template.strip():
        raise UsageError("--prompt-template must not be empty")
    constraint = _constraint(o)
    try:
        defaults = SamplingParams(
            max_tokens=o.max_tokens, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
            min_p=o.min_p, seed=o.seed, stop=tuple(o.stop),
            logprobs=bool(o.logprobs or o.top_logprobs), top_logprobs=o.top_logprobs,
            constraint=constraint)
        config = EngineConfig(max_concurrency=o.max_concurrency,
                              prefill_batch_size=o.prefill_batch_size,
                              prefill_step_size=o.prefill_step_size,
                              memory_utilization=o.memory_utilization,
                              prefix_cache=not o.no_prefix_cache,
                              shared_prefix=not o.no_shared_prefix,
                              cache_dir=str(o.cache_dir or default_cache_dir()))
    except ValueError as e:
        raise UsageError(str(e)) from None
    job_dir = Path(o.job_dir) if o.job_dir else default_job_dir(input_path)
    output = Path(o.output) if o.output else job_dir / "results.jsonl"
    if output.suffix.lower() in OTHER_FORMATS:
        raise UsageError(f"-o {output}: batchrun writes JSONL (.jsonl) or Parquet (.parquet), "
                         f"not {output.suffix}")
    roots = [o.media_root] if isinstance(o.media_root, str | Path) else o.media_root
    timeout = o.media_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise UsageError(f"--media-timeout must be over 0 seconds, got {o.media_timeout!r}")
    rows = RowOptions(defaults, o.system, o.prompt_template, o.id_column, o.n,
                      image_column=o.image_column,
                      media_roots=tuple(Path(root).absolute() for root in roots),
                      allow_private_urls=bool(o.allow_private_urls),
                      media_timeout=float(o.media_timeout))
    spec = JobSpec(input_path, job_dir, output, o.model, rows, restart=o.restart, quiet=o.quiet)
    return spec, config, constraint


def _constraint(o: RunOptions):
    """The job-wide constraint from json_schema, choices or regex (at most one)."""
    from batchrun.engine.constrain import Constraint, ConstraintError

    given = [f"--{name.replace('_', '-')}" for name in ("json_schema", "choices", "regex")
             if getattr(o, name) is not None]
    if len(given) > 1:
        raise UsageError(f"give at most one of {', '.join(given)}")
    try:
        if o.json_schema is not None:
            path = Path(o.json_schema)
            if not path.is_file():
                raise UsageError(f"--json-schema: file not found: {path}")
            return Constraint.json_schema(path.read_text())
        if o.choices is not None:
            choices = o.choices
            if isinstance(choices, str):
                choices = [c.strip() for c in choices.split(",")]
            return Constraint.choices(list(choices))
        if o.regex is not None:
            return Constraint.regex(o.regex)
    except ConstraintError as e:
        raise UsageError(f"{given[0]}: {e}") from None
    return None


def _local_runner(job: Job):
    """The job runner with the model loaded in this process (a text or a vision engine)."""
    from batchrun.job.runner import JobRunner

    o, spec = job.options, job.spec
    engine = load_engine(o.model, job.config, o.vision or None)
    if engine.backend.accepts_images:
        from batchrun.io.media import ImageCache

        spec.rows.images = ImageCache()
    elif o.image_column:
        raise UsageError("--image-column needs a vision model (pass --model with one, or "
                         "--vision to force the vision path)")
    if job.constraint is not None:
        from batchrun.engine.constrain import ConstraintError

        try:
            engine.check_constraint(job.constraint)
        except ConstraintError as e:
            raise UsageError(str(e)) from None
    spec.rows.check_constraint = engine.check_constraint
    return JobRunner(engine, spec, o.model or "demo", engine.model_path, device_name())


def _ray_runner(job: Job):
    """The job runner for ray_address: the model is loaded by the Ray actors, not here."""
    try:
        import ray  # noqa: F401
    except ImportError:
        from batchrun.job.distributed import ray_missing

        raise MissingExtra(ray_missing()) from None
    from batchrun.job.distributed import RayJobRunner, RayOptions
    from batchrun.models import is_vision_config, local_path, model_fingerprint, read_config

    o = job.options
    path = local_path(o.model)  # the snapshot the actors will load: fingerprinted
    vision = o.vision or is_vision_config(read_config(path))
    ray_options = RayOptions(o.ray_address, o.ray_actors, o.ray_num_cpus, o.ray_num_gpus,
                             o.ray_slice_rows)
    return RayJobRunner(job.spec, o.model, o.model or "demo", path, model_fingerprint(path),
                        job.config, f"ray {o.ray_address}", ray_options, vision)


def device_name() -> str:
    import mlx.core as mx

    device = mx.default_device()
    return f"{device.type.name} ({mx.device_info().get('device_name', '')})"
