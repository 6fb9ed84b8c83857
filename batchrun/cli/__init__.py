"""The `batchrun` command line: a thin layer over the job runner.

Exit codes: 0 every row has a result or an error record; 1 a fatal error (progress kept);
2 a usage error (a bad flag or job-file value, a missing input, a refused job), said before the
model loads; 3 with --fail-on-row-errors when a row failed; 130 interrupted by Ctrl-C, 143
stopped by SIGTERM, 129 by SIGHUP (progress kept). With `-o -`, stdout carries result lines only.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import click
from click.core import ParameterSource

import batchrun
from batchrun.paths import default_cache_dir

# Job-file keys (TOML) and the `run` parameters they set; paths are relative to the job file.
JOB_FILE_KEYS = ("input", "model", "output", "job_dir", "format", "max_concurrency",
                 "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "max_thinking_tokens", "served_model_name", "system",
                 "prompt_template", "id_column", "expected_column", "memory_utilization",
                 "prefill_batch_size",
                 "prefill_step_size", "cache_dir", "no_prefix_cache", "no_shared_prefix",
                 "speculate", "draft_model", "draft_tokens", "json_schema", "choices",
                 "regex", "n", "logprobs", "top_logprobs", "image_column", "media_root",
                 "allow_private_urls", "media_timeout", "vision", "ray_address",
                 "ray_actors", "ray_num_cpus", "ray_num_gpus", "ray_slice_rows", "limit")
ROWS_FAILED = 3  # exit code of --fail-on-row-errors when a row failed
SIGNAL_EXITS = (129, 130, 143)  # exit codes after SIGHUP, Ctrl-C and SIGTERM
MAX_SEED = 2**64 - 1  # engine.request.MAX_SEED (not imported: it loads MLX)
STDIN = "-"  # as INPUT: JSONL rows on stdin; as -o: results on stdout
FAST_EXIT_ENV = "BATCHRUN_FAST_EXIT"  # 0: the interpreter's full teardown at exit
FAST_EXIT_WAIT_S = 1.0  # how long the exit waits for threads still ending
JOB_FILE_PATHS = ("input", "output", "job_dir", "cache_dir", "json_schema")


def _fail(message: str, hint: str | None = None, code: int = 1) -> click.ClickException:
    error = click.ClickException(message + (f"\n  hint: {hint}" if hint else ""))
    error.exit_code = code
    return error


def resume_command(args: list[str], spooled: Path | None = None) -> str:
    """The command that resumes this job: the same arguments, never --restart (following a
    printed hint must not discard progress). A job that read stdin resumes from the rows it
    spooled (`spooled`), given in place of `-`; a job file whose input is `-` (its options are
    in the file) is given them on stdin."""
    kept = [a for a in args if a != "--restart"]
    command = f"batchrun run {' '.join(_quote(a) for a in kept)}".strip()
    if spooled is None:
        return command
    replaced = _input_replaced(kept, str(spooled))
    if replaced is None:
        return f"{command} < {_quote(str(spooled))}"
    return f"batchrun run {' '.join(_quote(a) for a in replaced)}".strip()


def _input_replaced(args: list[str], path: str) -> list[str] | None:
    """`args` with the input argument `-` (not the `-` of `-o -`) replaced by `path`; None
    without one."""
    for i, arg in enumerate(args):
        if arg == STDIN and (i == 0 or args[i - 1] not in ("-o", "--output")):
            return [*args[:i], path, *args[i + 1:]]
    return None


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
              help="job state folder [default: jobs/<input file stem>; needed for rows from "
                   "stdin, which are kept in it as stdin.jsonl]")
@click.option("--format", "format", type=click.Choice(["jsonl", "parquet"]), default=None,
              help="read the input as this format whatever its suffix [default: from the "
                   "suffix]")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="most sequences decoding at once [default: chosen from memory]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="most tokens generated a row (a row's own max_tokens wins) [default: the "
                   "model's generation_config.json max_new_tokens, else 256]")
@click.option("--temperature", type=click.FloatRange(min=0), default=None,
              help="sampling temperature; 0 is greedy (a row's own wins) [default: the model's "
                   "generation_config.json, else 0]")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="sample from the smallest set of tokens with this much probability; 1 is "
                   "off [default: the model's generation_config.json, else 1]")
@click.option("--top-k", type=click.IntRange(min=0), default=None,
              help="sample from the k likeliest tokens; 0 is off [default: the model's "
                   "generation_config.json, else 0]")
@click.option("--min-p", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="drop tokens less likely than this times the likeliest; 0 is off "
                   "[default: the model's generation_config.json, else 0]")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
              help="base seed: a sampled row without its own seed gets one from this and its "
                   "position")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--max-thinking-tokens", type=click.IntRange(min=0), default=None,
              help="most tokens a reasoning model may think before its answer (constraints "
                   "apply after it) [default: unbounded]")
@click.option("--served-model-name", default=None, metavar="NAME[,ALIAS...]",
              help="the model names OpenAI rows may ask for in body.model; a row naming "
                   "another is that row's error [default: any name]")
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
@click.option("--limit", multiple=True, metavar="NAME=VALUE",
              help="raise or lower a row size limit (repeatable): row-bytes, prompt-chars, "
                   "choices, choice-chars, image-bytes; sizes take K, M, G [docs/limits.md]")
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
@click.option("--expected-column", default=None,
              help="column that holds each row's right answer: copied into its record as "
                   "`expected`; the report gives the share of labels that agree with it")
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
@click.option("--speculate", type=click.Choice(["off", "ngram", "draft"]), default=None,
              help="speculative decoding while few rows run (the output does not change): "
                   "ngram guesses from each row's own prompt (answers that copy it), draft "
                   "from --draft-model [default: draft with --draft-model, else off]")
@click.option("--draft-model", default=None,
              help="a small model sharing the model's tokenizer, guessing tokens for "
                   "--speculate draft")
# default: engine.request.default_draft_tokens, written out (the CLI imports no engine module
# before it must; a test checks they agree)
@click.option("--draft-tokens", type=click.IntRange(1, 16), default=None,
              help="tokens a row guesses ahead each speculative step [default: 6; on a GPU "
                   "8 for a draft model, 12 for --speculate ngram]")
@click.option("--restart", is_flag=True, help="discard earlier progress of this job")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--debug", is_flag=True, help="show tracebacks")
@click.option("--fail-on-row-errors", is_flag=True,
              help="exit 3 when any row ended as an error record (every row still has one)")
@click.option("--dry-run", is_flag=True,
              help="count rows and prompt tokens, the share a prefix cache reuses, and "
                   "estimate the time from a few rows; writes nothing")
@click.pass_context
def run(ctx: click.Context, input_path: Path, **opts) -> None:
    """Process a .jsonl / .jsonl.gz / .parquet file, - (JSONL rows on stdin), or a job file
    (.toml).

    Re-running the same command resumes the job where it stopped. `-o -` writes the results
    to stdout, in input order, once the job is done (its folder keeps them too); progress and
    messages go to stderr.
    """
    job_file = None
    if input_path.suffix.lower() == ".toml":
        job_file = input_path
        opts = _merge_job_file(ctx, input_path, opts)
        input_path = opts.pop("input")
    to_stdout = _is_dash(opts["output"])
    if to_stdout and sys.stdout is None:
        raise click.UsageError("-o - writes the results to stdout, and this process has none "
                               "(it was closed): pass -o FILE, or leave -o out for the job "
                               "folder's results.jsonl")
    spooled: list[Path] = []  # the stdin job's input, once spooled
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # SIGTERM before the job's own handling (loading, recovering) stops too
        previous = {s: signal.signal(s, _terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with _stdout_to_stderr(to_stdout):
            code, spec = _run(ctx, input_path, opts, spooled, job_file)
    except KeyboardInterrupt as e:  # before the job's own handling (loading), or a second one
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        how = "interrupted" if signum == signal.SIGINT else \
            f"stopped by {signal.Signals(signum).name}"
        click.echo(f"{how}: progress so far is kept; run the same command to resume "
                   f"({resume_command(sys.argv[2:], *spooled[:1])})", err=True)
        ctx.exit(128 + signum)
    finally:
        if main_thread:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if isinstance(spec, str):  # a dry run's findings: on stdout, -o - or not
        click.echo(spec)
    elif to_stdout and spec is not None:
        try:
            _print_results(spec.results_path)
        except BrokenPipeError:
            raise  # the reader stopped early (| head): click ends it as any command
        except OSError as e:
            raise _fail(f"could not write the results to stdout: {e.strerror or e}; they "
                        f"are in {spec.results_path}") from None
    if code:
        ctx.exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived before the job's own signal handling began."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminated(signum, frame) -> None:
    raise Terminated(signum)


def _is_dash(path: Path | str | None) -> bool:
    return path is not None and str(path) == STDIN


@contextlib.contextmanager
def _stdout_to_stderr(enabled: bool) -> Iterator[None]:
    """With -o -, stdout carries result lines only: while the job runs, whatever would reach
    it (a library's print or warning included) goes to stderr."""
    if not enabled:
        yield
        return
    out = sys.stdout
    out.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptor 1 to move (an embedding host)
        saved = None
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = out
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _print_results(results: Path) -> None:
    """The job's result lines, in input order, on stdout."""
    import shutil

    stdout = sys.stdout.buffer
    if results.is_file():
        with open(results, "rb") as f:
            shutil.copyfileobj(f, stdout)
    stdout.flush()


def _run(ctx: click.Context, input_path: Path, opts: dict, spooled: list[Path],
         job_file: Path | None) -> tuple[int, object]:
    """Run the job (its job file's values merged into `opts`); (exit code, its spec) when it
    ends with every row recorded."""
    from batchrun.engine.load import keep_torch_out

    debug = opts.pop("debug")
    fail_on_row_errors = opts.pop("fail_on_row_errors", False)
    moved = opts.pop("_output_follows_job_dir", False)
    dry_run = opts.pop("dry_run", False)
    if _is_dash(opts["output"]):
        opts["output"] = None  # the job folder's results.jsonl, printed at the end
    if job_file and not opts["job_dir"]:
        opts["job_dir"] = job_file.parent / job_file.stem
    from_stdin = _is_dash(input_path)
    if from_stdin:
        _check_stdin(opts, dry_run)
    elif not input_path.exists():
        raise _fail(f"input file not found: {input_path}", code=2)
    elif not input_path.is_file():
        raise _fail(f"the input {input_path} is not a regular file", code=2)
    if not opts.get("vision"):
        keep_torch_out(opts.get("model"))  # before anything imports transformers
    if dry_run:
        return 0, _dry_run(input_path, opts, debug)

    from batchrun.api import Job, UsageError
    from batchrun.job import report as rp
    from batchrun.job.runner import Interrupted, JobError

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
    if from_stdin:
        spooled.append(spec.input)
        click.echo(f"input:  {spec.input} (the rows from stdin)", err=True)
    done = job.finished()
    if done is not None:
        click.echo(f"already complete: {done.rows_done:,} rows done, {done.rows_failed:,} "
                   f"failed; nothing to run (--restart runs it again)", err=True)
        _say_where(spec, done.rows_failed)
        return (ROWS_FAILED if fail_on_row_errors and done.rows_failed else 0), spec
    _prepare(job, debug)
    with _closed_at_the_end(job):
        runner, engine = job.runner, job.engine
        resume = resume_command(sys.argv[2:], spec.input if from_stdin else None)
        try:
            with _long_lived_frozen():
                report = runner.run()
        except Interrupted as e:
            click.echo(rp.summary_text(runner.report), err=True)
            how = "interrupted" if e.signum == signal.SIGINT else f"stopped by {e}"
            click.echo(f"{how}: progress is saved in {job_dir}\n  resume with: {resume}",
                       err=True)
            ctx.exit(128 + e.signum)
        except JobError as e:
            job.discard_spool()
            raise _fail(str(e), code=e.exit_code) from None
        except OSError as e:
            job.discard_spool()
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
        return (ROWS_FAILED if fail_on_row_errors and report["rows_failed"] else 0), spec


@contextlib.contextmanager
def _closed_at_the_end(job) -> Iterator[None]:
    """Whatever the job's ending, it lets go of its model and of the cache's threads and folder
    (their pending blocks written): nothing is left running when the process exits. Where the
    job failed, a failure to close it as well is logged at debug level: the job's own error is
    the one to say."""
    try:
        yield
    except BaseException:
        try:
            job.close()
        except Exception as e:
            logging.getLogger("batchrun").debug("closing the job after its failure: %s: %s",
                                                type(e).__name__, e)
        raise
    job.close()


@contextlib.contextmanager
def _long_lived_frozen() -> Iterator[None]:
    """What the command made before the job (the modules, the model, its tokenizer) lives as
    long as the job: Python's cycle collector leaves it out of its passes meanwhile. A pass
    over it all took 25-50 ms on a 2-core CPU and fell inside a job's steps; the job's own
    garbage is still collected. A process that froze objects itself keeps them as it had them."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _check_stdin(opts: dict, dry_run: bool) -> None:
    """Rows from stdin need a pipe, and (but for a dry run) a job folder to keep them in."""
    if sys.stdin is None or sys.stdin.isatty():
        raise click.UsageError("INPUT is - but stdin is a terminal: pipe JSONL rows in "
                               "(... | batchrun run - --job-dir DIR); a stdin job resumes "
                               "from its rows with batchrun run DIR/stdin.jsonl --job-dir DIR")
    if not opts["job_dir"] and not dry_run:
        raise click.UsageError("rows from stdin (-) need --job-dir DIR: batchrun keeps them "
                               "in DIR/stdin.jsonl, so the job can resume")


def _dry_run(input_path: Path, opts: dict, debug: bool) -> str:
    """Count, measure and estimate; the findings, for stdout. Rows from stdin are spooled to a
    temporary file (no job folder is made)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="batchrun-dry-run-") as tmp:
        if _is_dash(input_path):
            from batchrun.io.readers import spool

            input_path = Path(tmp) / f"stdin.{opts.get('format') or 'jsonl'}"
            spool(sys.stdin.buffer, input_path)
        return _dry_run_file(input_path, opts, debug)


def _dry_run_file(input_path: Path, opts: dict, debug: bool) -> str:
    from batchrun.api import Job, UsageError
    from batchrun.io.jsonl import InputError
    from batchrun.job.runner import JobError

    try:
        job = Job(input_path, **opts)
        job.spec.rows_total  # noqa: B018  (a damaged or empty input: before the model loads)
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    except JobError as e:
        raise _fail(str(e), code=e.exit_code) from None
    _prepare(job, debug, dry_run=True)
    try:
        found = job.dry_run()
    except (InputError, JobError) as e:
        raise _fail(str(e)) from None
    return describe_dry_run(found)


def _say_where(spec, failed: int) -> None:
    """Where the job's records are."""
    click.echo(f"results:    {spec.output}", err=True)
    if failed:
        click.echo(f"errors:     {spec.errors_path}", err=True)


MIN_ADDRESS_SPACE = 2 << 30  # below it MLX or OpenBLAS fail to start (ulimit -v 1000000)


def _check_address_space() -> None:
    """A process memory limit too low for MLX to start is one line before the model loads
    (a native library would otherwise end the process mid-load with its own message)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft < MIN_ADDRESS_SPACE:
        raise _fail(f"this process may use only {soft >> 20:,} MiB of address space "
                    f"(ulimit -v): MLX needs at least {MIN_ADDRESS_SPACE >> 20:,} MiB to start, "
                    "and a model more; raise the limit and run the command again")


def _prepare(job, debug: bool, dry_run: bool = False) -> None:
    """Load the job's model (or start its Ray runner) and say what runs where, and with which
    sampling defaults; bad options and models are one line."""
    from batchrun.api import MissingExtra, UsageError
    from batchrun.models import DraftModelError, ModelError

    _check_address_space()
    try:
        job.prepare(dry_run=dry_run)
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    except MissingExtra as e:
        raise _fail(str(e)) from None
    except DraftModelError as e:
        if debug:
            raise
        raise _fail(str(e), "pass --draft-model a small mlx-lm model made with the same "
                            "tokenizer as the model") from e
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
    if o.ray_address and not dry_run:
        r = job.runner.ray_options
        click.echo(f"model:  {o.model or 'demo'} ({job.runner.model_path})\nray:    "
                   f"{o.ray_address}, {r.actors} actors x {r.num_cpus:g} CPU, "
                   f"{r.num_gpus:g} GPU", err=True)
    else:
        click.echo(describe_runtime(job.engine, o.model), err=True)
    click.echo(describe_defaults(job), err=True)


def describe_defaults(job) -> str:
    """One line: the sampling defaults of rows that set none, and where each comes from."""
    where = {"flag": "flags", "generation_config.json": "the model's generation_config.json",
             "batchrun": "batchrun's"}
    groups: dict[str, list[str]] = {}
    for name, value, source in job.sampling_defaults():
        groups.setdefault(source, []).append(f"{name} {value:g}")
    return ("sampling: " + "; ".join(f"{', '.join(items)} ({where[source]})"
                                     for source, items in groups.items())
            + "; a row's own fields win")


def describe_dry_run(found) -> str:
    """What a dry run found, for a person: rows, tokens, the shared-prefix share, an
    estimate."""
    from batchrun.job.report import human_seconds

    lines = [f"rows:          {found.rows:,}"
             + (f" ({found.row_errors:,} would be error records; first: {found.first_error})"
                if found.row_errors else ""),
             f"prompt tokens: {found.prompt_tokens:,}"
             + (f" ({found.prompt_tokens / max(1, found.rows - found.row_errors):,.1f} a row)"
                if found.rows > found.row_errors else ""),
             f"shared prefix: {found.shared_tokens:,} prompt tokens "
             f"({100 * found.shared_share:.1f}%) start {found.sharing_rows:,} rows with blocks "
             "another row already has: a prefix cache computes them once",
             f"new tokens:    at most {found.max_new_tokens:,} (the rows' max_tokens)"]
    if found.estimate_s is None:
        lines.append("estimate:      none (no row to probe)")
    else:
        lines.append(
            f"estimate:      about {human_seconds(found.estimate_s)} on this machine (an estimate: "
            f"{found.probe_rows} rows probed in {found.probe_s:.1f}s, "
            f"{found.mean_completion_tokens:,.0f} new tokens a row, prefill "
            f"{found.prefill_tokens_per_s:,.0f} tok/s, decode {found.decode_tokens_per_s:,.0f} "
            f"tok/s at batch {found.probe_rows}; the job decodes up to "
            f"{found.max_concurrency} rows at once, usually faster)")
    return "\n".join(lines)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _merge_job_file(ctx: click.Context, path: Path, opts: dict) -> dict:
    """Job-file values for the options not given on the command line, checked as the flags'
    values are (a bad one is a usage error naming the file and the key)."""
    if not path.is_file():
        raise _fail(f"job file not found: {path}", code=2)
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise click.UsageError(f"{path} is not valid TOML: {e}") from None
    except OSError as e:
        raise _fail(f"{path} cannot be read: {e.strerror or e}", code=2) from None
    unknown = sorted(set(data) - set(JOB_FILE_KEYS))
    if unknown:
        raise click.UsageError(f"{path}: unknown keys {', '.join(unknown)}; known: "
                               f"{', '.join(JOB_FILE_KEYS)}")
    if not isinstance(data.get("input"), str):
        raise click.UsageError(f"{path}: the job file needs an 'input' key naming the input "
                               "file (relative to the job file)")
    params = {p.name: p for p in ctx.command.params}
    merged = dict(opts)
    given = {key for key in data if key != "input"
             and ctx.get_parameter_source(key) is ParameterSource.COMMANDLINE}
    for key, value in data.items():
        if key in given:
            continue  # the command line wins
        if key == "input":
            merged["input"] = Path(value) if value == STDIN else path.parent / value
            continue
        if key == "output" and value == STDIN:  # stdout, as with -o -
            merged["output"] = Path(STDIN)
            continue
        if key == "output" and ctx.get_parameter_source("job_dir") is ParameterSource.COMMANDLINE:
            # The job's state moves to another folder: so does its output, or two jobs would
            # write one file.
            merged["output"] = Path(opts["job_dir"]) / Path(_job_file_str(path, key,
                                                                         value)).name
            merged["_output_follows_job_dir"] = True
            continue
        if key in JOB_FILE_PATHS:
            value = path.parent / _job_file_str(path, key, value)
        elif key in ("model", "draft_model") and not _job_file_str(path, key, value).strip():
            raise click.UsageError(f"{path}: {key} is empty: name a model folder or a Hugging "
                                   "Face id, or leave the key out")
        elif key in ("model", "draft_model") and \
                (path.parent / _job_file_str(path, key, value)).exists():
            value = str(path.parent / value)
        elif key == "stop" and isinstance(value, str):
            value = (value,)
        elif key == "limit" and isinstance(value, dict):  # [limit] row-bytes = "128M"
            value = tuple(f"{name}={v}" for name, v in value.items())
        elif key == "media_root":  # one folder or a list, each relative to the job file
            value = tuple(path.parent / _job_file_str(path, key, v)
                          for v in ([value] if isinstance(value, str) else value))
        merged[key] = _job_file_value(ctx, params[key], path, key, value)
    return merged


def _job_file_str(path: Path, key: str, value) -> str:
    if not isinstance(value, str):
        raise click.UsageError(f"{path}: {key} must be a string (a path relative to the job "
                               f"file), got {value!r}")
    return value


def _job_file_value(ctx: click.Context, param: click.Parameter, path: Path, key: str, value):
    """A job file's value as its flag would give it (type and range checked)."""
    if key == "choices" and isinstance(value, list):  # a list: labels may hold commas
        if value and all(isinstance(v, str) for v in value):
            return value
        raise click.UsageError(f"{path}: choices must be a list of strings, got {value!r}")
    if isinstance(value, dict) or (isinstance(value, list) and not param.multiple):
        raise click.UsageError(f"{path}: {key} takes one value, got {value!r}")
    if param.multiple and not isinstance(value, list | tuple):
        value = (value,)
    is_flag = isinstance(param, click.Option) and param.is_flag
    for v in value if param.multiple else (value,):
        if isinstance(v, bool) and not is_flag:  # TOML true is not the number 1
            raise click.UsageError(f"{path}: {key} = {str(v).lower()}: a value is needed, "
                                   "not true or false")
        if isinstance(v, float) and isinstance(param.type, click.types.IntParamType):
            raise click.UsageError(f"{path}: {key} = {v!r}: {v!r} is not a valid integer")
    try:
        return param.type_cast_value(ctx, value)
    except click.BadParameter as e:
        raise click.UsageError(f"{path}: {key} = {value!r}: {e.message}") from None


@cli.command()
@click.argument("job_dir", type=click.Path(path_type=Path, file_okay=False))
def status(job_dir: Path) -> None:
    """Rows done / failed / pending and throughput so far (also while the job runs)."""
    from batchrun.job.listing import read_job
    from batchrun.job.report import summary_text
    from batchrun.job.state import DamagedFile

    _read_job(job_dir)  # a folder that is not a job's, or damaged files: one line each
    _saved_progress(job_dir)
    try:
        job = read_job(job_dir)
    except DamagedFile as e:
        raise _fail(str(e)) from None
    state = f"running (pid {job.pid})" if job.pid else f"not running ({job.status})"
    click.echo(f"job:        {job_dir} — {state}\ninput:      {job.input}\n"
               f"model:      {job.model}")
    if job.report is None:
        if job.progress is None:
            click.echo("no progress recorded yet")
        else:
            total = "?" if job.rows_total is None else f"{job.rows_total:,}"
            click.echo(f"rows:       {job.rows_done:,} done, {job.rows_failed:,} failed of "
                       f"{total}")
        return
    click.echo(summary_text(job.figures()))


@cli.command("ls")
@click.argument("directory", metavar="[DIR]", required=False,
                type=click.Path(path_type=Path, exists=True, file_okay=False))
def ls(directory: Path | None) -> None:
    """The job folders under DIR (default jobs/) with their progress, one line each."""

    from batchrun.job.listing import DEFAULT_JOBS_DIR, list_jobs

    root = directory or DEFAULT_JOBS_DIR
    if directory is None and not root.is_dir():
        click.echo(f"no jobs: {root}/ does not exist here")
        return
    jobs, notes = list_jobs(root)
    for note in notes:
        click.echo(note, err=True)
    if not jobs:
        click.echo(f"no job folders in {root}")
        return
    width = max(len(str(j.job_dir)) for j in jobs)
    for j in jobs:
        total = "?" if j.rows_total is None else f"{j.rows_total:,}"
        share = f" ({100 * (j.rows_done + j.rows_failed) / j.rows_total:.0f}%)" \
            if j.rows_total else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.updated)) \
            if j.updated else "-"
        pid = f" (pid {j.pid})" if j.pid else ""
        click.echo(f"{str(j.job_dir):<{width}}  {j.status + pid:<11}  {j.rows_done:,} done, "
                   f"{j.rows_failed:,} failed of {total}{share}  model {j.model}  "
                   f"updated {when}")


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
    click.echo(rp.summary_text(fresh))
    try:
        rp.write_report(job_dir, fresh)
    except OSError as e:
        raise _fail(f"report.json and report.html in {job_dir} could not be rewritten: "
                    f"{e.strerror or e}", "the figures above are current") from None
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
    from batchrun.job.listing import report_problem
    from batchrun.job.state import DamagedFile, read_json

    try:
        manifest = mf.saved_manifest(job_dir)
        if manifest is None:
            raise _fail(f"{job_dir} is not a batchrun job folder (no job.json)")
        report = read_json(job_dir / "report.json")
    except DamagedFile as e:
        raise _fail(str(e)) from None
    if not isinstance(manifest["input"].get("path"), str):
        raise _fail(f"{job_dir / 'job.json'} is damaged (input.path is missing)",
                    f"move the job folder {job_dir} away to start over")
    if report is not None:
        problem = report_problem(report) or (None if rp.well_formed(report)
                                             else "fields are missing")
        if problem:
            raise _fail(f"{job_dir / 'report.json'} is damaged ({problem})",
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
        from batchrun.io.files import write_atomic

        write_atomic(json_out, orjson.dumps({"machine": info, "model": shape or model or "demo",
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

    from batchrun.cache.disk import cache_summary

    root = cache_dir or default_cache_dir()
    entries = cache_summary(root)
    if not entries:
        click.echo(f"{root}: no prefix-cache entries")
        return
    names = _cache_model_names(entries)
    width = max(len(names[e["model"]]) for e in entries)
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"])) \
            if e["last_used"] else "-"
        click.echo(f"{names[e['model']]:<{width}}  {e['model'][:12]}  {e['blocks']:>7,} blocks  "
                   f"{e['bytes'] / 2**20:>9.1f} MiB  last used {when}  {e['folder']}")


def _cache_model_names(entries: list[dict]) -> dict[str, str]:
    """A name for each prefix-cache folder (named by the model's fingerprint): the name the
    folder records, else the model of a job under jobs/ with that fingerprint, or the bundled
    demo model; else "unknown model"."""
    from batchrun.job.listing import known_models

    known = known_models()
    names = {e["model"]: e.get("name") or next(
        (n for fp, n in known.items() if fp.startswith(e["model"])), None) for e in entries}
    if None in names.values():
        from batchrun.models import DEMO_NAME, local_path, model_fingerprint

        try:
            demo = model_fingerprint(local_path(None))
        except Exception:  # the demo model cannot be found here: it is not named
            demo = ""
        names = {f: n or (DEMO_NAME if demo and demo.startswith(f) else None)
                 for f, n in names.items()}
    return {f: n or "unknown model" for f, n in names.items()}


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
        _exiting_on_a_signal()
        sys.exit(130)
    except SystemExit as e:
        if e.code in SIGNAL_EXITS:
            _exiting_on_a_signal()
        raise
    except Exception as e:  # what no command foresaw (the machine's limits): one line
        if "--debug" in sys.argv[1:]:
            raise
        click.echo(f"Error: {_unforeseen(e)}", err=True)
        sys.exit(1)


def _unforeseen(e: Exception) -> str:
    """One line for an error no command handled, with what to do where that is known."""
    text = " ".join(str(e).split())
    if isinstance(e, MemoryError):
        return "out of memory: give the process more memory, or lower --max-concurrency"
    if isinstance(e, RuntimeError) and "new thread" in text:
        return ("this process may not start another thread (its memory or process limit, "
                "ulimit -v / -u, is too low): raise the limit and run the command again")
    if isinstance(e, ValueError) and "maximum limit" in text:
        return ("too few open files are allowed (ulimit -n): mlx-lm raises the limit to 2048 "
                "as it loads, so the hard limit (ulimit -Hn) must be at least 4096")
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror}{where}"
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(e).__name__}: {text} (run with --debug for the traceback)"


def entry() -> None:
    """The `batchrun` program (its console script, `python -m batchrun`): `main`, then the
    process ends at once where it can (`_exit_now`). Code that calls `main` itself keeps its
    process: it gets main's SystemExit, as from any click program."""
    _open_closed_standard_streams()
    try:
        main()
    except SystemExit as e:
        if e.code not in SIGNAL_EXITS and (e.code is None or type(e.code) is int):
            _exit_now(e.code or 0)
        raise


def _open_closed_standard_streams() -> None:
    """A program started with stdin, stdout or stderr closed (`<&-`, `2>&-` in a script) hands
    those descriptors to the next files it opens: MLX then took descriptor 0, given to a model's
    weights, for a failure to open them, and a message meant for stderr would land in whichever
    file took descriptor 2 (a job's results). Each closed one reads and writes /dev/null
    instead, as daemons do."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _exit_now(code: int) -> None:
    """End the process without the interpreter's teardown, once nothing is left to finish:
    freeing every module, the model and MLX's state one object at a time took 0.25 s of a
    2.5-s labeling process on a 2-core CPU. Only when every thread but daemons has ended (waited
    for a moment, as the normal exit would) and no profiler or tracer watches the process (a
    profile written after the program, a debugger); the exit handlers run and the streams and
    logs are flushed first. Otherwise (or with BATCHRUN_FAST_EXIT=0) the normal exit goes on."""
    if os.environ.get(FAST_EXIT_ENV) == "0" or sys.getprofile() is not None \
            or sys.gettrace() is not None:
        return
    deadline = time.monotonic() + FAST_EXIT_WAIT_S
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    return
    except KeyboardInterrupt:  # Ctrl-C while waiting: the command's own ending stands
        return
    atexit._run_exitfuncs()  # (they run once: the normal exit would not run them again)
    logging.shutdown()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # a closed pipe: the normal exit says so as it would have
        return
    os._exit(code)


def _exiting_on_a_signal() -> None:
    """This process exits after Ctrl-C, SIGTERM or SIGHUP, with that exit code: a signal arriving
    again while it shuts down (threads joined, a native library's handler) must not end it by
    the signal instead (seen once in CI under load: exit -2 after the message). Only in the
    process's own `main`: an ignored signal would be inherited by processes started later."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
