"""A cache folder held open by its descriptor; every file operation goes through that handle.

Invariants, whatever else lives in or around the folder:
- each folder on the way down from the cache root is opened without following a link, and the
  handle is kept: a folder renamed or swapped for a link afterwards does not redirect us;
- a file is read only if it is a regular file: it is opened without following a link and without
  blocking (a FIFO or device never hangs us), checked with fstat, then read from that same
  descriptor, so what was checked is what is read;
- a file is written only by creating a new temporary name exclusively (O_EXCL, which refuses an
  existing name, a planted link included) and renaming it over the target, so nothing is ever
  written through a link and readers see whole files only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
import weakref
from collections.abc import Iterator
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_TRIES = 100


class NotRegularFile(ValueError):
    """A name that is a link, FIFO, device, socket or folder, or a file over the size limit."""


def temp_name() -> str:
    """A fresh unguessable name for a write in progress; the leading dot keeps it out of the
    entry listing."""
    return f".{secrets.token_hex(8)}.tmp"


def sharing_problem(st: os.stat_result) -> str | None:
    """Why a folder with this stat is not private to the current user, or None if it is."""
    if st.st_uid != os.geteuid():
        return "is owned by another user"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by other users"
    return None


class PrivateFolder:
    def __init__(self, path: Path, fd: int):
        self.path = path
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, root: Path, names: list[str], create: bool = True) -> PrivateFolder:
        """`root/names[0]/names[1]/...`, each below the root made 0700 if missing (unless not
        `create`: FileNotFoundError) and opened without following links. Raises OSError
        (ELOOP or ENOTDIR for a link or a file)."""
        if create:
            os.makedirs(root, mode=0o700, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in names:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o700, dir_fd=fd)
                parent, fd = fd, -1
                try:
                    fd = os.open(name, _DIR, dir_fd=parent)
                finally:
                    os.close(parent)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return cls(root.joinpath(*names), fd)

    def close(self) -> None:
        self._closer()

    def sharing_problem(self) -> str | None:
        return sharing_problem(os.fstat(self.fd))

    # -- reading -------------------------------------------------------------------------------

    def read(self, name: str, limit: int) -> bytes | None:
        """The bytes of regular file `name`, None if absent; NotRegularFile for anything else or
        a file over `limit` bytes."""
        try:
            fd = os.open(name, _READ, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # link, socket
                raise NotRegularFile(f"{name} is not a regular file") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(f"{name} is not a regular file")
            if st.st_size > limit:
                raise NotRegularFile(f"{name} is larger than any entry can be")
            chunks, size = [], 0
            while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
            if size > limit:  # it grew while we read
                raise NotRegularFile(f"{name} is larger than any entry can be")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def names(self) -> set[str]:
        """The names in the folder, whatever they are (one directory read, no stat calls)."""
        return set(os.listdir(self.fd))

    def entries(self) -> dict[str, os.stat_result]:
        """The regular files of the folder, by name (links and everything else left out)."""
        out = {}
        with os.scandir(self.fd) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):  # removed while we listed
                    if entry.is_file(follow_symlinks=False):
                        out[entry.name] = entry.stat(follow_symlinks=False)
        return out

    # -- writing -------------------------------------------------------------------------------

    def write(self, name: str, data: bytes) -> None:
        """Replace `name` with `data`: an exclusively created temporary file, renamed."""
        tmp, fd = self._create_temp()
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def _create_temp(self) -> tuple[str, int]:
        for _ in range(_TEMP_TRIES):
            name = temp_name()
            try:
                return name, os.open(name, _CREATE, 0o600, dir_fd=self.fd)
            except FileExistsError:  # taken, or a planted link: never written through
                continue
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(self.path))

    def touch(self, name: str) -> None:
        """Set the modification time of `name` (a use, for LRU eviction); never through a link."""
        os.utime(name, dir_fd=self.fd, follow_symlinks=False)

    def remove(self, name: str) -> None:
        """Remove entry `name` (a link itself, not its target; a folder only if empty)."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=self.fd)
            else:
                os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def remove_tree(self, name: str) -> None:
        """Remove entry `name` and, for a folder, everything below it; no link is followed (a
        link is removed itself)."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=self.fd)  # fd-based: a link inside is removed, not followed
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.fd)

    def new_folder(self, prefix: str) -> str:
        """A new private folder's name in this folder (`prefix` and a random part), created
        exclusively: a name someone planted is never used."""
        for _ in range(_TEMP_TRIES):
            name = f"{prefix}{secrets.token_hex(8)}"
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
                return name
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(self.path))

    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Hold an exclusive lock on regular file `name` (created if missing; a FIFO or link in
        its place is removed first)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        for attempt in range(2):
            try:
                fd = os.open(name, flags, 0o600, dir_fd=self.fd)
            except OSError as e:
                if attempt or e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise
                self.remove(name)
                continue
            if stat.S_ISREG(os.fstat(fd).st_mode):
                break
            os.close(fd)
            if attempt:
                raise NotRegularFile(f"{name} is not a regular file")
            self.remove(name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
