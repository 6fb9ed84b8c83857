"""The `batchrun` command line: a thin layer over the job runner.

Exit codes: 0 every row has a result or an error record; 1 a fatal error (progress kept);
2 a usage error; 130 interrupted by Ctrl-C, 143 stopped by SIGTERM (progress kept).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tomllib
from pathlib import Path

import click
from click.core import ParameterSource

import batchrun
from batchrun.paths import default_cache_dir

# Job-file keys (TOML) and the `run` parameters they set; paths are relative to the job file.
JOB_FILE_KEYS = ("input", "model", "output", "job_dir", "max_concurrency", "max_tokens",
                 "temperature", "top_p", "top_k", "min_p", "seed", "stop", "system",
                 "prompt_template", "id_column", "memory_utilization", "prefill_batch_size",
                 "prefill_step_size", "cache_dir", "no_prefix_cache", "no_shared_prefix",
                 "json_schema", "choices",
                 "regex", "n", "logprobs", "top_logprobs", "image_column", "media_root",
                 "allow_private_urls", "media_timeout", "vision", "ray_address",
                 "ray_actors", "ray_num_cpus", "ray_num_gpus", "ray_slice_rows")
ROWS_FAILED = 3  # exit code of --fail-on-row-errors when a row failed
JOB_FILE_PATHS = ("input", "output", "job_dir", "cache_dir", "json_schema")


def _fail(message: str, hint: str | None = None, code: int = 1) -> click.ClickException:
    error = click.ClickException(message + (f"\n  hint: {hint}" if hint else ""))
    error.exit_code = code
    return error


def resume_command(args: list[str]) -> str:
    """The command that resumes this job: the same arguments, never --restart (following a
    printed hint must not discard progress)."""
    kept = [a for a in args if a != "--restart"]
    return f"batchrun run {' '.join(_quote(a) for a in kept)}".strip()


@click.group(context_settings={"help_option_names": ["-h", "--help"],
                                "auto_envvar_prefix": "BATCHRUN"})
@click.version_option(batchrun.__version__, prog_name="batchrun")
def cli() -> None:
    """Offline batch jobs for LLM inference on MLX.

    Every option's default can come from the environment: BATCHRUN_<COMMAND>_<OPTION>
    (BATCHRUN_RUN_MAX_TOKENS=64), and BATCHRUN_MODEL for --model. The command line and a job
    file win over the environment."""
    _show_warnings()


class _EchoHandler(logging.Handler):
    """batchrun's notices and warnings as one line each on stderr (the progress bar's
    stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        prefix = "warning: " if record.levelno >= logging.WARNING else ""
        click.echo(prefix + record.getMessage(), err=True)


def _show_warnings() -> None:
    logger = logging.getLogger("batchrun")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, _EchoHandler) for h in logger.handlers):
        logger.addHandler(_EchoHandler(logging.INFO))


@cli.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.option("--model", default=None, envvar="BATCHRUN_MODEL",
              help="mlx-lm model folder or Hugging Face id [default: the bundled demo model; "
              "env BATCHRUN_MODEL]")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="results file; a .parquet suffix writes Parquet "
                   "[default: <job-dir>/results.jsonl]")
@click.option("--job-dir", type=click.Path(path_type=Path), default=None,
              help="job state folder [default: jobs/<input file stem>]")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="most sequences decoding at once [default: chosen from memory]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="most tokens generated a row (a row's own max_tokens wins)")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="sampling temperature; 0 is greedy (a row's own wins)")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True, help="sample from the smallest set of tokens with this much "
              "probability; 1 is off")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
              help="sample from the k likeliest tokens; 0 is off")
@click.option("--min-p", type=click.FloatRange(0, 1, max_open=True), default=0.0,
              show_default=True, help="drop tokens less likely than this times the likeliest; "
              "0 is off")
@click.option("--seed", type=int, default=None,
              help="base seed: a sampled row without its own seed gets one from this and its "
                   "position")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--json-schema", type=click.Path(path_type=Path), default=None,
              help="every answer is JSON valid against this schema (a file)")
@click.option("--choices", default=None,
              help="every answer is one of these comma-separated labels; each row also gets "
                   "choice_probs")
@click.option("--regex", default=None, help="every answer matches this regex")
@click.option("--n", "n", type=click.IntRange(1, 128), default=1, show_default=True,
              help="samples per row (rows may set their own `n`)")
@click.option("--logprobs", is_flag=True, help="log-probabilities of the generated tokens")
@click.option("--image-column", default=None,
              help="column holding each row's image (bytes, a path or a URL): image rows")
@click.option("--media-root", multiple=True, type=click.Path(path_type=Path, file_okay=False),
              help="a folder image paths may be read from (repeatable) [default: only the input "
                   "file's folder]")
@click.option("--allow-private-urls", is_flag=True,
              help="let image URLs reach loopback, private and link-local addresses")
@click.option("--media-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="seconds one image may take to fetch, redirects included")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS|local",
              help="shard the job over a Ray cluster (local: one started in this process)")
@click.option("--ray-actors", type=click.IntRange(min=1), default=2, show_default=True,
              help="Ray actors, each loading the model once")
@click.option("--ray-num-cpus", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="CPUs each Ray actor reserves")
@click.option("--ray-num-gpus", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="GPUs each Ray actor reserves")
@click.option("--ray-slice-rows", type=click.IntRange(min=1), default=64, show_default=True,
              help="rows per slice handed to an actor (an actor batches within a slice)")
@click.option("--vision", is_flag=True,
              help="load the model as a vision-language model (mlx-vlm) even if its config "
                   "does not say so")
@click.option("--top-logprobs", type=click.IntRange(0, 20), default=0, show_default=True,
              help="also the K most likely tokens at each position")
@click.option("--system", default=None, help="system message prepended to chat rows")
@click.option("--prompt-template", default=None,
              help='build a user message from row columns: "Classify: {review}"')
@click.option("--id-column", default=None, help="column that holds the row id")
@click.option("--memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.85,
              show_default=True, help="fraction of device memory for weights + KV caches")
@click.option("--prefill-batch-size", type=click.IntRange(min=1), default=None,
              help="most rows prefilled together (default: as many as fit the device's "
                   "prefill token budget)")
@click.option("--prefill-step-size", type=click.IntRange(min=1), default=2048, show_default=True,
              help="prompt tokens a row computes per forward pass while prefilling")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              envvar="BATCHRUN_CACHE_DIR",
              help="prefix-cache folder [default: $BATCHRUN_CACHE_DIR or ~/.cache/batchrun]")
@click.option("--no-prefix-cache", is_flag=True, help="neither read nor write the prefix cache")
@click.option("--no-shared-prefix", is_flag=True,
              help="each row holds its own copy of a cached prefix's KV (instead of all rows "
                   "attending one shared copy)")
@click.option("--restart", is_flag=True, help="discard earlier progress of this job")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--debug", is_flag=True, help="show tracebacks")
@click.option("--fail-on-row-errors", is_flag=True,
              help="exit 3 when any row ended as an error record (every row still has one)")
@click.pass_context
def run(ctx: click.Context, input_path: Path, **opts) -> None:
    """Process a .jsonl / .jsonl.gz / .parquet file, or a job file (.toml).

    Re-running the same command resumes the job where it stopped.
    """
    try:
        _run(ctx, input_path, opts)
    except KeyboardInterrupt:  # before the job's own Ctrl-C handling (loading), or a second one
        click.echo("interrupted: progress so far is kept; run the same command to resume "
                   f"({resume_command(sys.argv[2:])})", err=True)
        ctx.exit(130)


def _run(ctx: click.Context, input_path: Path, opts: dict) -> None:
    from batchrun.engine.load import keep_torch_out

    job_file = None
    if input_path.suffix == ".toml":
        job_file = input_path
        opts = _merge_job_file(ctx, input_path, opts)
        input_path = opts.pop("input")
    if not opts.get("vision"):
        keep_torch_out(opts.get("model"))  # before anything imports transformers

    from batchrun.api import Job, UsageError
    from batchrun.job import report as rp
    from batchrun.job.runner import Interrupted, JobError

    if not input_path.exists():
        raise _fail(f"input file not found: {input_path}", code=2)
    if not input_path.is_file():
        raise _fail(f"the input {input_path} is not a regular file", code=2)
    debug = opts.pop("debug")
    fail_on_row_errors = opts.pop("fail_on_row_errors", False)
    moved = opts.pop("_output_follows_job_dir", False)
    if job_file and not opts["job_dir"]:
        opts["job_dir"] = job_file.parent / job_file.stem
    try:
        job = Job(input_path, **opts)
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    spec, job_dir = job.spec, job.spec.job_dir
    if moved:
        click.echo(f"output: {spec.output} (the job file's output, moved with --job-dir)",
                   err=True)
    try:
        job.check()  # before the model loads
    except JobError as e:
        raise _fail(str(e), code=e.exit_code) from None
    done = job.finished()
    if done is not None:
        click.echo(f"already complete: {done.rows_done:,} rows done, {done.rows_failed:,} "
                   f"failed; nothing to run (--restart runs it again)", err=True)
        _say_where(spec, done.rows_failed)
        if fail_on_row_errors and done.rows_failed:
            ctx.exit(ROWS_FAILED)
        return
    _prepare(job, debug)
    runner, engine = job.runner, job.engine
    resume = resume_command(sys.argv[2:])
    try:
        report = runner.run()
    except Interrupted as e:
        click.echo(rp.summary_text(runner.report), err=True)
        how = "interrupted" if e.signum == signal.SIGINT else f"stopped by {e}"
        click.echo(f"{how}: progress is saved in {job_dir}\n  resume with: {resume}",
                   err=True)
        ctx.exit(128 + e.signum)
    except JobError as e:
        raise _fail(str(e), code=e.exit_code) from None
    except OSError as e:
        if debug:
            raise
        raise _fail(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "),
                    f"progress is saved; fix the problem and resume with: {resume}") from e
    click.echo(rp.summary_text(report), err=True)
    if runner.deduplicated:
        click.echo(f"identical rows computed once: {runner.deduplicated:,} reused", err=True)
    _say_where(spec, report["rows_failed"])
    click.echo(f"report:     {job_dir / 'report.html'}", err=True)
    if job.options.ray_address:
        for w in report.get("workers", []):
            click.echo(f"worker {w['actor']}: {w['rows']:,} rows in {w['slices']} slices, "
                       f"{w['completion_tokens_per_s']:,.1f} tok/s busy ({w['node']}, "
                       f"pid {w['pid']}{', died' if not w['alive'] else ''})", err=True)
    else:
        cache_stats = engine.get_cache_stats()
        if cache_stats and (cache_stats["hits"] or cache_stats["stored_blocks"]):
            click.echo(f"prefix cache: {cache_stats['hit_tokens']:,} prompt tokens reused "
                       f"({cache_stats['hits']:,} hits, {cache_stats['misses']:,} misses, "
                       f"{cache_stats['disk_loaded_blocks']:,} blocks from disk"
                       + (f", {cache_stats['disk_skipped']:,} damaged entries removed"
                          if cache_stats["disk_skipped"] else "") + ")", err=True)
    if fail_on_row_errors and report["rows_failed"]:
        ctx.exit(ROWS_FAILED)


def _say_where(spec, failed: int) -> None:
    """Where the job's records are."""
    click.echo(f"results:    {spec.output}", err=True)
    if failed:
        click.echo(f"errors:     {spec.errors_path}", err=True)


def _prepare(job, debug: bool) -> None:
    """Load the job's model (or start its Ray runner) and say what runs where; bad options and
    models are one line."""
    from batchrun.api import MissingExtra, UsageError
    from batchrun.models import ModelError

    try:
        job.prepare()
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    except MissingExtra as e:
        raise _fail(str(e)) from None
    except ModelError as e:
        if debug:
            raise
        raise _fail(str(e), "pass an mlx-lm model folder or a Hugging Face id with --model") \
            from e
    except Exception as e:
        if debug:
            raise
        raise _fail(f"could not load model {job.options.model or 'demo'!r}: {e}",
                    "pass an mlx-lm model folder or a Hugging Face id with --model") from e
    o = job.options
    if o.ray_address:
        r = job.runner.ray_options
        click.echo(f"model:  {o.model or 'demo'} ({job.runner.model_path})\nray:    "
                   f"{o.ray_address}, {r.actors} actors x {r.num_cpus:g} CPU, "
                   f"{r.num_gpus:g} GPU", err=True)
    else:
        click.echo(describe_runtime(job.engine, o.model), err=True)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _merge_job_file(ctx: click.Context, path: Path, opts: dict) -> dict:
    """Job-file values for the options not given on the command line."""
    if not path.is_file():
        raise _fail(f"job file not found: {path}", code=2)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise _fail(f"{path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(JOB_FILE_KEYS))
    if unknown:
        raise click.UsageError(f"{path}: unknown keys {', '.join(unknown)}; known: "
                               f"{', '.join(JOB_FILE_KEYS)}")
    if "input" not in data:
        raise click.UsageError(f"{path}: the job file needs an 'input' key")
    merged = dict(opts)
    given = {key for key in data if key != "input"
             and ctx.get_parameter_source(key) is ParameterSource.COMMANDLINE}
    for key, value in data.items():
        if key in given:
            continue  # the command line wins
        if key == "output" and ctx.get_parameter_source("job_dir") is ParameterSource.COMMANDLINE:
            # The job's state moves to another folder: so does its output, or two jobs would
            # write one file.
            merged["output"] = Path(opts["job_dir"]) / Path(value).name
            merged["_output_follows_job_dir"] = True
            continue
        if key in JOB_FILE_PATHS:
            value = path.parent / value
        elif key == "model" and (path.parent / value).exists():
            value = str(path.parent / value)
        elif key == "stop" and isinstance(value, str):
            value = (value,)
        elif key == "media_root":  # one folder or a list, each relative to the job file
            value = tuple(path.parent / v for v in ([value] if isinstance(value, str) else value))
        merged[key] = value
    return merged


@cli.command()
@click.argument("job_dir", type=click.Path(path_type=Path, file_okay=False))
def status(job_dir: Path) -> None:
    """Rows done / failed / pending and throughput so far (also while the job runs)."""
    from batchrun.job.report import summary_text
    from batchrun.job.state import DamagedFile, JobLock

    manifest, report = _read_job(job_dir)
    _saved_progress(job_dir)  # a damaged state.json is said here as under `report`
    lock = JobLock(job_dir)
    try:
        running = not lock.acquire()
    except DamagedFile as e:
        raise _fail(str(e)) from None
    if not running:
        lock.release()
    state = "running (pid " + lock.holder() + ")" if running else "not running"
    click.echo(f"job:        {job_dir} — {state}\ninput:      {manifest['input']['path']}\n"
               f"model:      {manifest['model']['name']}")
    if report is None:
        click.echo("no progress recorded yet")
        return
    click.echo(summary_text(report))


@cli.command()
@click.argument("job_dir", type=click.Path(path_type=Path, file_okay=False))
def report(job_dir: Path) -> None:
    """Print the job's report; rewrite report.json and report.html."""
    from batchrun.job import report as rp

    manifest, saved = _read_job(job_dir)
    if saved is None:
        raise _fail(f"{job_dir} has no report yet", "run the job first: batchrun run INPUT")
    progress = _saved_progress(job_dir)
    if progress is None:
        raise _fail(f"{job_dir} has no state.json", "resume the job with batchrun run")
    fresh = rp.build_report(manifest, progress, saved["rows_total"], saved["runs"],
                            saved["device"])
    rp.write_report(job_dir, fresh)
    click.echo(rp.summary_text(fresh))
    click.echo(f"report:     {job_dir / 'report.html'}")


def _saved_progress(job_dir: Path):
    """state.json's progress (None before the first commit); one line (exit 1) if damaged."""
    from batchrun.job.state import DamagedFile, JobState

    try:
        return JobState(job_dir, job_dir / "results.jsonl", job_dir / "errors.jsonl").saved()
    except DamagedFile as e:
        raise _fail(str(e), "resume the job with batchrun run: it rebuilds its state from the "
                    "files") from None


def _read_job(job_dir: Path) -> tuple[dict, dict | None]:
    """A job folder's job.json and report.json (None before the first report); one clear
    line (exit 1) for a folder that is not a job's or whose files are damaged."""
    from batchrun.job import manifest as mf
    from batchrun.job import report as rp
    from batchrun.job.state import DamagedFile, read_json

    try:
        manifest = mf.saved_manifest(job_dir)
        if manifest is None:
            raise _fail(f"{job_dir} is not a batchrun job folder (no job.json)")
        report = read_json(job_dir / "report.json")
    except DamagedFile as e:
        raise _fail(str(e)) from None
    if report is not None and not rp.well_formed(report):
        raise _fail(f"{job_dir / 'report.json'} is damaged (fields are missing)",
                    "resume the job with batchrun run: it rewrites the report")
    return manifest, report


@cli.command()
@click.option("--model", default=None, envvar="BATCHRUN_MODEL",
              help="mlx-lm model folder or Hugging Face id [env BATCHRUN_MODEL]")
@click.option("--shape", default=None, help="random-weight model of a named shape: "
              "demo, 150m, llama-1b (built once into the cache folder)")
@click.option("--workload", type=click.Choice(["short", "mixed", "mixed512", "labeling"]),
              default="mixed", show_default=True,
              help="short: 16-32 prompt tokens; mixed: 8-1,500 prompt and 16-256 new tokens; "
                   "mixed512: 8-512 prompt tokens; labeling: a shared 1,000-token prefix")
@click.option("--rows", type=click.IntRange(min=1), default=64, show_default=True,
              help="rows in the workload")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="new tokens a row (workloads without their own)")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=64, show_default=True,
              help="rows decoded together, for every system")
@click.option("--systems", default="sequential,batch_generate,batchrun,prefix",
              show_default=True,
              help="comma-separated: sequential, batch_generate, hand_cached (batch_generate "
                   "with the common prefix prefilled once and copied to every row), batchrun, "
                   "prefix (batchrun with a cold, then a warm prefix cache), prefix_copies (the "
                   "same, each row holding its own copy of the prefix)")
@click.option("--prefill-batch-size", type=click.IntRange(min=1), default=None,
              help="batchrun's prefill batch (default: the engine's)")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None,
              help="also write the figures to this JSON file")
def bench(model: str | None, shape: str | None, workload: str, rows: int, max_tokens: int,
          max_concurrency: int, systems: str, prefill_batch_size: int | None,
          json_out: Path | None) -> None:
    """Side-by-side throughput: sequential mlx-lm, batch_generate and batchrun."""
    import orjson

    from batchrun import bench as b

    names = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = set(names) - set(b.SYSTEMS)
    if unknown:
        raise click.BadParameter(f"unknown systems: {', '.join(sorted(unknown))}",
                                 param_hint="--systems")
    if prefill_batch_size:
        b.ENGINE_OPTIONS["prefill_batch_size"] = prefill_batch_size
    lm = b.model_for(model, shape, default_cache_dir())
    w = b.make_workload(lm.tokenizer, workload, rows, max_tokens)
    max_tokens_text = (f"{min(w.max_tokens)}-{max(w.max_tokens)}"
                       if len(set(w.max_tokens)) > 1 else str(max_tokens))
    info = b.machine()
    click.echo(f"{info['date']} · {info['device']} {info['device_name']} · {info['cpus']} cpus · "
               f"BLAS {info['blas']}\nmodel {shape or model or 'demo'}: {w.name} workload, "
               f"{rows} rows, {w.prompt_tokens:,} prompt tokens, {max_tokens_text} new tokens "
               f"each, concurrency {max_concurrency}")
    results = b.benchmark(lm, w, names, max_concurrency)
    click.echo(b.table(results))
    if json_out:
        json_out.write_bytes(orjson.dumps({"machine": info, "model": shape or model or "demo",
                                           "workload": w.name, "rows": rows,
                                           "max_tokens": max_tokens,
                                           "results": b.as_dict(results)},
                                          option=orjson.OPT_INDENT_2))


@cli.group()
def cache() -> None:
    """Inspect or empty the on-disk prefix cache."""


_cache_dir_option = click.option(
    "--cache-dir", type=click.Path(path_type=Path), default=None, envvar="BATCHRUN_CACHE_DIR",
    help="prefix-cache folder [default: $BATCHRUN_CACHE_DIR or ~/.cache/batchrun]")


@cache.command("ls")
@_cache_dir_option
def cache_ls(cache_dir: Path | None) -> None:
    """One line per model: blocks, size, last use."""
    import time

    from batchrun.cache.disk import cache_summary

    root = cache_dir or default_cache_dir()
    entries = cache_summary(root)
    if not entries:
        click.echo(f"{root}: no prefix-cache entries")
        return
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"])) \
            if e["last_used"] else "-"
        click.echo(f"{e['model'][:16]}  {e['blocks']:>7,} blocks  {e['bytes'] / 2**20:>9.1f} MiB"
                   f"  last used {when}  {e['folder']}")


@cache.command("stats")
@_cache_dir_option
def cache_stats(cache_dir: Path | None) -> None:
    """Totals over all models."""
    from batchrun.cache.disk import cache_summary

    root = cache_dir or default_cache_dir()
    entries = cache_summary(root)
    blocks = sum(e["blocks"] for e in entries)
    size = sum(e["bytes"] for e in entries)
    click.echo(f"folder: {root}")
    click.echo(f"models: {len(entries)}")
    click.echo(f"blocks: {blocks:,}")
    click.echo(f"size:   {size / 2**20:,.1f} MiB")


@cache.command("clear")
@_cache_dir_option
@click.option("--yes", is_flag=True, help="do not ask")
def cache_clear(cache_dir: Path | None, yes: bool) -> None:
    """Delete every prefix-cache entry."""
    import shutil
    import stat

    root = (cache_dir or default_cache_dir()) / "prefix"
    try:
        mode = root.lstat().st_mode
    except FileNotFoundError:
        click.echo("nothing to clear")
        return
    except OSError as e:
        raise click.ClickException(f"cannot read {root}: {e.strerror or e}") from None
    if not stat.S_ISDIR(mode):  # a link is never followed out of the cache
        raise click.ClickException(f"{root} is not a folder (a link or a file); nothing cleared")
    if not yes:
        click.confirm(f"delete {root}?", abort=True)
    try:
        shutil.rmtree(root)  # removes links inside, never their targets
    except OSError as e:
        raise click.ClickException(f"could not clear {root}: {e.strerror or e}") from None
    click.echo(f"cleared {root}")


def describe_runtime(engine, model: str | None) -> str:
    import mlx.core as mx

    from batchrun import blas
    from batchrun.api import device_name

    device = mx.default_device()
    where = device_name()
    if device == mx.cpu:
        where = where[:-1] + f", {os.cpu_count()} cores)"
    lines = [f"model:  {model or 'demo'} ({engine.model_path})", f"device: {where}"]
    if device == mx.cpu:
        lines.append(f"BLAS:   {blas.verify().describe()}")
    lines.append(f"batch:  up to {engine.max_concurrency} sequences, KV budget "
                 f"{engine.memory.budget / 2**30:.1f} GiB")
    return "\n".join(lines)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
