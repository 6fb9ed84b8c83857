"""Durable file writes, and files opened without following links.

A file batchrun creates is never reached through a symbolic link: a link planted under a name
batchrun writes would otherwise send the data elsewhere. New files are created exclusively
(O_EXCL refuses any existing name, a link included); files batchrun appends to are opened with
O_NOFOLLOW and must be regular files.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

# Files a job writes: read and write for all, less the umask (as any tool's `open` makes them)
FILE_MODE = 0o666
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegularFile(OSError):
    """A name batchrun writes is taken by a link, a FIFO, a folder or a device."""


def write_atomic(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Write temp, fsync, rename, fsync the folder: the file is old or new, never torn. `mode`
    (less the umask): the job's files' by default; a private cache's 0600."""
    path = Path(path)
    fd, tmp = temp_beside(path, mode=mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_folder(path.parent)


def temp_beside(path: Path, suffix: str = ".tmp", mode: int = FILE_MODE) -> tuple[int, str]:
    """A new temporary file next to `path`, its mode as the umask makes it (mkstemp's is
    always 0600: a report or output would not get the mode the job's other files get)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(tmp, _NEW, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def create_new(path: Path, mode: int = FILE_MODE) -> BinaryIO:
    """`path` created for writing; FileExistsError if the name is taken (a link included)."""
    return os.fdopen(os.open(path, _NEW, mode), "wb")


def replace_new(path: Path, mode: int = FILE_MODE) -> BinaryIO:
    """`path` created anew for writing: a leftover of an earlier run (a file or a link of that
    name) is removed first, never written through."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return create_new(path, mode)


def open_append(path: Path) -> BinaryIO:
    """`path` opened for appending (created if absent), never through a link; NotRegularFile
    if it is not a regular file."""
    try:
        fd = os.open(path, _APPEND, FILE_MODE)
    except OSError as e:
        if os.path.islink(path):
            raise NotRegularFile(e.errno, f"{path} is a symbolic link") from None
        if os.path.exists(path) and not os.path.isfile(path):  # a FIFO with no reader
            raise NotRegularFile(e.errno, f"{path} is not a regular file") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def fsync_folder(folder: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(folder: Path, names: frozenset[str]) -> int:
    """Remove the temporary files `write_atomic` left in `folder` for any of `names` when the
    process was killed mid-write (`.NAME.XXXX.tmp`); returns how many. Held under the job's
    lock, so no write of them is in flight."""
    removed = 0
    for entry in os.scandir(folder):
        stem = entry.name[1:].rsplit(".", 2)[0] if entry.name.startswith(".") else ""
        if entry.name.endswith(".tmp") and stem in names and not entry.is_dir(
                follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed
