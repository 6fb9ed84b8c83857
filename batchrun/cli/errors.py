"""What every command shares to end: the exit codes and the one-line error a user sees.

Exit codes: 0 every row has a result or an error record; 1 a fatal error (progress kept);
2 a usage error; 3 with --fail-on-row-errors when a row failed; 129, 130, 143 after SIGHUP,
Ctrl-C and SIGTERM (progress kept).
"""

from __future__ import annotations

import click

ROWS_FAILED = 3  # exit code of --fail-on-row-errors when a row failed
SIGNAL_EXITS = (129, 130, 143)  # exit codes after SIGHUP, Ctrl-C and SIGTERM


def fail(message: str, hint: str | None = None, code: int = 1) -> click.ClickException:
    """A one-line error (and what to do about it) that ends the command with `code`."""
    error = click.ClickException(message + (f"\n  hint: {hint}" if hint else ""))
    error.exit_code = code
    return error
