"""An output file belongs to one job: checked before any work, recorded on both sides.

The job folder's job.json names its output; beside the output, a small marker file
(`.<output name>.batchrun`) names the job folder that owns it, created exclusively so that two
jobs starting at once cannot both claim it. A job may write its output only if
- the output is not the input, not a folder, and not inside another job's folder (nor one of
  its own job folder's state files);
- no other job owns it (the marker names this job folder, or there is none);
- an existing output with no marker is this job's own (job.json names it) or empty: batchrun
  never replaces a file it did not write.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson

JOB_FILES = frozenset({"job.json", "state.json", "errors.jsonl", "spill.jsonl", "lock",
                       "report.json", "report.html"})


class OutputConflict(Exception):
    """The output cannot be written by this job; str() says why and what to do."""


def marker_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.batchrun")


def check(output: Path, input_path: Path, job_dir: Path, owned: bool) -> None:
    """Raise OutputConflict if this job may not write `output`. `owned`: the job folder's
    job.json already names this output (a resumed job)."""
    out, job = _full(output), _full(job_dir)
    if out == _full(input_path) or (out.exists() and _same_file(out, input_path)):
        raise OutputConflict(f"the output {output} is the input file: pass another -o")
    if out.is_dir():
        raise OutputConflict(f"the output {output} is a folder: pass a file path with -o")
    if out.parent == job and out.name in JOB_FILES:
        raise OutputConflict(f"the output {output} is one of the job folder's own files: "
                             "pass another -o")
    for folder in out.parents:
        if folder != job and (folder / "job.json").is_file():
            raise OutputConflict(f"the output {output} is inside the job folder {folder} of "
                                 "another job: pass an -o outside it")
    owner = read_owner(out)
    if owner is not None and owner != str(job):
        raise OutputConflict(f"the output {output} belongs to the job in {owner}: resume that "
                             "job with --job-dir, or pass another -o")
    if owner is None and not owned and _has_data(out):
        raise OutputConflict(f"the output {output} already exists and was not written by this "
                             "job: move it away, or pass another -o")


def claim(output: Path, job_dir: Path) -> None:
    """Record beside the output that this job owns it (exclusively: a job that claimed it
    first wins). Raises OutputConflict if another job holds it."""
    marker = marker_path(_full(output))
    data = orjson.dumps({"job_dir": str(_full(job_dir))})
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        owner = read_owner(_full(output))
        if owner != str(_full(job_dir)):
            raise OutputConflict(f"the output {output} belongs to the job in {owner}: resume "
                                 "that job with --job-dir, or pass another -o") from None
        return
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_owner(output: Path) -> str | None:
    """The job folder a marker names; None without a marker. A marker that is not ours to
    read (damaged, a link, a folder) names an unknown owner."""
    marker = marker_path(output)
    if not marker.exists() and not marker.is_symlink():
        return None
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            owner = orjson.loads(f.read(4096)).get("job_dir")
    except (OSError, ValueError, AttributeError):
        owner = None
    return owner if isinstance(owner, str) else f"an unknown job (see {marker})"


def _full(path: Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser())).resolve()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _has_data(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False
