"""What stops a job: UsageError (an option that cannot work, exit 2), JobError (exit 1),
JobConflict (exit 2: the command would mix or overwrite jobs' data) and Interrupted (a signal;
progress is committed and the job resumes where it stopped)."""

from __future__ import annotations

import signal


class UsageError(ValueError):
    """An option that cannot work (the command line's exit 2); the message names it."""


class JobError(Exception):
    """A fatal problem with the job as a whole (exit 1); the message says what to do."""

    exit_code = 1


class EmptyInput(JobError):
    """The input holds no rows: nothing to run (exit 0, an empty output and a warning)."""

    exit_code = 0


class InputMismatch(JobError):
    """An option the input cannot serve, found in its first rows (exit 2, as a usage error)."""

    exit_code = 2


class JobConflict(JobError):
    """The command asks for something that would mix or overwrite jobs' data (exit 2)."""

    exit_code = 2


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP: progress was committed; the job can be resumed."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_signals(signals: tuple) -> tuple:
    """The stop signals of `signals` this process takes: SIGHUP stays ignored where it started
    ignored (`nohup batchrun run ... &` runs on after the terminal closes); Ctrl-C and SIGTERM
    are taken whatever the process inherited (a shell starts a script's `cmd &` with SIGINT
    ignored, and such a job could not be stopped with Ctrl-C's signal)."""
    return tuple(s for s in signals
                 if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN))
