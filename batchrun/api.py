"""batchrun from Python: `Engine.load(...)` for the batched engine, `Job(...)` for a batch job
with the command line's job folder, resume and exactly-once output.

    import batchrun
    engine = batchrun.Engine.load()                     # the demo model; or model="path or id"
    outs = engine.generate(["Once upon", [{"role": "user", "content": "hi"}]], max_tokens=8)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from batchrun.engine.config import EngineConfig
from batchrun.engine.load import load_engine
from batchrun.engine.types import SamplingParams
from batchrun.io.files import fsync_folder
from batchrun.models import MissingExtra  # re-exported: the CLI catches it

if TYPE_CHECKING:
    from batchrun.job.limits import RowLimits

_SAMPLING = SamplingParams()
log = logging.getLogger("batchrun")
# The sampling defaults a model's generation_config.json may set (its key -> ours), applied as
# vLLM applies them: where neither the row nor a flag says otherwise.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                          "max_new_tokens": "max_tokens"}
STDIN = "-"  # the input name for rows read from stdin
PROBE_ROWS = 8  # rows a dry run times through the engine


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
    job_dir: Path | None = None  # required for rows from stdin (input "-")
    format: str | None = None  # "jsonl" or "parquet" whatever the input's suffix
    max_concurrency: int | None = None
    # Sampling defaults for rows that set none; None: the model's generation_config.json's,
    # else SamplingParams' own (`Job.sampling_defaults` says which).
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = _SAMPLING.seed
    stop: tuple[str, ...] = _SAMPLING.stop
    max_thinking_tokens: int | None = None
    # An OpenAI row whose body.model names none of these is that row's error (None: any).
    served_model_name: str | tuple[str, ...] | None = None
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
    expected_column: str | None = None  # each row's right answer: records and report accuracy
    memory_utilization: float = 0.85
    prefill_batch_size: int | None = None  # None: rows are bounded by tokens (the device's)
    prefill_step_size: int = 2048
    cache_dir: Path | None = None
    no_prefix_cache: bool = False
    no_shared_prefix: bool = False
    # Speculative decoding while few rows run: "off", "ngram" or "draft" (None: draft when
    # draft_model is given, else off).
    speculate: str | None = None
    draft_model: str | None = None
    # None: the method's default on this device (a number given without speculation: said)
    draft_tokens: int | None = None
    restart: bool = False
    quiet: bool = True
    ray_address: str | None = None
    ray_actors: int = 2
    ray_num_cpus: float = 1.0
    ray_num_gpus: float = 0.0
    ray_slice_rows: int = 64
    # Row size limits as NAME=VALUE items or a mapping (job.limits.RowLimits; docs/limits.md).
    limit: tuple[str, ...] | dict | None = None


class Job:
    """A batch job over an input file, with the command line's job folder: resumable, every
    row exactly once, results in input order.

        job = batchrun.Job("reviews.parquet", job_dir="jobs/x", choices=["pos", "neg"])
        report = job.run()
        for record in job.results(): ...

    `input` "-" reads JSONL rows from `stdin` (default: this process's): they are spooled into
    the job folder first (`<job_dir>/stdin.jsonl`), so the job resumes like any other.
    """

    def __init__(self, input: str | Path, *, stdin: BinaryIO | None = None, **options):
        try:
            self.options = RunOptions(**options)
        except TypeError:
            known = ", ".join(f.name for f in dataclasses.fields(RunOptions))
            unknown = sorted(set(options) - {f.name for f in dataclasses.fields(RunOptions)})
            raise UsageError(f"unknown options {', '.join(unknown)}; known: {known}") from None
        self.from_stdin = str(input) == STDIN
        self._stdin = stdin
        self._stdin_taken = False  # spooled into the job folder (once: check() may repeat)
        self._spool_written = False  # this Job wrote the spool, for a job that had not begun
        self.spec, self.config, self.constraint, self.defaults_from = \
            _plan(Path(input), self.options)
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
        from batchrun.job.spec import saved_manifest

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
        from batchrun.job.spec import saved_manifest

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
                self.runner = (_ray_runner if self.options.ray_address else _local_runner)(self)
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
        if self.runner is not None and not self.options.ray_address:  # Ray's are its actors'
            self.runner.engine.close()
        self.runner = None

    def results(self) -> Iterator[dict]:
        """Every row's record in input order: its result, or its error record."""
        from batchrun.job.recovery import ordered_records

        yield from ordered_records(self.spec.results_path, self.spec.errors_path)

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
            return _dry_run(self.engine, self.spec, probe_rows)
        finally:
            self.engine.close()


@dataclass(slots=True)
class DryRun:
    """What `Job.dry_run` found: rows, prompt tokens, the share a prefix cache would reuse, and
    a time estimate from a probe (None without a row to probe)."""

    rows: int
    row_errors: int
    first_error: str | None
    prompt_tokens: int
    shared_tokens: int  # prompt tokens in blocks an earlier row already has (computed once)
    sharing_rows: int  # rows that start with such blocks
    max_new_tokens: int  # the most tokens the rows may generate (their max_tokens, summed)
    max_concurrency: int = 0  # the engine's
    probe_rows: int = 0
    probe_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    mean_completion_tokens: float = 0.0
    estimate_s: float | None = None

    @property
    def shared_share(self) -> float:
        return self.shared_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _dry_run(engine, spec, probe_rows: int) -> DryRun:
    """Count every row's prompt tokens and the shared-prefix share, then probe."""
    from collections import OrderedDict

    from batchrun.cache.prefix import block_keys
    from batchrun.io.readers import read_rows
    from batchrun.job.rows import RowError, build_task, read_error

    total = spec.rows_total
    # Probe rows spread over the input: the first row at or after each of these.
    wanted = sorted({i * total // probe_rows for i in range(min(probe_rows, total))},
                    reverse=True)
    probe, seen = [], OrderedDict()
    block = engine.config.prefix_block_size
    found = DryRun(0, 0, None, 0, 0, 0, 0, engine.max_concurrency)
    for raw in read_rows(spec.input, 0, spec.rows.limits.row_bytes):
        found.rows += 1
        task = (read_error(raw, spec.rows.id_column) if raw.error is not None
                else build_task(raw.value, raw.index, raw.line, engine.prompts, spec.rows))
        if isinstance(task, RowError):
            found.row_errors += 1
            found.first_error = found.first_error or f"line {task.line}: {task.message}"
            continue
        ids = task.prompt_ids
        found.prompt_tokens += len(ids)
        found.max_new_tokens += task.params.max_tokens * task.n
        shared = _shared_blocks(block_keys(ids, block, b""), seen)
        if shared:
            found.sharing_rows += 1
            found.shared_tokens += min(shared * block, len(ids) - 1)  # one token is computed
        if wanted and raw.index >= wanted[-1]:
            wanted.pop()
            probe.append(task)
    if probe:
        _probe(engine, probe, found)
    return found


SHARED_KEYS_KEPT = 1 << 18  # block keys a dry run remembers (a prefix cache is bounded too)


def _shared_blocks(keys: list[bytes], seen) -> int:
    """How many leading blocks of a prompt an earlier row already has; remembers its own."""
    shared = 0
    for key in keys:
        if key not in seen:
            break
        seen.move_to_end(key)
        shared += 1
    for key in keys[shared:]:
        seen[key] = None
    while len(seen) > SHARED_KEYS_KEPT:
        seen.popitem(last=False)
    return shared


def _probe(engine, tasks: list, found: DryRun) -> None:
    """Run `tasks` through the engine; extrapolate to every row from its prefill and decode
    rates (a probe batch is small: a full one decodes faster, so this leans long)."""
    import time

    start = time.perf_counter()
    for task in tasks:
        for params in task.sample_params():
            engine.add_tokens(task.prompt_ids, params, task.vision)
    completion = 0
    while engine.has_work():
        completion += sum(out.completion_tokens for out in engine.step())
    stats = engine.stats
    found.probe_rows = len(tasks)
    found.probe_s = time.perf_counter() - start
    found.prefill_tokens_per_s = stats.prefill_tokens_per_s
    found.decode_tokens_per_s = stats.decode_tokens_per_s
    found.mean_completion_tokens = completion / len(tasks)
    rows = found.rows - found.row_errors
    generated = min(found.mean_completion_tokens * rows, found.max_new_tokens)
    computed = found.prompt_tokens - found.shared_tokens
    per_row = found.probe_s / len(tasks)
    prefill = computed / found.prefill_tokens_per_s if found.prefill_tokens_per_s else 0.0
    decode = generated / found.decode_tokens_per_s if found.decode_tokens_per_s else 0.0
    found.estimate_s = prefill + decode if prefill + decode > 0 else per_row * rows


def different_job(job_dir: Path, changes: list[str]) -> str:
    """The refusal of a job folder that holds another job: what differs, and what to do."""
    return (f"{job_dir} holds a different job, so it was not resumed:\n"
            + "".join(f"  {c}\n" for c in changes)
            + f"To keep both jobs, pass another --job-dir; to run this job in its place, move "
            f"{job_dir} away (its progress goes with it).")


def job_changes(old: dict, input_fp: dict, options: dict, model_fp: str | None,
                model: str | None, defaults_from: dict[str, str]) -> list[str]:
    """What differs between the job in a job folder (its job.json) and this one, one line
    each: the option (and its flag), the old and the new value."""
    changes = []
    if old["input"]["sha256"] != input_fp["sha256"]:
        changes.append(f"the input changed: {old['input']['path']} "
                       f"({old['input']['size']:,} bytes) -> {input_fp['path']} "
                       f"({input_fp['size']:,} bytes)")
    if model_fp is not None and old["model"]["fingerprint"] != model_fp:
        changes.append(f"the model changed: {old['model']['name']} "
                       f"({old['model']['path']}) -> {model or 'demo'} (other files)")
    before, after = _flat(old["options"]), _flat(options)
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a != b:
            where = defaults_from.get(key)
            why = " (the model's generation_config.json)" if where == "generation_config.json" \
                else ""
            changes.append(f"{key} ({OPTION_FLAGS.get(key, 'option')}): {_shown(a)} -> "
                           f"{_shown(b)}{why}")
    return changes


# job.json's option names and the flags that set them.
OPTION_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature",
                "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed",
                "stop": "--stop", "logprobs": "--logprobs", "top_logprobs": "--top-logprobs",
                "constraint": "--json-schema, --choices or --regex",
                "max_thinking_tokens": "--max-thinking-tokens", "system": "--system",
                "prompt_template": "--prompt-template", "id_column": "--id-column", "n": "--n",
                "image_column": "--image-column", "output": "-o",
                "served_model_names": "--served-model-name",
                "repetition_penalty": "generation_config.json"}


def _flat(options: dict) -> dict:
    """job.json's options with the sampling defaults' fields at the top level."""
    flat = {k: v for k, v in options.items() if k != "sampling"}
    sampling = options.get("sampling")
    if isinstance(sampling, dict):
        flat.update(sampling)
    return flat


def _shown(value: Any, limit: int = 60) -> str:
    """An option's value in a message: short, JSON-like, `unset` for None."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _stdin_bytes() -> BinaryIO:
    import sys

    return sys.stdin.buffer


def generation_defaults(model: str | None) -> dict[str, Any]:
    """The sampling defaults the model's generation_config.json sets, under our names
    (max_new_tokens is max_tokens); {} when it has none or cannot be read."""
    config = _generation_config(model)
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items()
            if config.get(theirs) is not None}


def _generation_config(model: str | None) -> dict:
    """generation_config.json of the model: a local folder, or a Hugging Face id (from the
    local hub cache, else fetched alone: the model's files follow when it loads)."""
    from batchrun.models import resolve

    name = resolve(model)
    path = Path(name).expanduser()
    if path.is_dir():
        file = path / "generation_config.json"
        if not file.is_file():
            return {}
    elif path.is_absolute() or name.startswith((".", "~")):
        return {}  # a local folder that is not there: loading the model says so
    else:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        from batchrun.models import hub_unreachable

        # The cache alone: hf_hub_download(local_files_only=True) builds its request headers
        # first, which fetches the Hub's agent registry (huggingface_hub 2.4) over the network.
        try:
            cached = try_to_load_from_cache(name, "generation_config.json")
        except Exception:  # not a repository id the cache could hold
            return {}
        if isinstance(cached, str):
            file = Path(cached)
        elif cached is not None or hub_unreachable():  # the cache knows there is none; or
            return {}  # the Hub cannot be reached: loading the model says so, without retries
        else:
            try:
                file = Path(hf_hub_download(name, "generation_config.json"))
            except Exception:  # none, or unreachable: loading the model says why if it matters
                return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s cannot be read (%s); its sampling defaults are not used", file, e)
        return {}
    return config if isinstance(config, dict) else {}


def _sampling_defaults(o: RunOptions) -> tuple[dict[str, Any], dict[str, str]]:
    """The job's sampling defaults: the flags, else the model's generation_config.json, else
    batchrun's; and where each came from."""
    generation = generation_defaults(o.model)
    values, sources = {}, {}
    for name in GENERATION_CONFIG_KEYS.values():
        flag = getattr(o, name, None)
        if flag is not None:
            values[name], sources[name] = flag, "flag"
        elif name in generation:
            values[name], sources[name] = generation[name], "generation_config.json"
        else:
            values[name], sources[name] = getattr(_SAMPLING, name), "batchrun"
    return values, sources


def served_names(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """--served-model-name NAME[,ALIAS...] as a tuple of names (empty: any name)."""
    if value is None:
        return ()
    parts = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(p).strip() for p in parts)
    if not names or not all(names):
        raise UsageError(f"--served-model-name takes names separated by commas, got {value!r}")
    return names


def _input_path(input_path: Path, o: RunOptions) -> Path:
    """The file the job reads: the input, or for stdin the spool in the job folder."""
    from batchrun.io.readers import FORMATS, declare_format

    if o.format is not None and o.format not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {o.format!r}")
    if str(input_path) == STDIN:
        if not o.job_dir:
            raise UsageError("rows from stdin (-) need --job-dir DIR: batchrun keeps them in "
                             "DIR/stdin.jsonl, so the job can resume")
        return Path(o.job_dir) / f"stdin.{o.format or 'jsonl'}"
    if not input_path.is_file():
        raise UsageError(f"input file not found: {input_path}")
    if o.format is not None:
        declare_format(input_path, o.format)
    elif not input_path.name.lower().endswith(INPUT_SUFFIXES):
        raise UsageError(f"{input_path}: batchrun reads JSONL ({', '.join(INPUT_SUFFIXES[:-1])}) "
                         f"or Parquet (.parquet), and job files (.toml); pass --format jsonl "
                         "or --format parquet to read it as one")
    return input_path


def _plan(input_path: Path, o: RunOptions):
    """The job's spec, engine config, constraint and where its sampling defaults come from
    (UsageError if an option is bad)."""
    # The job's code loads with its spec, the engine and mlx-lm with it, before any check:
    # mlx-lm raises the open-file limit as it loads, so a limit too low is said first, and as
    # such (the command line's one line for it).
    import batchrun.job.runner  # noqa: F401
    from batchrun.engine.types import SamplingParams
    from batchrun.job.limits import parse_limits
    from batchrun.job.rows import RowOptions
    from batchrun.job.spec import JobSpec, default_job_dir
    from batchrun.paths import default_cache_dir

    from_stdin = str(input_path) == STDIN
    for flag, value in (("--model", o.model), ("--draft-model", o.draft_model)):
        if value is not None and not str(value).strip():  # `--model "$UNSET"`: not the demo
            raise UsageError(f"{flag} is empty: pass a model folder or a Hugging Face id")
    input_path = _input_path(input_path, o)
    _check_template(o.prompt_template)
    _check_image_column(o)
    try:
        limits = parse_limits(o.limit)
    except ValueError as e:
        raise UsageError(str(e)) from None
    constraint = _constraint(o, limits)
    sampling, sources = _sampling_defaults(o)
    try:
        defaults = SamplingParams(
            **sampling, seed=o.seed, stop=tuple(o.stop),
            logprobs=bool(o.logprobs or o.top_logprobs), top_logprobs=o.top_logprobs,
            constraint=constraint, max_thinking_tokens=o.max_thinking_tokens)
    except ValueError as e:
        given = [k for k, v in sources.items() if v == "generation_config.json"]
        why = (f" (the model's generation_config.json sets {', '.join(given)}; a flag "
               "overrides it)") if given else ""
        raise UsageError(f"{e}{why}") from None
    if o.draft_model and o.speculate in ("off", "ngram"):
        log.warning("--draft-model %s is not used: --speculate is %s", o.draft_model, o.speculate)
    method = o.speculate or ("draft" if o.draft_model else "off")
    if o.draft_tokens is not None and method == "off":
        log.warning("--draft-tokens %s is not used: no speculation (pass --speculate ngram or "
                    "--draft-model)", o.draft_tokens)
    if o.speculate == "draft" and not o.draft_model:
        raise UsageError("--speculate draft needs --draft-model (a small model made with the "
                         "same tokenizer as the model)")
    try:
        config = EngineConfig(max_concurrency=o.max_concurrency,
                              prefill_batch_size=o.prefill_batch_size,
                              prefill_step_size=o.prefill_step_size,
                              memory_utilization=o.memory_utilization,
                              prefix_cache=not o.no_prefix_cache,
                              shared_prefix=not o.no_shared_prefix,
                              speculate=method,
                              draft_model=str(o.draft_model) if o.draft_model else None,
                              draft_tokens=o.draft_tokens,
                              cache_dir=str(o.cache_dir or default_cache_dir()))
    except ValueError as e:
        raise UsageError(str(e)) from None
    job_dir = Path(o.job_dir) if o.job_dir else default_job_dir(input_path)
    _check_job_dir_path(job_dir)
    output = Path(o.output) if o.output else job_dir / "results.jsonl"
    if output.suffix.lower() in OTHER_FORMATS:
        raise UsageError(f"-o {output}: batchrun writes JSONL (.jsonl) or Parquet (.parquet), "
                         f"not {output.suffix}")
    roots = [o.media_root] if isinstance(o.media_root, str | Path) else list(o.media_root)
    timeout = o.media_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise UsageError(f"--media-timeout must be over 0 seconds, got {o.media_timeout!r}")
    rows = RowOptions(defaults, o.system, o.prompt_template, o.id_column, o.n,
                      image_column=o.image_column,
                      media_roots=tuple(Path(root).absolute() for root in roots),
                      allow_private_urls=bool(o.allow_private_urls),
                      media_timeout=float(o.media_timeout),
                      served_model_names=served_names(o.served_model_name),
                      expected_column=o.expected_column, limits=limits)
    if from_stdin:  # relative image paths in rows from stdin start at the current folder
        rows.base_dir = Path.cwd()
    spec = JobSpec(input_path, job_dir, output, o.model, rows, restart=o.restart, quiet=o.quiet)
    return spec, config, constraint, sources


def _check_job_dir_path(job_dir: Path) -> None:
    """--job-dir must name a folder, or a path where one can be made."""
    for path in (job_dir, *job_dir.parents):
        if os.path.lexists(path):
            if path.is_dir():
                return
            kind = "a symbolic link" if path.is_symlink() else "a file"
            what = f"is {kind}, not a folder" if path == job_dir else \
                f"cannot be a folder: {path} is {kind}"
            raise UsageError(f"--job-dir {job_dir} {what}: pass a folder's path (it is made if "
                             "absent)")


def _check_image_column(o: RunOptions) -> None:
    """--image-column needs a vision model: said before the model loads when its config is
    here to read (else loading it says so)."""
    if not o.image_column or o.vision or o.ray_address:
        return
    from batchrun.models import is_vision_config, read_config, resolve

    config = read_config(resolve(o.model))
    if config and not is_vision_config(config):
        raise UsageError(IMAGE_COLUMN_NEEDS_VISION)


IMAGE_COLUMN_NEEDS_VISION = ("--image-column needs a vision model (pass --model with one, or "
                             "--vision to force the vision path)")


def _constraint(o: RunOptions, limits: RowLimits):
    """The job-wide constraint from json_schema, choices or regex (at most one), checked to
    compile as far as it can be without the model's tokenizer."""
    from batchrun.engine.types import Constraint, ConstraintError
    from batchrun.job.rows import RowRejected, check_choices

    given = [f"--{name.replace('_', '-')}" for name in ("json_schema", "choices", "regex")
             if getattr(o, name) is not None]
    if len(given) > 1:
        raise UsageError(f"give at most one of {', '.join(given)}")
    try:
        if o.json_schema is not None:
            path = Path(o.json_schema)
            if not path.is_file():
                raise UsageError(f"--json-schema: file not found: {path}")
            constraint = Constraint.json_schema(path.read_text())
        elif o.choices is not None:
            choices = o.choices
            if isinstance(choices, str):
                choices = [c.strip() for c in choices.split(",")]
            check_choices(list(choices), limits, "--choices")
            constraint = Constraint.choices(list(choices))
        elif o.regex is not None:
            constraint = Constraint.regex(o.regex)
        else:
            return None
    except ConstraintError as e:
        raise UsageError(f"{given[0]}: {e}") from None
    except RowRejected as e:
        raise UsageError(str(e)) from None
    problem = _grammar_problem(constraint)
    if problem:
        raise UsageError(f"{given[0]}: {constraint.describe()} does not compile: {problem}")
    return constraint


def _grammar_problem(constraint) -> str | None:
    """Why the constraint's grammar is invalid whatever the tokenizer (a bad regex, an
    unknown schema type), or None."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(constraint.grammar())
    except ValueError as e:
        error = str(e)
    if not error or error.startswith("WARNING"):
        return None
    return " ".join(error.split())[:300]


def _check_template(template: str | None) -> None:
    """--prompt-template must be a format string (its columns are checked row by row)."""
    import string

    if template is None:
        return
    if not template.strip():
        raise UsageError("--prompt-template must not be empty")
    try:
        list(string.Formatter().parse(template))
    except ValueError as e:
        raise UsageError(f"--prompt-template {template!r}: {e} (write {{{{ and }}}} for "
                         "literal braces)") from None


def _local_runner(job: Job):
    """The job runner with the model loaded in this process (a text or a vision engine)."""
    from batchrun.job.limits import image_cache
    from batchrun.job.runner import JobRunner

    o, spec = job.options, job.spec
    engine = load_engine(o.model, job.config, o.vision or None)
    spec.rows.limits = spec.rows.limits.for_context(engine.context_length)
    if engine.backend.accepts_images:
        spec.rows.images = image_cache(spec.rows.limits)
    elif o.image_column:
        raise UsageError(IMAGE_COLUMN_NEEDS_VISION)
    if job.constraint is not None:
        from batchrun.engine.types import ConstraintError

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
