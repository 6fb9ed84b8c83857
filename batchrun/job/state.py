"""The job folder's durable state: which rows are done, committed so that a crash loses nothing.

Results and errors are appended to their files in input order, and rows that finish ahead of
that order to the spill (job/sink.py). After the data is fsynced, `commit()` atomically replaces
`state.json` with the row frontier, the three files' byte sizes and the counts. On start,
job/recovery.py checks state.json against the files (never trusting it alone) and cuts the files
back to what was committed, so a torn tail or rows written after the last commit disappear and
are recomputed: every row appears exactly once, whenever the process was killed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from batchrun.io.files import FILE_MODE, write_atomic  # noqa: F401  (re-exported)


class DamagedFile(Exception):
    """A job file that exists but cannot be read as what it should be; str() says which."""


def read_json(path: Path) -> dict | None:
    """A job folder's JSON object file; None if absent. Raises DamagedFile if it is not a
    readable JSON object (truncated, garbage, a folder, a FIFO...)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DamagedFile(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DamagedFile(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as e:
        raise DamagedFile(f"{path} cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise DamagedFile(f"{path} is damaged (not valid JSON)") from None
    if not isinstance(value, dict):
        raise DamagedFile(f"{path} is damaged (not a JSON object)")
    return value


@dataclass(slots=True)
class Progress:
    next_index: int = 0  # every row before this one is in the ordered results or errors file
    results_bytes: int = 0
    errors_bytes: int = 0
    spill_bytes: int = 0  # rows finished ahead of the frontier (job/sink.py)
    rows_done: int = 0  # counts and tokens: every durable row, in order or spilled
    rows_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # SHA-256 of the results and errors files' committed bytes: a finished job is trusted as
    # finished only while its files still hash to these (a record damaged in place keeps the
    # file's size).
    results_sha256: str = ""
    errors_sha256: str = ""


DIGESTS = ("results_sha256", "errors_sha256")


class JobLock:
    """An exclusive lock on the job folder, released by the kernel if the process dies."""

    def __init__(self, job_dir: Path):
        self.path = Path(job_dir) / "lock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        """True once held; False if another process holds it. DamagedFile if the lock is not
        a regular file (never written through a link, never a FIFO)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                         FILE_MODE)
        except OSError as e:
            raise DamagedFile(f"{self.path} cannot be opened ({e.strerror or e}): remove it, "
                              "then run the command again") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DamagedFile(f"{self.path} is not a regular file: remove it, then run the "
                              "command again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class JobState:
    """state.json and the files it describes; job/recovery.py loads them."""

    def __init__(self, job_dir: Path, results: Path, errors: Path):
        self.state_path = Path(job_dir) / "state.json"
        self.results_path = Path(results)
        self.errors_path = Path(errors)
        self.spill_path = Path(job_dir) / "spill.jsonl"
        self.progress = Progress()

    def saved(self) -> Progress | None:
        """The committed progress as state.json says it; raises DamagedFile if unreadable."""
        saved = read_json(self.state_path)
        if saved is None:
            return None
        try:
            progress = Progress(**saved)
        except TypeError:
            raise DamagedFile(f"{self.state_path} is damaged (unknown fields)") from None
        counts = {k: v for k, v in asdict(progress).items() if k not in DIGESTS}
        if not all(type(v) is int and v >= 0 for v in counts.values()):
            raise DamagedFile(f"{self.state_path} is damaged (a count is not a whole number)")
        if not all(isinstance(getattr(progress, k), str) for k in DIGESTS):
            raise DamagedFile(f"{self.state_path} is damaged (a digest is not text)")
        return progress

    def reset(self) -> None:
        for path in (self.state_path, self.results_path, self.errors_path, self.spill_path):
            path.unlink(missing_ok=True)
        self.progress = Progress()

    def commit(self, progress: Progress) -> None:
        """Record progress whose data is already flushed and fsynced."""
        write_atomic(self.state_path, orjson.dumps(asdict(progress)))
        self.progress = progress


def file_digest(path: Path, size: int) -> hashlib._Hash:
    """A running SHA-256 of the first `size` bytes of `path` (absent: of nothing)."""
    digest = hashlib.sha256()
    if size:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            while size > 0 and (chunk := f.read(min(size, 1 << 20))):
                digest.update(chunk)
                size -= len(chunk)
    return digest
