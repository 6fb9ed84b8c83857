"""Crash safety: SIGKILL at any moment, then re-run: every row exactly once, no torn line, and
the same bytes as an uninterrupted run. Ctrl-C: exit 130 with progress kept."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

ROWS = 160


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("crash") / "rows.jsonl"
    lines = []
    for i in range(ROWS):
        row = {"custom_id": f"c{i}", "prompt": f"Row {i}: the kettle is " + "quiet " * (i % 9),
               "max_tokens": 6 + i % 11}
        if i % 7 == 0:
            row = {"custom_id": f"c{i}", "messages": [{"role": "user", "content": f"Hi {i}"}],
                   "max_tokens": 8, "temperature": 0.9}  # sampled rows too
        lines.append(orjson.dumps(row).decode())
        if i % 40 == 3:
            lines.append("{broken json")  # error rows must also appear exactly once
    path.write_text("\n".join(lines) + "\n")
    return path


def start(job_input, job_dir, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "batchrun", "run", str(job_input), "--job-dir", str(job_dir),
         "--quiet", "--max-concurrency", "6", "--prefill-batch-size", "2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_for_lines(path: Path, n: int, proc, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while lines(path) < n and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(job_input, tmp_path_factory):
    job = tmp_path_factory.mktemp("ref") / "job"
    proc = start(job_input, job)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return (job / "results.jsonl").read_bytes(), (job / "errors.jsonl").read_bytes()


def check_complete(job: Path, reference) -> None:
    results = (job / "results.jsonl").read_bytes()
    errors = (job / "errors.jsonl").read_bytes()
    for blob in (results, errors):
        assert blob.endswith(b"\n")
        for line in blob.splitlines():
            orjson.loads(line)  # no torn line
    indices = [orjson.loads(x)["index"] for x in results.splitlines()]
    error_indices = [orjson.loads(x)["index"] for x in errors.splitlines()]
    assert indices == sorted(indices)
    assert sorted(indices + error_indices) == list(range(ROWS + len(error_indices)))
    assert (results, errors) == reference


def test_sigkill_at_several_points_then_resume(job_input, reference, tmp_path):
    job = tmp_path / "job"
    # Kill before the first commit, then after 10, 40 and 90 committed-or-written rows.
    kill_points = [0, 10, 40, 90]
    for n in kill_points:
        proc = start(job_input, job)
        if n == 0:
            time.sleep(1.0)
        else:
            wait_for_lines(job / "results.jsonl", n, proc)
        assert proc.poll() is None, f"ended before it could be killed: {proc.communicate()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc = start(job_input, job)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    check_complete(job, reference)
    report = orjson.loads((job / "report.json").read_bytes())
    assert report["rows_done"] + report["rows_failed"] == report["rows_total"]
    assert report["runs"][-1]["status"] == "completed"


def test_ctrl_c_exits_130_and_resumes(job_input, reference, tmp_path):
    job = tmp_path / "job"
    proc = start(job_input, job)
    wait_for_lines(job / "results.jsonl", 20, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "resume with: batchrun run" in err and "--job-dir" in err
    report = orjson.loads((job / "report.json").read_bytes())
    assert report["runs"][-1]["status"] == "interrupted"
    assert 0 < report["rows_done"] < ROWS
    proc = start(job_input, job)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    check_complete(job, reference)
    assert len(orjson.loads((job / "report.json").read_bytes())["runs"]) == 2


def test_status_works_while_the_job_runs(job_input, tmp_path):
    job = tmp_path / "job"
    proc = start(job_input, job)
    try:
        wait_for_lines(job / "results.jsonl", 5, proc)
        deadline = time.monotonic() + 20
        while not (job / "report.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        out = subprocess.run([sys.executable, "-m", "batchrun", "status", str(job)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"running (pid {proc.pid})" in out.stdout
        assert "pending of" in out.stdout
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(job / "state.json")
