"""Hostile inputs: nothing written through a planted link, no record trusted that was damaged,
no row that stops a job (on any resume), and one clear line for every fault."""

import errno
import gzip
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

import batchrun
from batchrun.cli import _unforeseen, cli
from batchrun.io.files import NotRegularFile, open_append, replace_new
from batchrun.io.jsonl import MAX_DEPTH, read_jsonl, too_deep
from batchrun.job import sink as sink_module
from batchrun.job.limits import RowLimits, parse_limits
from batchrun.job.recovery import recover
from batchrun.job.sink import OrderedSink, commit
from batchrun.job.state import JobState, Progress
from tests.helpers import jsonl, line_count, wait_until, write_rows


def invoke(*args, **kwargs):
    return CliRunner().invoke(cli, [str(a) for a in args], **kwargs)


def deep(levels: int, leaf=1):
    value = leaf
    for _ in range(levels):
        value = [value]
    return value



def rows_of(n: int, **extra) -> list[dict]:
    return [{"custom_id": f"r{i}", "prompt": f"row {i} says", "max_tokens": 3, **extra}
            for i in range(n)]


# -- nothing written through a link ---------------------------------------------------------

def test_the_stdin_spool_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me\n")
    job_dir = tmp_path / "J"
    job_dir.mkdir()
    (job_dir / ".stdin.jsonl.partial").symlink_to(victim)
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows_of(2))
    job = batchrun.Job("-", job_dir=job_dir, stdin=io.BytesIO(data))
    job.check()
    assert victim.read_bytes() == b"keep me\n"
    spooled = job_dir / "stdin.jsonl"
    assert not spooled.is_symlink() and spooled.read_bytes() == data


def test_files_batchrun_appends_to_are_never_opened_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me\n")
    link = tmp_path / "errors.jsonl"
    link.symlink_to(victim)
    with pytest.raises(NotRegularFile, match="symbolic link"):
        open_append(link)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotRegularFile, match="not a regular file"):
        open_append(tmp_path / "fifo")
    with replace_new(link) as f:  # a leftover name is replaced, never written through
        f.write(b"new")
    assert victim.read_bytes() == b"keep me\n" and link.read_bytes() == b"new"


# -- damaged records of a finished job ------------------------------------------------------

def test_a_record_damaged_in_place_in_a_finished_job_is_computed_again(tmp_path):
    rows = rows_of(6)
    path = write_rows(tmp_path / "in.jsonl", rows)
    job = tmp_path / "job"
    assert invoke("run", path, "--job-dir", job, "--quiet").exit_code == 0
    results = job / "results.jsonl"
    before = results.read_bytes()
    lines = before.splitlines(keepends=True)
    lines[2] = b"#" * (len(lines[2]) - 1) + b"\n"  # same size: the old shortcut missed it
    results.write_bytes(b"".join(lines))
    result = invoke("run", path, "--job-dir", job, "--quiet")
    assert result.exit_code == 0, result.output
    assert "already complete" not in result.output
    assert results.read_bytes() == before  # greedy: the same records again, each once
    again = invoke("run", path, "--job-dir", job, "--quiet")
    assert "already complete" in again.output


def test_a_record_edited_to_another_valid_one_is_said_on_resume(tmp_path):
    path = write_rows(tmp_path / "in.jsonl", rows_of(4))
    job = tmp_path / "job"
    assert invoke("run", path, "--job-dir", job, "--quiet").exit_code == 0
    results = job / "results.jsonl"
    data = results.read_bytes()
    first = orjson.loads(data.splitlines()[0])
    edited = orjson.dumps({**first, "text": "X" * len(first["text"])})
    assert len(edited) == len(data.splitlines()[0])
    results.write_bytes(data.replace(data.splitlines()[0], edited, 1))
    result = invoke("run", path, "--job-dir", job)
    assert result.exit_code == 0
    assert "already complete" not in result.output
    assert "results.jsonl was changed after it was written" in result.output


# -- rows that would poison a job -----------------------------------------------------------

@pytest.mark.parametrize("field", ["guided_json", "stop", "max_tokens", "n", "best_of",
                                   "custom_id"])
def test_a_deeply_nested_field_is_that_rows_error_on_every_run(tmp_path, field):
    hostile = orjson.dumps({"prompt": "hostile", "max_tokens": 2, field: 0})
    hostile = hostile.replace(b"0}", b"[" * 1000 + b"1" + b"]" * 1000 + b"}")  # over orjson's
    path = tmp_path / "in.jsonl"  # dump depth, within its load depth
    path.write_bytes(b'{"prompt": "fine", "max_tokens": 2}\n' + hostile
                     + b'\n{"prompt": "fine too", "max_tokens": 2}\n')
    job = tmp_path / "job"
    for _ in range(2):
        result = invoke("run", path, "--job-dir", job, "--quiet")
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output
    errors = jsonl(job / "errors.jsonl")
    assert [e["index"] for e in errors] == [1]
    assert errors[0]["error"]["code"] == "too_deep"
    assert "levels deep" in errors[0]["error"]["message"]
    assert [r["index"] for r in jsonl(job / "results.jsonl")] == [0, 2]


def test_a_too_deep_row_keeps_its_id_for_its_error_record(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"custom_id": "deep", "meta": ' + b"[" * 300 + b"]" * 300 + b'}\n')
    job = tmp_path / "job"
    assert invoke("run", path, "--job-dir", job, "--quiet").exit_code == 1  # its one row failed
    (error,) = jsonl(job / "errors.jsonl")
    assert error["custom_id"] == "deep" and error["error"]["code"] == "too_deep"


def test_nesting_is_measured_without_recursion():
    assert not too_deep(deep(MAX_DEPTH - 1))
    assert too_deep(deep(MAX_DEPTH + 1))
    assert too_deep({"a": [{"b": deep(200)}]})
    assert not too_deep({"messages": [{"role": "user", "content": "x"}] * 1000})


def test_a_line_over_the_row_limit_is_its_rows_error_and_never_read_whole(tmp_path):
    path = tmp_path / "in.jsonl.gz"
    huge = b'{"prompt": "' + b"a" * (3 << 20) + b'"}\n'
    with gzip.open(path, "wb") as f:
        f.write(b'{"prompt": "first", "max_tokens": 2}\n' + huge
                + b'{"prompt": "last", "max_tokens": 2}\n')
    rows = list(read_jsonl(path, max_line=1 << 20))
    assert [r.index for r in rows] == [0, 1, 2] and rows[1].value is None
    assert "over the limit" in rows[1].error and "row-bytes" in rows[1].error
    job = tmp_path / "job"
    result = invoke("run", path, "--job-dir", job, "--quiet", "--limit", "row-bytes=1M")
    assert result.exit_code == 0, result.output
    assert [e["index"] for e in jsonl(job / "errors.jsonl")] == [1]
    assert [r["index"] for r in jsonl(job / "results.jsonl")] == [0, 2]


def test_prompts_templates_and_choices_over_their_limits_are_row_errors(tmp_path):
    rows = [{"prompt": "fine", "max_tokens": 2},
            {"prompt": "x" * 5000, "max_tokens": 2},
            {"messages": [{"role": "user", "content": "y" * 5000}], "max_tokens": 2},
            {"prompt": "pick", "guided_choice": [f"c{i}" for i in range(30)]},
            {"prompt": "pick", "guided_choice": ["short", "z" * 200]}]
    path = write_rows(tmp_path / "in.jsonl", rows)
    job = tmp_path / "job"
    result = invoke("run", path, "--job-dir", job, "--quiet", "--limit", "prompt-chars=1000",
                    "--limit", "choices=20", "--limit", "choice-chars=100")
    assert result.exit_code == 0, result.output
    codes = {e["index"]: e["error"]["code"] for e in jsonl(job / "errors.jsonl")}
    assert codes == {1: "prompt_too_long", 2: "prompt_too_long", 3: "too_many_choices",
                     4: "choice_too_long"}
    assert [r["index"] for r in jsonl(job / "results.jsonl")] == [0]


def test_many_empty_messages_or_huge_tools_count_against_the_prompt_limit(tmp_path):
    rows = [{"messages": [{"role": "user", "content": ""}] * 2000, "max_tokens": 2},
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
             "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(500)]},
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}]
    path = write_rows(tmp_path / "in.jsonl", rows)
    job = tmp_path / "job"
    result = invoke("run", path, "--job-dir", job, "--quiet", "--limit", "prompt-chars=20000")
    assert result.exit_code == 0, result.output
    codes = {e["index"]: e["error"]["code"] for e in jsonl(job / "errors.jsonl")}
    assert codes == {0: "prompt_too_long", 1: "prompt_too_long"}
    assert [r["index"] for r in jsonl(job / "results.jsonl")] == [2]


def test_a_template_width_from_a_row_is_checked_before_it_is_rendered(tmp_path):
    rows = [{"review": "good", "w": 5}, {"review": "bad", "w": 2_000_000_000},
            {"review": "ok", "w": 10**15}]
    path = write_rows(tmp_path / "in.jsonl", rows)
    job = tmp_path / "job"
    result = invoke("run", path, "--job-dir", job, "--quiet", "--max-tokens", "2",
                    "--prompt-template", "Rate: {review:>{w}}")
    assert result.exit_code == 0, result.output
    errors = jsonl(job / "errors.jsonl")
    assert [e["index"] for e in errors] == [1, 2]
    assert all(e["error"]["code"] == "prompt_too_long" for e in errors)


def test_the_job_choices_and_the_limit_flag_are_checked_before_the_model_loads(tmp_path):
    path = write_rows(tmp_path / "in.jsonl", rows_of(1))
    many = ",".join(f"label{i}" for i in range(2000))
    result = invoke("run", path, "--job-dir", tmp_path / "job", "--choices", many)
    assert result.exit_code == 2 and "--limit choices=N" in result.output
    assert "label1999" not in result.output  # no input content in the message
    for bad in ("rows=5", "row-bytes", "row-bytes=lots", "row-bytes=0"):
        result = invoke("run", path, "--job-dir", tmp_path / "job", "--limit", bad)
        assert result.exit_code == 2 and "--limit" in result.output, bad


def test_choices_within_each_limit_but_too_large_together_are_refused(tmp_path):
    rows = [{"prompt": "pick", "max_tokens": 4,
             "guided_choice": [f"{i:04d}" + "x" * 1000 for i in range(1024)]},
            {"prompt": "pick", "max_tokens": 4, "guided_choice": ["yes", "no"]}]
    path = write_rows(tmp_path / "in.jsonl", rows)
    job = tmp_path / "job"
    result = invoke("run", path, "--job-dir", job, "--quiet")
    assert result.exit_code == 0, result.output
    (error,) = jsonl(job / "errors.jsonl")
    assert error["index"] == 0 and "choices-chars" in error["error"]["message"]
    assert [r["index"] for r in jsonl(job / "results.jsonl")] == [1]


def test_a_template_naming_no_column_and_a_limit_too_large_are_usage_errors(tmp_path):
    path = write_rows(tmp_path / "in.jsonl", [{"review": "good"}])
    for template in ("{0}", "{}", "{review.__class__}"):
        result = invoke("run", path, "--job-dir", tmp_path / "job", "--prompt-template",
                        template)
        assert result.exit_code == 2 and "does not name a column" in result.output, template
    for value in ("9223372036854775807", "100000000000G"):
        result = invoke("run", path, "--job-dir", tmp_path / "job", "--limit",
                        f"row-bytes={value}")
        assert result.exit_code == 2 and "between 1 and" in result.output, value


def test_limits_parse_sizes_and_resolve_the_prompt_limit_from_the_context():
    limits = parse_limits(["row-bytes=128M", "choices=5000", "image_bytes=1k"])
    assert (limits.row_bytes, limits.choices, limits.image_bytes) == (128 << 20, 5000, 1024)
    assert parse_limits({"choice-chars": 10}).choice_chars == 10
    assert RowLimits().for_context(131072).prompt_chars == 64 * 131072
    assert RowLimits().for_context(512).prompt_chars == 1 << 20
    assert RowLimits().for_context(None).prompt_chars == 16 << 20
    assert RowLimits(prompt_chars=7).for_context(131072).prompt_chars == 7


# -- one line, never a traceback ------------------------------------------------------------

def test_a_seed_out_of_range_is_a_usage_error_from_the_flag_the_env_and_a_row(tmp_path):
    path = write_rows(tmp_path / "in.jsonl", [{"prompt": "a", "max_tokens": 2, "seed": -1,
                                               "temperature": 1.0}])
    result = invoke("run", path, "--job-dir", tmp_path / "job", "--seed", str(2**64))
    assert result.exit_code == 2 and "--seed" in result.output
    result = invoke("run", path, "--job-dir", tmp_path / "job",
                    env={"BATCHRUN_RUN_SEED": str(10**29)})
    assert result.exit_code == 2 and "--seed" in result.output
    result = invoke("run", path, "--job-dir", tmp_path / "job", "--quiet",
                    "--seed", str(2**64 - 1))
    assert result.exit_code == 1, result.output  # the job's one row failed
    error = jsonl(tmp_path / "job" / "errors.jsonl")[0]["error"]
    assert error["code"] == "invalid_sampling" and "seed" in error["message"]


def test_a_file_as_job_dir_is_a_usage_error_saying_so(tmp_path):
    path = write_rows(tmp_path / "in.jsonl", rows_of(1))
    (tmp_path / "afile").write_text("mine")
    result = invoke("run", path, "--job-dir", tmp_path / "afile")
    assert result.exit_code == 2 and "is a file, not a folder" in result.output
    result = invoke("run", path, "--job-dir", tmp_path / "afile" / "job")
    assert result.exit_code == 2 and "afile is a file" in result.output
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_linked_results_file_of_a_resumed_job_is_said_to_be_a_link(tmp_path):
    path = write_rows(tmp_path / "in.jsonl", rows_of(2))
    job = tmp_path / "job"
    assert invoke("run", path, "--job-dir", job, "--quiet").exit_code == 0
    (job / "results.jsonl").rename(tmp_path / "elsewhere.jsonl")
    (job / "results.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    result = invoke("run", path, "--job-dir", job, "--quiet")
    assert result.exit_code != 0
    assert "symbolic link" in result.output and "different job" not in result.output


def test_report_on_a_folder_it_cannot_write_prints_the_figures_and_one_line(tmp_path,
                                                                            monkeypatch):
    from batchrun.job import report as rp

    path = write_rows(tmp_path / "in.jsonl", rows_of(2))
    job = tmp_path / "job"
    assert invoke("run", path, "--job-dir", job, "--quiet").exit_code == 0
    for code in (errno.EROFS, errno.ENOSPC):
        def refuse(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(rp, "write_report", refuse)
        result = invoke("report", job)
        assert result.exit_code == 1
        assert "2 done" in result.output and os.strerror(code) in result.output
        assert "could not be rewritten" in result.output and "Traceback" not in result.output


def test_unforeseen_errors_are_one_line_naming_the_fix():
    assert "ulimit" in _unforeseen(RuntimeError("can't start new thread"))
    assert "ulimit -n" in _unforeseen(ValueError("not allowed to raise maximum limit"))
    assert "out of memory" in _unforeseen(MemoryError())
    line = _unforeseen(KeyError("x" * 1000))
    assert "\n" not in line and len(line) < 400 and "--debug" in line


@pytest.mark.parametrize("limit", ["ulimit -n 20", "ulimit -v 1000000"])
def test_a_process_limit_too_low_is_one_line(tmp_path, limit):
    path = write_rows(tmp_path / "in.jsonl", rows_of(2))
    command = (f"{limit}; exec {sys.executable} -m batchrun run {path} "
               f"--job-dir {tmp_path / 'job'} --quiet")
    done = subprocess.run(["bash", "-c", command], capture_output=True, timeout=300)
    err = done.stderr.decode()
    if done.returncode == 0:  # the limit was enough here: the job ran whole
        assert line_count(tmp_path / "job" / "results.jsonl") == 2
        return
    assert done.returncode == 1 and "Traceback" not in err
    ours = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(ours) == 1 and "ulimit" in ours[0], err


def test_a_job_started_under_nohup_runs_on_after_sighup(tmp_path):
    """`nohup batchrun run ... &`: SIGHUP started ignored stays ignored (the terminal closing
    does not stop the job); Ctrl-C's signal still would."""
    rows = [{"custom_id": f"r{i}", "prompt": f"row {i}", "max_tokens": 12} for i in range(40)]
    path = write_rows(tmp_path / "in.jsonl", rows)
    job = tmp_path / "job"
    args = [sys.executable, "-m", "batchrun", "run", str(path), "--job-dir", str(job),
            "--quiet", "--max-concurrency", "2"]
    start = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
             f"os.execv(sys.executable, {args!r})")
    proc = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    wait_until(lambda: line_count(job / "results.jsonl") >= 4, proc, timeout=120)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == [r["custom_id"]
                                                                     for r in rows]


def test_sighup_stops_a_job_resumably_with_the_resume_line(tmp_path):
    rows = [{"custom_id": f"r{i}", "prompt": f"row {i}", "max_tokens": 40, "min_tokens": 40}
            for i in range(200)]
    path = write_rows(tmp_path / "in.jsonl", rows)
    job = tmp_path / "job"
    command = [sys.executable, "-m", "batchrun", "run", str(path), "--job-dir", str(job),
               "--quiet", "--max-concurrency", "4"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_until(lambda: line_count(job / "results.jsonl") >= 8, proc, timeout=120)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, err
    assert "stopped by SIGHUP" in err.decode() and "resume with:" in err.decode()
    done = subprocess.run(command, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == [r["custom_id"]
                                                                     for r in rows]


# -- the spill stays as small as the rows held back -----------------------------------------

def test_a_spill_grown_past_its_held_rows_is_rewritten_and_recovers(tmp_path, monkeypatch):
    monkeypatch.setattr(sink_module, "SPILL_SLACK", 0)
    state = JobState(tmp_path, tmp_path / "results.jsonl", tmp_path / "errors.jsonl")
    sink = OrderedSink(state.results_path, state.errors_path, state.spill_path, Progress())

    def line(i):
        return orjson.dumps({"custom_id": f"r{i}", "index": i, "text": "t"}) + b"\n"

    for i in range(1, 10):  # rows 1-9 finish before row 0: spilled
        sink.put(i, line(i), False)
    sink.put(0, line(0), False)  # all ten reach the results file
    sink.put(11, line(11), False)  # row 10 still runs: row 11 is held back
    commit(sink, state)
    spill = state.spill_path.read_bytes().splitlines()
    assert len(spill) == 1 and orjson.loads(spill[0])["index"] == 11
    assert sink.progress.spill_bytes == state.spill_path.stat().st_size
    sink.close()
    # A crash now: state.json recorded the larger spill; the rewritten one still recovers.
    from batchrun.io.jsonl import RawRow

    raws = [RawRow(i, i + 1, {"custom_id": f"r{i}"}) for i in range(12)]
    recovery = recover(JobState(tmp_path, state.results_path, state.errors_path), iter(raws),
                       lambda raw: raw.value["custom_id"], lambda raw: None)
    assert recovery.progress.next_index == 10 and set(recovery.spilled) == {11}
    assert recovery.progress.rows_done == 11
    assert not recovery.problems


def test_a_spill_of_a_long_job_stays_near_the_rows_held_back(tmp_path, monkeypatch):
    monkeypatch.setattr(sink_module, "SPILL_SLACK", 0)
    state = JobState(tmp_path, tmp_path / "results.jsonl", tmp_path / "errors.jsonl")
    sink = OrderedSink(state.results_path, state.errors_path, state.spill_path, Progress())
    # Rows finish as 1, 0, 3, 2, 5, 4, ...: at every commit one row is held back.
    for j in range(200):
        sink.put(2 * j + 1, orjson.dumps({"custom_id": str(2 * j + 1)}) + b"\n", False)
        commit(sink, state)
        assert sink.held == 1
        assert line_count(state.spill_path) <= sink_module.SPILL_GROWTH
        sink.put(2 * j, orjson.dumps({"custom_id": str(2 * j)}) + b"\n", False)
    sink.close()
    assert line_count(state.results_path) == 400


# -- guard against regressions of the stdin spool's path -------------------------------------

def test_the_stdin_spool_helper_replaces_a_planted_link(tmp_path):
    from batchrun.io.readers import spool

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    partial = tmp_path / ".stdin.jsonl.partial"
    partial.symlink_to(victim)
    spool(io.BytesIO(b'{"prompt": "a"}\n'), partial)
    assert victim.read_bytes() == b"keep" and not partial.is_symlink()
    assert Path(partial).read_bytes() == b'{"prompt": "a"}\n'


def test_temporary_files_a_killed_write_left_are_removed_on_resume(tmp_path):
    path = write_rows(tmp_path / "in.jsonl", rows_of(2))
    job = tmp_path / "job"
    assert invoke("run", path, "--job-dir", job, "--quiet", "--restart").exit_code == 0
    for name in (".spill.jsonl.abc123.tmp", ".state.json.x9.tmp", ".report.html.q.tmp"):
        (job / name).write_bytes(b"left by a kill")
    (job / ".mine.tmp").write_bytes(b"not ours")
    (job / "results.jsonl").write_bytes(b"")  # something to do: the job runs again
    assert invoke("run", path, "--job-dir", job, "--quiet").exit_code == 0
    assert sorted(p.name for p in job.glob(".*.tmp")) == [".mine.tmp"]


def test_a_template_column_no_row_has_is_refused_before_the_model_loads(tmp_path):
    """Every row would fail: exit 2 naming the columns there are, with a hint for JSON braces;
    a Parquet file's schema says the same."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = write_rows(tmp_path / "in.jsonl", [{"id": i, "review": f"r{i}"} for i in range(5)])
    parquet = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [1, 2], "review": ["a", "b"]}), parquet)
    for path in (rows, parquet):
        result = CliRunner().invoke(cli, ["run", str(path), "--job-dir", str(tmp_path / "j"),
                                          "--model", str(tmp_path / "no-such-model"),
                                          "--prompt-template", "Review: {text}"])
        assert result.exit_code == 2, result.output
        assert "'text'" in result.output and "'id', 'review'" in result.output
        assert "no-such-model" not in result.output  # said before the model was looked for
    result = CliRunner().invoke(cli, ["run", str(rows), "--job-dir", str(tmp_path / "j"),
                                      "--prompt-template", '{"label": {review}}'])
    assert result.exit_code == 2 and "{{ and }}" in result.output


def test_a_job_whose_every_row_failed_exits_1_and_is_listed_failed(tmp_path):
    rows = write_rows(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": ""},
                                              {"custom_id": "b", "max_tokens": -1,
                                               "prompt": "x"}])
    job = tmp_path / "job"
    result = CliRunner().invoke(cli, ["run", str(rows), "--job-dir", str(job), "--quiet"])
    assert result.exit_code == 1, result.output
    assert "every row failed (2 error records" in result.output
    assert line_count(job / "errors.jsonl") == 2
    listed = CliRunner().invoke(cli, ["ls", str(job)]).output
    assert " failed " in listed
    # a rerun of the finished job says the same
    again = CliRunner().invoke(cli, ["run", str(rows), "--job-dir", str(job), "--quiet"])
    assert again.exit_code == 1
