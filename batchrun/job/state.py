"""The job folder's durable state: which rows are done, committed so that a crash loses nothing.

Results and errors are appended to their files in input order. After the data is fsynced,
`commit()` atomically replaces `state.json` with the row frontier and both files' byte sizes.
On start the files are truncated back to the committed sizes, so a torn tail or rows written
after the last commit disappear and are recomputed: every row appears exactly once, whenever the
process was killed.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from batchrun.io.files import write_atomic  # noqa: F401  (re-exported)


def read_json(path: Path) -> dict | None:
    try:
        return orjson.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return None


@dataclass(slots=True)
class Progress:
    next_index: int = 0  # every row before this one has its result or error committed
    results_bytes: int = 0
    errors_bytes: int = 0
    rows_done: int = 0
    rows_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class JobLock:
    """An exclusive lock on the job folder, released by the kernel if the process dies."""

    def __init__(self, job_dir: Path):
        self.path = Path(job_dir) / "lock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
    def __init__(self, job_dir: Path, results: Path, errors: Path):
        self.state_path = Path(job_dir) / "state.json"
        self.results_path = Path(results)
        self.errors_path = Path(errors)
        self.progress = Progress()

    def load(self) -> Progress:
        """Read the committed progress and cut both files back to it."""
        saved = read_json(self.state_path)
        self.progress = Progress(**saved) if saved else Progress()
        _truncate(self.results_path, self.progress.results_bytes)
        _truncate(self.errors_path, self.progress.errors_bytes)
        return self.progress

    def reset(self) -> None:
        for path in (self.state_path, self.results_path, self.errors_path):
            path.unlink(missing_ok=True)
        self.progress = Progress()

    def commit(self, progress: Progress) -> None:
        """Record progress whose data is already flushed and fsynced."""
        write_atomic(self.state_path, orjson.dumps(asdict(progress)))
        self.progress = progress


def _truncate(path: Path, size: int) -> None:
    if not path.exists():
        if size:
            raise RuntimeError(f"{path} is missing but state.json says {size} bytes were "
                               "committed: restore it or start over with --restart")
        path.touch()
        return
    actual = path.stat().st_size
    if actual < size:
        raise RuntimeError(f"{path} is shorter ({actual} bytes) than its committed size "
                           f"({size}): restore it or start over with --restart")
    if actual > size:
        with open(path, "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
