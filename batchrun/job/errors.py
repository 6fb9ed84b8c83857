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


class JobConflict(JobError):
    """The command asks for something that would mix or overwrite jobs' data (exit 2)."""

    exit_code = 2


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP: progress was committed; the job can be resumed."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
