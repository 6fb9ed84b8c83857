"""Users' data: an output belongs to one job, a finished row is durable at once whatever rows
before it still run, state.json is checked against the files (never trusted), and damaged job
files or inputs give one clear line."""

import gzip
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from batchrun.cli import resume_command
from tests.helpers import committed_rows, jsonl, line_count, run, wait_until, write_rows


def rows_file(tmp_path: Path, n: int = 12, name: str = "rows.jsonl") -> Path:
    return write_rows(tmp_path / name, [{"custom_id": f"r{i}", "prompt": f"row {i} says",
                                         "max_tokens": 3} for i in range(n)])


# -- output ownership ---------------------------------------------------------------------------

def test_output_equal_to_the_input_is_refused_before_the_model_loads(tmp_path):
    rows = rows_file(tmp_path)
    before = rows.read_bytes()
    refused = run(rows, "-o", rows, "--job-dir", tmp_path / "job", code=2)
    assert "is the input file" in refused.output
    assert "model:" not in refused.output  # refused before loading anything
    assert rows.read_bytes() == before
    link = tmp_path / "link.jsonl"
    link.symlink_to(rows)
    run(rows, "-o", link, "--job-dir", tmp_path / "job", code=2)
    assert rows.read_bytes() == before


def test_a_second_job_cannot_take_another_jobs_output(tmp_path):
    out = tmp_path / "labels.jsonl"
    run(rows_file(tmp_path), "-o", out, "--job-dir", tmp_path / "a")
    labels = out.read_bytes()
    other = rows_file(tmp_path, 5, "other.jsonl")
    refused = run(other, "-o", out, "--job-dir", tmp_path / "b", code=2)
    assert "belongs to the job in" in refused.output and str(tmp_path / "a") in refused.output
    assert out.read_bytes() == labels
    run(rows_file(tmp_path), "-o", out, "--job-dir", tmp_path / "a")  # its owner resumes
    assert out.read_bytes() == labels


def test_an_output_inside_another_jobs_folder_is_refused(tmp_path):
    rows = rows_file(tmp_path)
    run(rows, "--job-dir", tmp_path / "a")
    other = rows_file(tmp_path, 5, "other.jsonl")
    refused = run(other, "-o", tmp_path / "a" / "mine.jsonl", "--job-dir", tmp_path / "b",
                  code=2)
    assert "inside the job folder" in refused.output
    refused = run(other, "-o", tmp_path / "b" / "errors.jsonl", "--job-dir", tmp_path / "b",
                  code=2)
    assert "job folder's own files" in refused.output


def test_a_file_batchrun_did_not_write_is_never_replaced(tmp_path):
    precious = tmp_path / "precious.jsonl"
    precious.write_text('{"label": "hand-made"}\n')
    refused = run(rows_file(tmp_path), "-o", precious, "--job-dir", tmp_path / "job", code=2)
    assert "was not written by this job" in refused.output
    assert precious.read_text() == '{"label": "hand-made"}\n'
    refused = run(rows_file(tmp_path), "-o", precious, "--job-dir", tmp_path / "job",
                  "--restart", code=2)
    assert precious.read_text() == '{"label": "hand-made"}\n'


def test_a_job_files_output_follows_its_job_dir(tmp_path):
    rows_file(tmp_path)
    job_file = tmp_path / "label.toml"
    job_file.write_text('input = "rows.jsonl"\noutput = "labels.jsonl"\nmax_tokens = 3\n')
    run(job_file)
    labels = (tmp_path / "labels.jsonl").read_bytes()
    # What the refusal for a changed job advises: another --job-dir. It must keep both jobs.
    moved = run(job_file, "--job-dir", tmp_path / "elsewhere", "--max-tokens", "5")
    assert "moved with --job-dir" in moved.output
    assert (tmp_path / "labels.jsonl").read_bytes() == labels
    assert len(jsonl(tmp_path / "elsewhere" / "labels.jsonl")) == 12


def test_no_printed_hint_contains_restart():
    args = ["rows.jsonl", "--restart", "--job-dir", "jobs/x y"]
    assert resume_command(args) == "batchrun run rows.jsonl --job-dir 'jobs/x y'"


def test_ctrl_c_after_restart_hints_a_resume_that_keeps_progress(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [{"custom_id": f"r{i}", "prompt": f"row {i}",
                                                 "max_tokens": 40} for i in range(300)])
    job = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, "-m", "batchrun", "run", str(rows), "--job-dir",
                             str(job), "--restart", "--quiet", "--max-concurrency", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: line_count(job / "results.jsonl") >= 10, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "resume with:" in err and "--restart" not in err.split("resume with:")[1]
    assert "Traceback" not in err


# -- durable rows, whatever the order --------------------------------------------------------

def test_rows_finished_behind_a_slow_row_survive_a_kill_and_are_not_computed_again(tmp_path):
    n = 41
    rows = [{"custom_id": "slow", "prompt": "Once upon a time", "max_tokens": 900}]
    rows += [{"custom_id": f"r{i}", "prompt": f"row {i} says", "max_tokens": 3}
             for i in range(1, n)]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    job = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, "-m", "batchrun", "run", str(path), "--job-dir",
                             str(job), "--quiet", "--max-concurrency", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # The slow row 0 holds the ordered output back; the others are committed from the spill.
    wait_until(lambda: committed_rows(job) >= 20, proc, timeout=120)
    proc.kill()
    proc.wait()
    assert line_count(job / "results.jsonl") == 0, "row 0 should still have been running"
    durable = committed_rows(job)
    assert durable >= 20
    spilled = {orjson.loads(r["line"])["custom_id"]: r["line"].encode()
               for r in jsonl(job / "spill.jsonl")}

    run(path, "--job-dir", job, "--max-concurrency", "8")
    results = jsonl(job / "results.jsonl")
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in rows]
    lines = (job / "results.jsonl").read_bytes().splitlines(keepends=True)
    for line in lines:  # spilled rows are written as they were spilled
        cid = orjson.loads(line)["custom_id"]
        if cid in spilled:
            assert spilled[cid] == line
    report = orjson.loads((job / "report.json").read_bytes())
    resumed = report["runs"][-1]
    assert resumed["rows_done"] + resumed["rows_failed"] == n - durable  # none computed again
    assert report["rows_done"] == n
    assert (job / "spill.jsonl").stat().st_size == 0  # emptied once nothing is held


# -- state verified, not trusted -------------------------------------------------------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished job (results, errors) and its bytes, to tamper with."""
    tmp = tmp_path_factory.mktemp("finished")
    rows = [{"custom_id": f"r{i}", "prompt": f"row {i} says", "max_tokens": 3} for i in range(30)]
    path = tmp / "rows.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows[:10]) + b"{bad json\n"
                     + b"".join(orjson.dumps(r) + b"\n" for r in rows[10:]))
    job = tmp / "job"
    run(path, "--job-dir", job)
    return path, job, (job / "results.jsonl").read_bytes(), (job / "errors.jsonl").read_bytes()


def _copy_job(finished, tmp_path) -> tuple[Path, Path]:
    """The finished job copied elsewhere as it is (a job folder may be copied or moved)."""
    path, job, results, errors = finished
    new = tmp_path / "job"
    shutil.copytree(job, new)
    return path, new


def _edit_state(job: Path, **changes) -> None:
    state = orjson.loads((job / "state.json").read_bytes())
    for key, delta in changes.items():
        state[key] += delta
    (job / "state.json").write_bytes(orjson.dumps(state))


@pytest.mark.parametrize("tamper", ["next_index_up", "next_index_down", "garbage_state",
                                    "cut_results", "drop_middle_line", "missing_results",
                                    "missing_state", "results_bytes_up"])
def test_a_resume_checks_the_state_against_the_files(finished, tmp_path, tamper):
    _, _, results, errors = finished
    path, job = _copy_job(finished, tmp_path)
    if tamper == "next_index_up":
        _edit_state(job, next_index=50)
    elif tamper == "next_index_down":
        _edit_state(job, next_index=-5)
    elif tamper == "garbage_state":
        (job / "state.json").write_bytes(b'{"next_index": 3, "results_')
    elif tamper == "cut_results":
        (job / "results.jsonl").write_bytes(results[: len(results) // 2])
    elif tamper == "drop_middle_line":
        lines = results.splitlines(keepends=True)
        (job / "results.jsonl").write_bytes(b"".join(lines[:5] + lines[6:]))
    elif tamper == "missing_results":
        (job / "results.jsonl").unlink()
    elif tamper == "missing_state":
        (job / "state.json").unlink()
    elif tamper == "results_bytes_up":
        _edit_state(job, results_bytes=10_000)
    out = run(path, "--job-dir", job)
    assert "resuming from what the files hold" in out.output
    assert "Traceback" not in out.output
    # No row skipped, none twice: the same bytes as the untouched job.
    assert (job / "results.jsonl").read_bytes() == results
    assert (job / "errors.jsonl").read_bytes() == errors
    report = orjson.loads((job / "report.json").read_bytes())
    assert (report["rows_done"], report["rows_failed"]) == (30, 1)


# -- damaged inputs and job files ------------------------------------------------------------

def test_a_truncated_gzip_input_is_one_line(tmp_path):
    data = gzip.compress(b"".join(orjson.dumps({"prompt": f"row {i}"}) + b"\n"
                                  for i in range(200)))
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    out = run(path, "--job-dir", tmp_path / "job", code=1)
    assert "rows.jsonl.gz is damaged" in out.output and "Traceback" not in out.output


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_parquet_input_is_one_line(tmp_path, damage):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(300)]}), path)
    data = path.read_bytes()
    path.write_bytes(b"PAR1 not really" * 40 if damage == "garbage" else data[: len(data) // 2])
    out = run(path, "--job-dir", tmp_path / "job", code=1)
    assert "is not a readable Parquet file" in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) <= 6


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b'{"input": 3}',
                                     b"\xff\xfe\x00"])
def test_a_damaged_job_json_is_one_line_for_run_status_and_report(tmp_path, content):
    rows = rows_file(tmp_path)
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    (job / "job.json").write_bytes(content)
    for args in (["run", rows, "--job-dir", job, "--quiet"], ["status", job], ["report", job]):
        result = _invoke(*args)
        assert result.exit_code == 1, result.output
        assert "job.json is damaged" in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) <= 3


@pytest.mark.parametrize("name", ["report.json", "state.json"])
def test_damaged_report_or_state_is_one_line_for_status_and_report(tmp_path, name):
    rows = rows_file(tmp_path)
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    (job / name).write_bytes(b'{"rows_done": ')
    result = _invoke("report", job)
    assert result.exit_code == 1 and f"{name} is damaged" in result.output
    assert "Traceback" not in result.output
    result = _invoke("status", job)  # status says the same, with the same exit code
    assert result.exit_code == 1 and f"{name} is damaged" in result.output
    assert "Traceback" not in result.output
    run(rows, "--job-dir", job)  # a resume rewrites it
    assert _invoke("report", job).exit_code == 0


def test_a_fifo_as_state_json_does_not_hang(tmp_path):
    rows = rows_file(tmp_path)
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    results = (job / "results.jsonl").read_bytes()
    (job / "state.json").unlink()
    os.mkfifo(job / "state.json")
    out = run(rows, "--job-dir", job)  # rebuilt from the files (the FIFO is replaced)
    assert "not a regular file" in out.output
    assert (job / "results.jsonl").read_bytes() == results


@pytest.mark.parametrize("name", ["results.jsonl", "errors.jsonl", "spill.jsonl"])
def test_a_fifo_among_the_files_a_job_appends_to_is_one_line_not_a_hang(tmp_path, name):
    rows = rows_file(tmp_path)
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    (job / name).unlink(missing_ok=True)
    os.mkfifo(job / name)
    proc = _cli("run", rows, "--job-dir", job, "--quiet")
    assert proc.returncode == (2 if name == "results.jsonl" else 1), proc.stderr
    assert f"{name} is a FIFO" in proc.stderr and "Traceback" not in proc.stderr
    assert "model:" not in proc.stderr  # said before the model loads
    (job / name).unlink()
    run(rows, "--job-dir", job)  # removed as told: the job goes on
    assert len(jsonl(job / "results.jsonl")) == 12


def test_state_json_as_a_folder_is_named_with_the_fix(tmp_path):
    rows = rows_file(tmp_path)
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    results = (job / "results.jsonl").read_bytes()
    (job / "state.json").unlink()
    (job / "state.json").mkdir()
    out = run(rows, "--job-dir", job, code=1)
    assert f"{job / 'state.json'} is a folder: remove it" in out.output
    assert ".tmp" not in out.output and "Traceback" not in out.output
    (job / "state.json").rmdir()
    out = run(rows, "--job-dir", job)
    assert (job / "results.jsonl").read_bytes() == results


def test_an_output_that_is_a_link_is_refused_in_one_line(tmp_path):
    rows = rows_file(tmp_path)
    dangling = tmp_path / "out.jsonl"
    dangling.symlink_to(tmp_path / "elsewhere.jsonl")
    out = run(rows, "-o", dangling, "--job-dir", tmp_path / "a", code=2)
    assert "is a symbolic link" in out.output
    assert not (tmp_path / "elsewhere.jsonl").exists() and dangling.is_symlink()
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    out = run(rows, "-o", loop, "--job-dir", tmp_path / "b", code=2)
    assert "is a symbolic link" in out.output and "Traceback" not in out.output
    job = tmp_path / "c"  # the job's own results file replaced by a link to itself
    run(rows, "--job-dir", job)
    (job / "results.jsonl").unlink()
    (job / "results.jsonl").symlink_to(job / "results.jsonl")
    out = run(rows, "--job-dir", job, code=2)
    assert "results.jsonl is a symbolic link" in out.output and "Traceback" not in out.output


def test_a_folder_that_is_not_a_jobs_is_never_taken_over(tmp_path):
    rows = rows_file(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.html").write_text("my own report")
    (mine / "errors.jsonl").write_text('{"mine": 1}\n')
    for extra in ((), ("--restart",)):
        out = run(rows, "--job-dir", mine, *extra, code=2)
        assert "is not a batchrun job folder but holds errors.jsonl, report.html" in out.output
    assert sorted(p.name for p in mine.iterdir()) == ["errors.jsonl", "report.html"]
    assert (mine / "report.html").read_text() == "my own report"


def test_job_folders_do_not_nest(tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    rows = rows_file(here)
    run(rows, "--job-dir", ".")  # a job whose folder is the working folder
    other = rows_file(here, 5, "other.jsonl")
    out = run(other, code=2)  # its default folder jobs/other would be inside it
    assert "is inside the job folder" in out.output and "--job-dir outside it" in out.output
    run(other, "--job-dir", tmp_path / "beside")  # elsewhere it runs
    run(rows, "--job-dir", ".")  # and the first job still resumes
    above = tmp_path / "above"
    above.mkdir()
    run(other, "--job-dir", above / "jobs" / "x")
    out = run(other, "--job-dir", above, code=2)  # a new job over existing job folders
    assert f"holds the job folder {above / 'jobs' / 'x'}" in out.output


def test_a_copied_or_moved_job_folder_resumes_without_computing_again(tmp_path):
    rows = rows_file(tmp_path)
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    results = (job / "results.jsonl").read_bytes()
    shutil.copytree(job, tmp_path / "copy")
    job.rename(tmp_path / "moved")
    for folder in (tmp_path / "copy", tmp_path / "moved"):
        out = run(rows, "--job-dir", folder)
        assert "warning" not in out.output
        assert (folder / "results.jsonl").read_bytes() == results
        assert "already complete: 12 rows done" in out.output  # nothing computed again
        report = orjson.loads((folder / "report.json").read_bytes())
        assert len(report["runs"]) == 1 and report["rows_done"] == 12


def test_an_output_whose_job_folder_was_deleted_says_how_to_adopt_it(tmp_path):
    rows = rows_file(tmp_path)
    out_file = tmp_path / "labels.jsonl"
    run(rows, "-o", out_file, "--job-dir", tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")
    out = run(rows, "-o", out_file, "--job-dir", tmp_path / "new", code=2)
    assert "which no longer exists" in out.output and ".labels.jsonl.batchrun" in out.output
    (tmp_path / ".labels.jsonl.batchrun").unlink()
    out_file.unlink()
    run(rows, "-o", out_file, "--job-dir", tmp_path / "new")
    assert len(jsonl(out_file)) == 12


def test_sigterm_stops_like_ctrl_c_with_exit_143(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [{"custom_id": f"r{i}", "prompt": f"row {i}",
                                                 "max_tokens": 40} for i in range(300)])
    job = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, "-m", "batchrun", "run", str(rows), "--job-dir",
                             str(job), "--quiet", "--max-concurrency", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: line_count(job / "results.jsonl") >= 10, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and "resume with:" in err and "Traceback" not in err
    state = orjson.loads((job / "state.json").read_bytes())
    assert state["rows_done"] >= line_count(job / "results.jsonl") >= 10  # the last commit ran
    out = run(rows, "--job-dir", job, "--max-concurrency", "4")
    assert "warning" not in out.output
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == [f"r{i}" for i in range(300)]


@pytest.mark.parametrize("marker", ["removed", "kept"])
def test_a_users_file_put_in_place_of_a_jobs_output_is_never_cut(tmp_path, marker):
    rows = rows_file(tmp_path)
    out_file = tmp_path / "out.jsonl"
    run(rows, "--job-dir", tmp_path / "j", "-o", out_file)
    if marker == "removed":
        (tmp_path / ".out.jsonl.batchrun").unlink()
    out_file.write_text("user,data,csv\n1,2,3\n")
    refused = run(rows, "--job-dir", tmp_path / "j", "-o", out_file, code=2)
    assert "model:" not in refused.output
    assert out_file.read_text() == "user,data,csv\n1,2,3\n"


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_a_lock_that_is_not_a_file_is_never_written_through(tmp_path, kind):
    rows = rows_file(tmp_path)
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (job / "lock").unlink()
    if kind == "link":
        (job / "lock").symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(job / "lock")
    else:
        (job / "lock").mkdir()
    for args in (["status", job], ["run", rows, "--job-dir", job, "--quiet"]):
        proc = _cli(*args)
        assert proc.returncode == 1, proc.stderr
        assert "lock" in proc.stderr and "Traceback" not in proc.stderr
        assert "model:" not in proc.stderr
    assert victim.read_text() == "keep me"


def test_a_users_own_lock_file_marks_a_folder_as_not_a_jobs(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "lock").write_text("my precious notes\n")
    out = run(rows_file(tmp_path), "--job-dir", mine, code=2)
    assert "is not a batchrun job folder but holds lock" in out.output
    assert (mine / "lock").read_text() == "my precious notes\n"


def test_a_job_made_above_an_existing_one_never_locks_it_out(tmp_path):
    rows = rows_file(tmp_path)
    inner = tmp_path / "outer" / "a" / "b" / "inner"  # too deep for the scan for job folders
    run(rows, "--job-dir", inner)
    run(rows, "--job-dir", tmp_path / "outer", "-o", tmp_path / "o.jsonl")
    run(rows, "--job-dir", inner)  # still resumes
    assert len(jsonl(inner / "results.jsonl")) == 12


def test_an_output_suffix_of_another_format_is_a_usage_error(tmp_path):
    rows = rows_file(tmp_path)
    for name in ("out.jsonl.gz", "out.csv"):
        out = run(rows, "-o", tmp_path / name, "--job-dir", tmp_path / name, code=2)
        assert "batchrun writes JSONL (.jsonl) or Parquet (.parquet)" in out.output
    run(rows, "-o", tmp_path / "out.PARQUET", "--job-dir", tmp_path / "pq")
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "out.PARQUET").num_rows == 12


@pytest.mark.parametrize("inherited", ["SIG_DFL", "SIG_IGN"])
def test_ctrl_c_while_the_job_starts_exits_130_without_a_traceback(tmp_path, inherited):
    """Whatever SIGINT disposition the command inherits: a shell starts a script's `cmd &` (and
    so a test run started that way, and its children) with SIGINT ignored."""
    big = tmp_path / "big.jsonl"  # counting and hashing it keeps the job starting for a while
    line = orjson.dumps({"prompt": "x" * 2000}) + b"\n"
    big.write_bytes(line * 60_000)
    args = [sys.executable, "-m", "batchrun", "run", str(big), "--job-dir", str(tmp_path / "job"),
            "--quiet"]
    # The disposition is set here, not inherited from however pytest itself was started; an
    # ignored signal stays ignored across exec.
    start = (f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{inherited}); "
             f"os.execv(sys.executable, {args!r})")
    proc = subprocess.Popen([sys.executable, "-c", start],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Once the model is loaded (its first header line), not at a fixed time: on a loaded
    # machine 1.5 s could still be inside the interpreter's imports.
    header = proc.stderr.readline()
    assert header.startswith("model:"), header
    assert proc.poll() is None, "the job started too fast for this test"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = header + err
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Aborted" not in err and "Traceback" not in err


# -- helpers -----------------------------------------------------------------------------------

def _cli(*args, timeout: float = 120):
    """batchrun in a child process (a hang fails the test instead of stopping the suite)."""
    return subprocess.run([sys.executable, "-m", "batchrun", *map(str, args)], text=True,
                          capture_output=True, timeout=timeout)


def _invoke(*args):
    from click.testing import CliRunner

    from batchrun.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def test_the_first_row_in_input_order_owns_an_id_whatever_order_rows_are_seen_in():
    """A resumed job first meets the rows that have records; a later duplicate's error record
    must not take the id from an earlier row that was still running."""
    from types import SimpleNamespace

    from batchrun.io.jsonl import RawRow
    from batchrun.job.runner import JobRunner

    runner = SimpleNamespace(_seen_ids={}, spec=SimpleNamespace(rows=SimpleNamespace(
        id_column=None)))

    def check(line: int):
        return JobRunner._check_id(runner, RawRow(line - 1, line, {"custom_id": "A"}))

    assert check(2) is None  # the resume sees line 2's (duplicate) record first
    assert check(1) is None  # line 1 owns the id all the same
    error = check(2)
    assert error is not None and error.code == "duplicate_custom_id" and "line 1" in \
        error.message
    assert check(3).code == "duplicate_custom_id"


def test_sigterm_while_the_model_loads_stops_cleanly_with_exit_143(tmp_path):
    """Before the job loop installs its own handling: one line, 143; nothing was written yet,
    so it says so and that the same command starts the job (no resume is offered)."""
    rows = write_rows(tmp_path / "rows.jsonl", [{"custom_id": "r0", "prompt": "hi"}])
    job = tmp_path / "job"
    slow_load = (  # the model takes long to load: SIGTERM arrives meanwhile
        "import sys, time, batchrun.api as api\n"
        "real = api._local_runner\n"
        "def slow(job):\n"
        "    print('loading', file=sys.stderr, flush=True); time.sleep(30); return real(job)\n"
        "api._local_runner = slow\n"
        "from batchrun.cli import main\n"
        f"sys.argv = ['batchrun', 'run', {str(rows)!r}, '--job-dir', {str(job)!r}, '--quiet']\n"
        "main()\n")
    proc = subprocess.Popen([sys.executable, "-c", slow_load], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().strip() == "loading"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.startswith("stopped by SIGTERM before the job began (nothing was written)")
    assert "run the same command to start it" in err and "resume" not in err
    assert "Traceback" not in err and not (job / "results.jsonl").exists()


def test_files_a_job_writes_take_their_mode_from_the_umask(tmp_path):
    """Results, errors, reports, the Parquet output and the job's own files alike: what
    `touch` would make under the user's umask (group-readable here, none for others)."""
    import stat as st

    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "hi", "max_tokens": 2},
                                                {"prompt": ""}])
    old = os.umask(0o027)
    try:
        run(rows, "--job-dir", tmp_path / "job", "-o", tmp_path / "out.parquet")
    finally:
        os.umask(old)
    written = [p for p in (tmp_path / "job").iterdir() if p.is_file() and p.name != "lock"]
    written.append(tmp_path / "out.parquet")
    names = {p.name for p in written}
    assert {"results.jsonl", "errors.jsonl", "report.json", "report.html", "job.json",
            "state.json", "out.parquet"} <= names
    modes = {p.name: oct(st.S_IMODE(p.stat().st_mode)) for p in written}
    assert set(modes.values()) == {oct(0o640)}, modes


def test_a_stop_that_comes_after_the_last_row_stops_nothing(tmp_path, monkeypatch):
    """Ctrl-C a moment after the last row finished: the job is complete (exit 0), not an
    interrupted one to resume."""
    from batchrun.job.runner import JobRunner

    real = JobRunner._loop

    def loop_then_stop(self, *args):
        done = real(self, *args)
        self._interrupted = signal.SIGINT  # as the handler sets it
        return done

    monkeypatch.setattr(JobRunner, "_loop", loop_then_stop)
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "hi", "max_tokens": 2}] * 3)
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    assert line_count(job / "results.jsonl") == 3
    report = orjson.loads((job / "report.json").read_bytes())
    assert report["runs"][-1]["status"] == "completed"
