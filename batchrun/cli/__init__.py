"""The `batchrun` command line: a thin layer over the job runner, one module a command group
(run, jobs, cache, bench), `run`'s options bundled by topic (options.py).

Exit codes: 0 every row has a result or an error record; 1 a fatal error (progress kept);
2 a usage error (a bad flag or job-file value, a missing input, a refused job), said before the
model loads; 3 with --fail-on-row-errors when a row failed; 130 interrupted by Ctrl-C, 143
stopped by SIGTERM, 129 by SIGHUP (progress kept). With `-o -`, stdout carries result lines only.
Nothing here imports the model stack: `--help` and usage errors answer at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time

import click

import batchrun
from batchrun.cli.bench import bench
from batchrun.cli.cache import cache
from batchrun.cli.errors import ROWS_FAILED, SIGNAL_EXITS, fail
from batchrun.cli.job_file import JOB_FILE_KEYS, JOB_FILE_PATHS
from batchrun.cli.jobs import ls, report, status
from batchrun.cli.models import models
from batchrun.cli.options import MAX_SEED, RUN_BUNDLES, STDIN
from batchrun.cli.run import (
    describe_defaults,
    describe_dry_run,
    describe_runtime,
    resume_command,
    run,
)

__all__ = ["JOB_FILE_KEYS", "JOB_FILE_PATHS", "MAX_SEED", "ROWS_FAILED", "RUN_BUNDLES",
           "SIGNAL_EXITS", "STDIN", "cli", "describe_defaults", "describe_dry_run",
           "describe_runtime", "entry", "fail", "main", "resume_command"]

FAST_EXIT_ENV = "BATCHRUN_FAST_EXIT"  # 0: the interpreter's full teardown at exit
FAST_EXIT_WAIT_S = 1.0  # how long the exit waits for threads still ending


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


cli.add_command(run)
cli.add_command(status)
cli.add_command(ls)
cli.add_command(report)
cli.add_command(bench)
cli.add_command(cache)
cli.add_command(models)


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
