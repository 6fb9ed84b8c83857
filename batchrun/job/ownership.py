"""An output file belongs to one job: checked before any work, recorded on both sides.

The job folder's job.json names its output; beside the output, a small marker file
(`.<output name>.batchrun`) names the job folder that owns it, created exclusively so that two
jobs starting at once cannot both claim it. A job may write its output only if
- the output is not the input, not a folder, and not inside another job's folder (nor one of
  its own job folder's state files);
- no other job owns it (the marker names this job folder, or there is none);
- an existing output with no marker is this job's own (job.json names it) or empty: batchrun
  never replaces a file it did not write;
- it is a regular file or absent (never a link, a FIFO or a device: data would go elsewhere or
  the job would hang).

A job folder is either a job's (it holds job.json) or holds none of a job's file names: a folder
of the user's own report.html or results.jsonl is never taken over. Job folders do not nest.
The marker names its job folder relative to itself, so a job folder moved together with its
output (the default: the output inside it) still owns it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import orjson

from batchrun.io.files import FILE_MODE

JOB_FILES = frozenset({"job.json", "state.json", "errors.jsonl", "spill.jsonl", "lock",
                       "report.json", "report.html"})
# What a job writes into its folder besides the lock (which a start that stopped before job.json
# may leave behind): a folder holding any of these but no job.json is someone else's.
WRITTEN = (JOB_FILES - {"lock"}) | {"results.jsonl", "ray.json"}
NESTED_SCAN_LIMIT = 10_000  # folder entries looked at for job folders below a new job folder


class OutputConflict(Exception):
    """The output cannot be written by this job; str() says why and what to do."""


def marker_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.batchrun")


def check(output: Path, input_path: Path, job_dir: Path, owned: bool) -> None:
    """Raise OutputConflict if this job may not write `output`. `owned`: the job folder's
    job.json already names this output (a resumed job)."""
    check_output_file(output)
    out, job = full(output), full(job_dir)
    if out == full(input_path) or (out.exists() and _same_file(out, input_path)):
        raise OutputConflict(f"the output {output} is the input file: pass another -o")
    if out.is_dir():
        raise OutputConflict(f"the output {output} is a folder: pass a file path with -o")
    if out.parent == job and out.name in JOB_FILES:
        raise OutputConflict(f"the output {output} is one of the job folder's own files: "
                             "pass another -o")
    for folder in out.parents:
        if folder == job:
            break  # inside its own job folder: what lies above is not another job's
        if (folder / "job.json").is_file():
            raise OutputConflict(f"the output {output} is inside the job folder {folder} of "
                                 "another job: pass an -o outside it")
    owner = read_owner(out)
    if owner is not None and owner != str(job):
        raise OutputConflict(_owned_by(output, owner))
    if owner is None and _has_data(out):
        why = " (its marker is missing)" if owned else ""
        raise OutputConflict(f"the output {output} already exists and was not written by this "
                             f"job{why}: move it away, or pass another -o")


def claim(output: Path, job_dir: Path) -> None:
    """Record beside the output that this job owns it (exclusively: a job that claimed it
    first wins). Raises OutputConflict if another job holds it."""
    marker = marker_path(full(output))
    data = orjson.dumps({"job_dir": os.path.relpath(full(job_dir), marker.parent)})
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    except FileExistsError:
        owner = read_owner(full(output))
        if owner != str(full(job_dir)):
            raise OutputConflict(_owned_by(output, owner)) from None
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
    if not isinstance(owner, str) or not owner or "\0" in owner:
        return UNKNOWN_OWNER
    return str(full(marker.parent / owner))  # relative to the marker (older markers: absolute)


UNKNOWN_OWNER = "?"


def _owned_by(output: Path, owner: str) -> str:
    """Why `output` is not this job's, and what to do."""
    marker = marker_path(Path(output))
    if owner == UNKNOWN_OWNER:
        return (f"the output {output} belongs to another job (its marker {marker} is damaged): "
                f"pass another -o, or delete {marker} if no job writes {output}")
    if not Path(owner).is_dir():
        return (f"the output {output} belongs to the job in {owner}, which no longer exists: "
                f"if that job folder was moved here, delete {marker} to let this job resume "
                f"it; else pass another -o (or move {output} and {marker} away)")
    return (f"the output {output} belongs to the job in {owner}: resume that job with "
            "--job-dir, or pass another -o")


def check_job_dir(job_dir: Path, is_job: bool) -> None:
    """Raise OutputConflict if `job_dir` may not be (or become) a job folder: it is inside
    another job's folder, or, for a new job, it holds files a job writes or other job folders."""
    job = full(job_dir)
    if job.exists() and not job.is_dir():
        raise OutputConflict(f"the job folder {job_dir} is not a folder: pass another --job-dir")
    if is_job:
        return  # an existing job always resumes (even if a job folder was made above it)
    for folder in job.parents:
        if (folder / "job.json").is_file():
            raise OutputConflict(f"the job folder {job_dir} is inside the job folder {folder} of "
                                 "another job: pass a --job-dir outside it")
    if not job.is_dir():
        return
    found = sorted(name for name in WRITTEN if os.path.lexists(job / name))
    if os.path.lexists(job / "lock") and not _is_our_lock(job / "lock"):
        found = sorted([*found, "lock"])
    if found:
        raise OutputConflict(f"{job_dir} is not a batchrun job folder but holds "
                             f"{', '.join(found)}: pass another --job-dir (batchrun does not "
                             "replace files it did not write)")
    nested = _job_below(job)
    if nested is not None:
        raise OutputConflict(f"{job_dir} holds the job folder {nested} of another job: pass a "
                             "--job-dir beside it, not above it")


def check_records_file(path: Path) -> None:
    """Raise OutputConflict if `path` holds data whose first line is not a batchrun record (a
    file put in place of a job's results or errors: never cut back or rebuilt over)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError:
        return  # said by the regular-file checks
    with os.fdopen(fd, "rb") as f:
        head = f.read(1 << 16)
    line, newline, _ = head.partition(b"\n")
    if not newline:
        return  # empty, or a first record cut short by a crash: recovery cuts it
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        record = None
    if not (isinstance(record, dict) and "custom_id" in record):
        raise OutputConflict(f"{path} holds data that is not batchrun's records: move it away "
                             "(or pass another -o), then run the command again")


def check_output_file(output: Path) -> None:
    """Raise OutputConflict if the output is there but is not a regular file."""
    _check_file(output, "the output", "pass another -o")


def check_job_file(path: Path) -> None:
    """Raise OutputConflict if a file the job reads and appends to is there but is not a
    regular file (a link, a FIFO, a folder)."""
    _check_file(path, "the job file", "remove it, then run the same command again")


def _check_file(path: Path, what: str, fix: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise OutputConflict(f"{what} {path} cannot be read ({e.strerror or e}): {fix}") from None
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode) and what == "the output":
        raise OutputConflict(f"the output {path} is a folder: pass a file path with -o")
    kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file")
    if stat.S_ISLNK(mode) and what == "the output":
        fix = "pass the path of the file itself with -o"
    raise OutputConflict(f"{what} {path} is {kind}: {fix}")


def _is_our_lock(path: Path) -> bool:
    """A lock a start of batchrun left (it stopped before writing job.json): a pid, or empty."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) or os.lstat(path).st_size > 32:
            return False
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    return text == "" or text.isdigit()


def _job_below(folder: Path) -> Path | None:
    """A job folder among `folder`'s subfolders and theirs (links not followed), if any."""
    seen = 0
    level = [folder]
    for _ in range(2):
        below = []
        for parent in level:
            try:
                entries = list(os.scandir(parent))
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > NESTED_SCAN_LIMIT:
                    return None
                if entry.is_dir(follow_symlinks=False):
                    sub = Path(entry.path)
                    if (sub / "job.json").is_file():
                        return sub
                    below.append(sub)
        level = below
    return None


def full(path: Path) -> Path:
    """`path` absolute, with links resolved; OutputConflict for a link loop."""
    try:
        return Path(os.path.abspath(Path(path).expanduser())).resolve()
    except (OSError, RuntimeError):  # a symbolic link loop
        raise OutputConflict(f"{path} cannot be resolved (a symbolic link loop?): pass "
                             "another path") from None


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
