"""`batchrun run`: a job from an input file, stdin or a job file, run to its end or resumed.

Everything before the model loads (flags, the job file, the input, the job folder) is checked
first, and a problem there is a usage error (exit 2). With `-o -`, stdout carries result lines
only: whatever else would reach it goes to stderr while the job runs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import click

from batchrun.cli.errors import ROWS_FAILED, fail
from batchrun.cli.job_file import merge_job_file
from batchrun.cli.options import STDIN, BundledCommand, run_options
from batchrun.job.errors import stop_signals

EXAMPLES = (
    ("A JSONL file of prompts; the job's state, results and report go to jobs/prompts/:",
     "batchrun run prompts.jsonl --model mlx-community/Qwen3-0.6B-4bit"),
    ("Label a Parquet file: each row's text gets one of three labels, with every label's "
     "probability (choice_probs):",
     "batchrun run reviews.parquet --prompt-template 'Classify: {text}' \\\n"
     "    --choices positive,negative,neutral -o labels.parquet"),
    ("Resume after Ctrl-C or a crash: the same command goes on where the job stopped "
     "(--restart starts it over; batchrun status jobs/prompts shows its progress):",
     "batchrun run prompts.jsonl --model mlx-community/Qwen3-0.6B-4bit"),
    ("Rows from stdin, kept in the job folder so the job can resume; results to stdout:",
     "cat rows.jsonl | batchrun run - --job-dir jobs/piped -o -"),
)


@click.command(cls=BundledCommand, examples=EXAMPLES)
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@run_options
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
        opts = merge_job_file(ctx, input_path, opts)
        input_path = opts.pop("input")
    to_stdout = _is_dash(opts["output"])
    if to_stdout and sys.stdout is None:
        raise click.UsageError("-o - writes the results to stdout, and this process has none "
                               "(it was closed): pass -o FILE, or leave -o out for the job "
                               "folder's results.jsonl")
    spooled: list[Path] = []  # the stdin job's input, once spooled
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # SIGTERM before the job's own handling (loading, recovering) stops too
        previous = {s: signal.signal(s, _terminated)
                    for s in stop_signals((signal.SIGTERM, signal.SIGHUP))}
        # And Ctrl-C: a process started with SIGINT ignored (a script's `cmd &`, a CI step run
        # in the background) has no KeyboardInterrupt from Python, so until the runner took
        # SIGINT (after the model loaded and the input was hashed) a Ctrl-C was dropped and the
        # job ran on to exit 0; once the runner took it, the same signal stopped the job.
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _stdout_to_stderr(to_stdout):
            code, spec = _run(ctx, input_path, opts, spooled, job_file)
    except KeyboardInterrupt as e:  # before the job's own handling (loading), or a second one
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        how = "interrupted" if signum == signal.SIGINT else \
            f"stopped by {signal.Signals(signum).name}"
        if _job_begun(input_path, opts):
            click.echo(f"{how}: progress so far is kept; run the same command to resume "
                       f"({resume_command(sys.argv[2:], *spooled[:1])})", err=True)
        else:
            click.echo(f"{how} before the job began (nothing was written); run the same "
                       f"command to start it", err=True)
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
            raise fail(f"could not write the results to stdout: {e.strerror or e}; they "
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


def _job_folder(input_path: Path, job_dir: Path | None) -> Path | None:
    """The job folder this command names (None for rows from stdin without --job-dir)."""
    from batchrun.job.spec import default_job_dir

    if job_dir is None and _is_dash(input_path):
        return None
    return Path(job_dir) if job_dir else default_job_dir(Path(input_path))


def _job_begun(input_path: Path, opts: dict) -> bool:
    """Whether the job folder holds a job (its job.json): there is progress to resume."""
    folder = _job_folder(input_path, opts.get("job_dir"))
    try:
        return folder is not None and (folder / "job.json").is_file()
    except OSError:
        return False


def _saved_output(input_path: Path, job_dir: Path | None) -> Path | None:
    """The -o of the job in the job folder, if one is there (None: none, or its own
    results.jsonl; a damaged job.json is said when the job is checked)."""
    from batchrun.job.errors import JobError
    from batchrun.job.spec import saved_output

    folder = _job_folder(input_path, job_dir)
    try:
        return None if folder is None else saved_output(folder)
    except (JobError, OSError):
        return None


def _empty_output(spec) -> bool:
    """An empty input's output: an empty file where none is (never through a link; a file
    already there is left as it is). Whether one was written."""
    from batchrun.io.files import create_new

    try:
        spec.output.parent.mkdir(parents=True, exist_ok=True)
        with create_new(spec.output) as f:
            if spec.parquet_output:
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.table({"text": pa.array([], pa.string()),
                                         "error": pa.array([], pa.string())}), f)
    except OSError:
        return False
    return True


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
    if job_file and not opts["job_dir"]:
        opts["job_dir"] = job_file.parent / job_file.stem
    from_stdin = _is_dash(input_path)
    if _is_dash(opts["output"]):
        # The job's results, printed at the end: those of the job in the folder, whatever -o
        # it ran with (printing a job's results takes no new job), else the folder's
        # results.jsonl.
        opts["output"] = None if opts.get("restart") else \
            _saved_output(input_path, opts["job_dir"])
    if from_stdin:
        _check_stdin(opts, dry_run)
    elif not input_path.exists():
        raise fail(f"input file not found: {input_path}", code=2)
    elif not input_path.is_file():
        raise fail(f"the input {input_path} is not a regular file", code=2)
    if dry_run:
        waiting = _model_pending(opts.get("model"), debug)
        if waiting:  # a dry run fetches and converts nothing: it says what the run would do
            return 0, waiting
    if not opts.get("vision"):
        from batchrun.models import ModelError

        try:
            keep_torch_out(opts.get("model"))  # before anything imports transformers
        except ModelError as e:  # a GGUF file that cannot be converted, a pull that failed
            if debug:
                raise
            raise fail(str(e)) from None
    if dry_run:
        return 0, _dry_run(input_path, opts, debug)

    from batchrun.api import Job
    from batchrun.job import report as rp
    from batchrun.job.errors import EmptyInput, Interrupted, JobError, UsageError
    from batchrun.models import ModelError

    try:
        job = Job(input_path, **opts)
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    except ModelError as e:  # a GGUF file that cannot be converted, a pull that failed
        if debug:
            raise
        raise fail(str(e)) from None
    spec, job_dir = job.spec, job.spec.job_dir
    if moved:
        click.echo(f"output: {spec.output} (the job file's output, moved with --job-dir)",
                   err=True)
    try:
        job.check()  # before the model loads
    except EmptyInput as e:
        job.discard_spool()  # nothing on stdin: nothing kept
        written = _empty_output(spec)
        click.echo(f"warning: {e}: nothing to run" + (f"; {spec.output} is empty" if written
                                                       else ""), err=True)
        return 0, spec
    except JobError as e:
        raise fail(str(e), code=e.exit_code) from None
    if from_stdin:
        spooled.append(spec.input)
        click.echo(f"input:  {spec.input} (the rows from stdin)", err=True)
    done = job.finished()
    if done is not None:
        click.echo(f"already complete: {done.rows_done:,} rows done, {done.rows_failed:,} "
                   f"failed; nothing to run (--restart runs it again)", err=True)
        _say_where(spec, done.rows_failed)
        return _exit_code(done.rows_done, done.rows_failed, fail_on_row_errors, spec), spec
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
            raise fail(str(e), code=e.exit_code) from None
        except OSError as e:
            job.discard_spool()
            if debug:
                raise
            raise fail(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "),
                        f"progress is saved; fix the problem and resume with: {resume}") from e
        click.echo(rp.summary_text(report), err=True)
        if runner.deduplicated:
            click.echo(f"identical rows computed once: {runner.deduplicated:,} reused", err=True)
        _say_where(spec, report["rows_failed"])
        click.echo(f"report:     {job_dir / 'report.html'}", err=True)
        if job.options.ray.address:
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
        return _exit_code(report["rows_done"], report["rows_failed"], fail_on_row_errors,
                          spec), spec


def _exit_code(done: int, failed: int, fail_on_row_errors: bool, spec) -> int:
    """0; 1 when every row of the job ended as an error (a mistake that failed them all, said
    in one line); 3 with --fail-on-row-errors when some did."""
    if failed and not done:
        click.echo(f"Error: every row failed ({failed:,} error records in "
                   f"{spec.errors_path}): fix what they say, then rerun with --restart",
                   err=True)
        return 1
    return ROWS_FAILED if fail_on_row_errors and failed else 0


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


def _model_pending(model: str | None, debug: bool) -> str | None:
    """What a run would first download or convert, for a dry run's stdout; None when the model
    is here to load."""
    from batchrun.models import ModelError, pending

    try:
        waiting = pending(model)
    except ModelError as e:
        if debug:
            raise
        raise fail(str(e)) from None
    if waiting is None:
        return None
    return (f"model:         {waiting}\n"
            "dry run:       nothing downloaded or converted; rows, prompt tokens and the "
            "estimate need the model's tokenizer: dry-run again once the model is here")


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
    from batchrun.api import Job
    from batchrun.io.jsonl import InputError
    from batchrun.job.errors import EmptyInput, JobError, UsageError
    from batchrun.job.spec import check_template_columns
    from batchrun.models import ModelError

    try:
        job = Job(input_path, **opts)
        job.spec.rows_total  # noqa: B018  (a damaged or empty input: before the model loads)
        check_template_columns(job.spec)
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    except EmptyInput as e:
        return f"{e}: nothing to run"
    except JobError as e:
        raise fail(str(e), code=e.exit_code) from None
    except ModelError as e:
        if debug:
            raise
        raise fail(str(e)) from None
    _prepare(job, debug, dry_run=True)
    try:
        found = job.dry_run()
    except (InputError, JobError) as e:
        raise fail(str(e)) from None
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
        raise fail(f"this process may use only {soft >> 20:,} MiB of address space "
                    f"(ulimit -v): MLX needs at least {MIN_ADDRESS_SPACE >> 20:,} MiB to start, "
                    "and a model more; raise the limit and run the command again")


def _prepare(job, debug: bool, dry_run: bool = False) -> None:
    """Load the job's model (or start its Ray runner) and say what runs where, and with which
    sampling defaults; bad options and models are one line."""
    from batchrun.api import MissingExtra
    from batchrun.job.errors import UsageError
    from batchrun.models import DraftModelError, ModelError, model_hint

    _check_address_space()
    try:
        job.prepare(dry_run=dry_run)
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    except MissingExtra as e:
        raise fail(str(e)) from None
    except DraftModelError as e:
        if debug:
            raise
        raise fail(str(e), "pass --draft-model a small mlx-lm model made with the same "
                            "tokenizer as the model") from e
    except ModelError as e:
        if debug:
            raise
        raise fail(str(e), model_hint()) from e
    except Exception as e:
        if debug:
            raise
        raise fail(f"could not load model {job.options.model or 'demo'!r}: {e}",
                   model_hint()) from e
    o = job.options
    if o.ray.address and not dry_run:
        r = job.runner.ray_options
        click.echo(f"model:  {o.model or 'demo'} ({job.runner.model_path})\nray:    "
                   f"{r.address}, {r.actors} actors x {r.num_cpus:g} CPU, "
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
             (f"shared prefix: {found.shared_tokens:,} prompt tokens "
              f"({100 * found.shared_share:.1f}%), at the start of {found.sharing_rows:,} rows, "
              "are blocks another row already has: the prefix cache computes them once"
              if found.sharing_rows else
              "shared prefix: none (no row starts with a block of tokens another row has)"),
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
    if found.first_prompt is not None:
        text = found.first_prompt
        cut = len(text) > FIRST_PROMPT_CHARS
        lines.append("first prompt, as the model sees it"
                     + (f" (its first {FIRST_PROMPT_CHARS:,} characters)" if cut else "") + ":")
        lines.extend("  " + line for line in text[:FIRST_PROMPT_CHARS].splitlines())
    return "\n".join(lines)


FIRST_PROMPT_CHARS = 2000  # of the first row's prompt, shown by a dry run


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


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


def describe_runtime(engine, model: str | None) -> str:
    """What runs where: the model, the device (and its BLAS on a CPU), the batch's bounds."""
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
    plan = getattr(engine, "weight_plan", None)
    if plan is not None and (plan.quantization or plan.changed):
        lines.append(f"weights: {plan.describe()}")
    lines.append(f"batch:  up to {engine.max_concurrency} sequences, KV budget "
                 f"{engine.memory.budget / 2**30:.1f} GiB")
    return "\n".join(lines)
