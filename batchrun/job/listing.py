"""Job folders at a glance (`batchrun ls`, `batchrun status`, `Job.status()`), read without
loading a model and without writing anything.

Counts come from state.json, the durable progress: the rows in the ordered output and those
finished ahead of a slow row (the spill), as the progress bar counted them at the last commit
(about a second ago while the job runs). report.json is written after it by the same commit and
may lag; it gives the total and the throughput, never the counts. Whether a job runs is asked of
its lock without taking it.
"""

from __future__ import annotations

import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from batchrun.job import manifest as mf
from batchrun.job.state import DamagedFile, JobState, Progress, read_json

DEFAULT_JOBS_DIR = Path("jobs")  # where job folders go by default (spec.default_job_dir)
# report.json's counts that state.json's replace.
COUNTED = {"rows_done": "rows_done", "rows_failed": "rows_failed",
           "prompt_tokens": "prompt_tokens", "cached_prompt_tokens": "cached_tokens",
           "completion_tokens": "completion_tokens"}


class NotAJob(Exception):
    """A folder that is not a batchrun job folder; str() says why."""


@dataclass(slots=True)
class JobSummary:
    job_dir: Path
    model: str
    input: str
    progress: Progress | None  # None before the first commit
    rows_total: int | None  # None when neither report.json nor the input can tell
    status: str  # running, complete, interrupted, failed, stopped, incomplete, not started
    pid: str | None  # of the process running it
    updated: float | None  # last write to its state, report or job.json (epoch seconds)
    report: dict | None

    @property
    def rows_done(self) -> int:
        return self.progress.rows_done if self.progress else 0

    @property
    def rows_failed(self) -> int:
        return self.progress.rows_failed if self.progress else 0

    def figures(self) -> dict:
        """report.json's figures with the durable counts (state.json's) in place of its own."""
        out = dict(self.report or {})
        p = self.progress or Progress()
        for key, field in COUNTED.items():
            out[key] = getattr(p, field)
        if self.rows_total is not None:
            out["rows_total"] = self.rows_total
            out["rows_pending"] = max(0, self.rows_total - p.rows_done - p.rows_failed)
        return out


def running_pid(job_dir: Path) -> str | None:
    """The pid of the process that holds the job folder's lock, or None. Never creates or
    writes the lock; DamagedFile if it is not a regular file."""
    path = Path(job_dir) / "lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DamagedFile(f"{path} cannot be opened ({e.strerror or e}): remove it, then run "
                          "the command again") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DamagedFile(f"{path} is not a regular file: remove it, then run the command "
                              "again")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a running job holds it exclusively
            return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def read_job(job_dir: Path) -> JobSummary:
    """A job folder's progress; NotAJob without job.json, DamagedFile if a file of it is."""
    job_dir = Path(job_dir)
    manifest = mf.saved_manifest(job_dir)
    if manifest is None:
        raise NotAJob(f"{job_dir} is not a batchrun job folder (no job.json)")
    if not isinstance(manifest["input"].get("path"), str):
        raise DamagedFile(f"{job_dir / 'job.json'} is damaged (input.path is missing)")
    pid = running_pid(job_dir)
    results = _records_path(manifest, job_dir)
    progress = JobState(job_dir, results, job_dir / "errors.jsonl").saved()
    report = read_json(job_dir / "report.json")
    problem = report_problem(report) if report is not None else None
    if problem:
        raise DamagedFile(f"{job_dir / 'report.json'} is damaged ({problem})")
    total = report["rows_total"] if report is not None else _count_input(manifest)
    status = _status(pid, progress, total, report)
    return JobSummary(job_dir, str(manifest["model"].get("name")), str(manifest["input"]["path"]),
                      progress, total, status, pid, _updated(job_dir), report)


def list_jobs(root: Path, others: list[Path] | None = None
              ) -> tuple[list[JobSummary], list[str]]:
    """The job folders in `root` (or `root` itself if it is one), by name, and a note for each
    folder skipped (damaged, or a link); folders that are no job's go to `others` where it is
    given (a count is enough to say of them), else get a note too."""
    root = Path(root)
    links: list[Path] = []
    if (root / "job.json").is_file():
        folders = [root]
    else:
        try:
            entries = sorted((e for e in os.scandir(root) if not e.name.startswith(".")),
                             key=lambda e: e.name)
            folders = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
            links = [Path(e.path) for e in entries if e.is_symlink() and e.is_dir()]
        except OSError as e:
            return [], [f"cannot list {root}: {e.strerror or e}"]
    jobs, notes = [], []
    for link in links:  # never followed: a link may lead out of root, or back into it
        notes.append(f"skipped {link}: a link to a folder, not followed (list "
                     f"{link.resolve()} itself)")
    for folder in folders:
        try:
            jobs.append(read_job(folder))
        except NotAJob:
            if others is not None:
                others.append(folder)
            else:
                notes.append(f"skipped {folder}: not a batchrun job folder (no job.json)")
        except DamagedFile as e:
            notes.append(f"skipped {folder}: {e}")
        except (OSError, KeyError, TypeError, ValueError, AttributeError) as e:
            notes.append(f"skipped {folder}: cannot be read ({type(e).__name__}: {e})")
    return jobs, notes


def _records_path(manifest: dict, job_dir: Path) -> Path:
    """Where the job appends its ordered results (the output, or results.jsonl beside a
    Parquet output)."""
    saved = manifest["options"].get("output")
    output = job_dir / saved if isinstance(saved, str) else job_dir / "results.jsonl"
    return job_dir / "results.jsonl" if output.suffix.lower() == ".parquet" else output


# A report.json run's figures that the summary and the report page print, or sum over runs.
RUN_NUMBERS = ("wall_s", "rows_done", "rows_failed", "prompt_tokens", "cached_prompt_tokens",
               "completion_tokens", "prefill_time_s", "decode_time_s", "decode_tokens",
               "decode_steps", "completion_tokens_per_s", "requests_per_s", "mean_batch_size",
               "peak_memory_bytes", "max_concurrency")


def report_problem(report: dict) -> str | None:
    """What makes report.json unusable by `status`, `report` or a resume (a hand-edited or
    damaged value), in words; None if nothing does."""
    total = report.get("rows_total")
    if type(total) is not int or total < 0:
        return f"rows_total is {total!r}, not a count of rows"
    runs = report.get("runs")
    if not isinstance(runs, list):
        return "runs is not a list"
    for i, run in enumerate(runs, 1):
        problem = run_problem(run)
        if problem:
            return f"run {i}: {problem}"
    return None


def run_problem(run: object) -> str | None:
    """What makes one of report.json's runs unusable, in words; None if nothing does."""
    if not isinstance(run, dict):
        return "not an object"
    for key in ("started", "status"):
        if not isinstance(run.get(key), str):
            return f"{key} is {run.get(key)!r}, not text"
    for key in RUN_NUMBERS:
        if type(run.get(key)) not in (int, float):
            return f"{key} is {run.get(key)!r}, not a number"
    timeline = run.get("timeline")
    if timeline is not None and not (isinstance(timeline, list) and all(
            isinstance(p, list) and len(p) == 4 and all(type(x) in (int, float) for x in p)
            for p in timeline)):
        return "timeline is damaged"
    speculation = run.get("speculation")  # absent in runs of an earlier batchrun
    if speculation is not None and not (
            isinstance(speculation, dict) and isinstance(speculation.get("method"), str)
            and isinstance(speculation.get("draft_model"), str | None)
            and type(speculation.get("draft_tokens")) in (int, type(None))):
        return "speculation is damaged"
    return None


def _count_input(manifest: dict) -> int | None:
    """The input's rows, counted (before the first commit there is no report to say)."""
    from batchrun.io.jsonl import InputError
    from batchrun.io.readers import count_rows

    path = Path(manifest["input"]["path"])
    try:
        return count_rows(path) if path.is_file() else None
    except (InputError, OSError):
        return None


def _status(pid: str | None, progress: Progress | None, total: int | None,
            report: dict | None) -> str:
    if pid is not None:
        return "running"
    if progress is None:
        return "not started"
    if total is not None and progress.rows_done + progress.rows_failed >= total \
            and not progress.spill_bytes:
        # every row an error: a mistake that failed them all, not a finished job
        return "failed" if progress.rows_failed and not progress.rows_done else "complete"
    last = (report or {}).get("runs") or [{}]
    # A run's report says "running" until its last commit: one that never came was killed.
    return {"interrupted": "interrupted", "failed": "failed",
            "running": "stopped"}.get(last[-1].get("status"), "incomplete")


def _updated(job_dir: Path) -> float | None:
    times = []
    for name in ("state.json", "report.json", "job.json"):
        try:
            times.append(os.stat(job_dir / name).st_mtime)
        except OSError:
            continue
    return max(times, default=None)


def known_models(root: Path = DEFAULT_JOBS_DIR) -> dict[str, str]:
    """Model names by fingerprint, from the job folders in `root` (their job.json records
    both): how `cache ls` names a prefix-cache folder, which is named by fingerprint."""
    names: dict[str, str] = {}
    jobs, _ = list_jobs(root) if Path(root).is_dir() else ([], [])
    for job in jobs:
        try:
            model = mf.saved_manifest(job.job_dir)["model"]
            names.setdefault(str(model["fingerprint"]), str(model["name"]))
        except (DamagedFile, KeyError, TypeError):
            continue
    return names
