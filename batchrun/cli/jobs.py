"""The commands that read a job folder: `status`, `ls` and `report`.

They never load a model, and a folder that is not a job's, or whose files are damaged, is one
line (exit 1) saying what to do.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from batchrun.cli.errors import fail


@click.command()
@click.argument("job_dir", type=click.Path(path_type=Path, file_okay=False))
def status(job_dir: Path) -> None:
    """Rows done / failed / pending and throughput so far (also while the job runs)."""
    from batchrun.job.listing import read_job
    from batchrun.job.report import summary_text
    from batchrun.job.state import DamagedFile

    _read_job(job_dir)  # a folder that is not a job's, or damaged files: one line each
    _saved_progress(job_dir)
    try:
        job = read_job(job_dir)
    except DamagedFile as e:
        raise fail(str(e)) from None
    state = f"running (pid {job.pid})" if job.pid else f"not running ({job.status})"
    click.echo(f"job:        {job_dir} — {state}\ninput:      {job.input}\n"
               f"model:      {job.model}")
    if job.report is None:
        if job.progress is None:
            click.echo("no progress recorded yet")
        else:
            total = "?" if job.rows_total is None else f"{job.rows_total:,}"
            click.echo(f"rows:       {job.rows_done:,} done, {job.rows_failed:,} failed of "
                       f"{total}")
        return
    click.echo(summary_text(job.figures()))


@click.command("ls")
@click.argument("directory", metavar="[DIR]", required=False,
                type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--verbose", "-v", is_flag=True,
              help="also name each folder that is not a job folder")
def ls(directory: Path | None, verbose: bool) -> None:
    """The job folders under DIR (default jobs/) with their progress, one line each."""

    from batchrun.job.listing import DEFAULT_JOBS_DIR, list_jobs

    root = directory or DEFAULT_JOBS_DIR
    if directory is None and not root.is_dir():
        click.echo(f"no jobs: {root}/ does not exist here")
        return
    others: list[Path] = []
    jobs, notes = list_jobs(root, None if verbose else others)
    for note in notes:
        click.echo(note, err=True)
    if others:
        click.echo(f"skipped {len(others):,} folder{'s' if len(others) > 1 else ''} that "
                   f"{'are' if len(others) > 1 else 'is'} not a job folder (--verbose names "
                   f"{'them' if len(others) > 1 else 'it'})", err=True)
    if not jobs:
        click.echo(f"no job folders in {root}")
        return
    width = max(len(str(j.job_dir)) for j in jobs)
    for j in jobs:
        total = "?" if j.rows_total is None else f"{j.rows_total:,}"
        share = f" ({100 * (j.rows_done + j.rows_failed) / j.rows_total:.0f}%)" \
            if j.rows_total else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.updated)) \
            if j.updated else "-"
        pid = f" (pid {j.pid})" if j.pid else ""
        click.echo(f"{str(j.job_dir):<{width}}  {j.status + pid:<11}  {j.rows_done:,} done, "
                   f"{j.rows_failed:,} failed of {total}{share}  model {j.model}  "
                   f"updated {when}")


@click.command()
@click.argument("job_dir", type=click.Path(path_type=Path, file_okay=False))
def report(job_dir: Path) -> None:
    """Print the job's report; rewrite report.json and report.html."""
    from batchrun.job import report as rp

    manifest, saved = _read_job(job_dir)
    if saved is None:
        raise fail(f"{job_dir} has no report yet", "run the job first: batchrun run INPUT")
    progress = _saved_progress(job_dir)
    if progress is None:
        raise fail(f"{job_dir} has no state.json", "resume the job with batchrun run")
    fresh = rp.build_report(manifest, progress, saved["rows_total"], saved["runs"],
                            saved["device"])
    try:  # the records' figures (labels, accuracy, errors) first: the summary prints them
        rp.write_report(job_dir, fresh)
    except OSError as e:
        click.echo(rp.summary_text(fresh))
        raise fail(f"report.json and report.html in {job_dir} could not be rewritten: "
                    f"{e.strerror or e}", "the figures above are current") from None
    click.echo(rp.summary_text(fresh))
    click.echo(f"report:     {job_dir / 'report.html'}")


def _saved_progress(job_dir: Path):
    """state.json's progress (None before the first commit); one line (exit 1) if damaged."""
    from batchrun.job.state import DamagedFile, JobState

    try:
        return JobState(job_dir, job_dir / "results.jsonl", job_dir / "errors.jsonl").saved()
    except DamagedFile as e:
        raise fail(str(e), "resume the job with batchrun run: it rebuilds its state from the "
                    "files") from None


def _read_job(job_dir: Path) -> tuple[dict, dict | None]:
    """A job folder's job.json and report.json (None before the first report); one clear
    line (exit 1) for a folder that is not a job's or whose files are damaged."""
    from batchrun.job import manifest as mf
    from batchrun.job import report as rp
    from batchrun.job.listing import report_problem
    from batchrun.job.state import DamagedFile, read_json

    try:
        manifest = mf.saved_manifest(job_dir)
        if manifest is None:
            raise fail(f"{job_dir} is not a batchrun job folder (no job.json)")
        report = read_json(job_dir / "report.json")
    except DamagedFile as e:
        raise fail(str(e)) from None
    if not isinstance(manifest["input"].get("path"), str):
        raise fail(f"{job_dir / 'job.json'} is damaged (input.path is missing)",
                    f"move the job folder {job_dir} away to start over")
    if report is not None:
        problem = report_problem(report) or (None if rp.well_formed(report)
                                             else "fields are missing")
        if problem:
            raise fail(f"{job_dir / 'report.json'} is damaged ({problem})",
                        "resume the job with batchrun run: it rewrites the report")
    return manifest, report
