"""The command line's contract (SPEC.md): stdin and stdout, --format, exit codes checked before the
model loads, the different-job refusal, `ls`, `status`, `--dry-run`, the model's generation
defaults, `cache ls`, the flags passed through, and OpenAI batch output that openai-python
accepts."""

import gzip
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

import batchrun.api
from batchrun.cli import cli, resume_command
from batchrun.job.errors import UsageError
from tests.helpers import committed_rows, jsonl, line_count, run, wait_until, write_rows

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "sample_data" / "demo-model"


def invoke(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


def cli_process(*args, stdin: bytes | None = None, timeout: float = 180, code: str | None = None):
    """batchrun in a child process: (return code, stdout bytes, stderr text)."""
    command = [sys.executable, "-c", code, *map(str, args)] if code else \
        [sys.executable, "-m", "batchrun", *map(str, args)]
    done = subprocess.run(command, input=stdin, capture_output=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr.decode()


def rows_of(n: int, **extra) -> list[dict]:
    return [{"custom_id": f"r{i}", "prompt": f"row {i} says", "max_tokens": 3, **extra}
            for i in range(n)]


def no_model(monkeypatch):
    """Loading a model fails the test: what it checks must come before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(batchrun.api, "load_engine", refuse)


def model_copy(tmp_path: Path, generation: dict, name: str = "model") -> Path:
    """The demo model with another generation_config.json."""
    folder = tmp_path / name
    shutil.copytree(DEMO, folder)
    (folder / "generation_config.json").write_bytes(orjson.dumps(generation))
    return folder


# -- 1. stdin in, stdout out ------------------------------------------------------------------

# Anything printed while the job runs (a library's print, a write to file descriptor 1) must
# not reach stdout with -o -.
NOISY = ("import os, sys\n"
         "import batchrun.job.runner as r\n"
         "prepare = r.JobRunner.prepare\n"
         "def noisy(self):\n"
         "    print('noise from print'); sys.stdout.flush(); os.write(1, b'noise from fd 1\\n')\n"
         "    return prepare(self)\n"
         "r.JobRunner.prepare = noisy\n"
         "sys.argv = ['batchrun', *sys.argv[1:]]\n"
         "from batchrun.cli import main\n"
         "main()\n")


def test_a_finished_jobs_results_print_to_stdout_whatever_its_output(tmp_path):
    """`-o -` asks for the job's results on stdout: a job that wrote them to a file prints
    them without being a different job (no --restart, no model loaded)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows_of(3)))
    job, out = tmp_path / "job", tmp_path / "labels.jsonl"
    rc, _, err = cli_process("run", rows, "--job-dir", job, "-o", out, "--quiet")
    assert rc == 0, err
    rc, printed, err = cli_process("run", rows, "--job-dir", job, "-o", "-", "--quiet")
    assert rc == 0 and printed == out.read_bytes() and len(printed.splitlines()) == 3, err
    assert "model:" not in err  # nothing ran
    # with --restart, a new job: its results on stdout, the old output file left as it was
    before = out.read_bytes()
    rc, printed, err = cli_process("run", rows, "--job-dir", job, "-o", "-", "--quiet",
                                   "--restart", "--max-tokens", "2")
    assert rc == 0 and len(printed.splitlines()) == 3 and out.read_bytes() == before, err


def test_rows_from_stdin_and_results_on_stdout_carry_nothing_else(tmp_path):
    rows = rows_of(6)
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    job = tmp_path / "job"
    rc, out, err = cli_process("run", "-", "--job-dir", job, "-o", "-", stdin=data, code=NOISY)
    assert rc == 0, err
    lines = out.splitlines()
    records = [orjson.loads(line) for line in lines]  # every stdout line is a result line
    assert [r["custom_id"] for r in records] == [r["custom_id"] for r in rows]
    assert [r["index"] for r in records] == list(range(6))
    assert all(set(r) >= {"text", "finish_reason", "usage"} for r in records)
    assert out == (job / "results.jsonl").read_bytes()  # the job folder keeps them too
    assert (job / "stdin.jsonl").read_bytes() == data  # spooled: the job can resume
    assert "noise from print" in err and "noise from fd 1" in err
    assert "6 done, 0 failed" in err and "model:" in err  # messages on stderr
    # The same rows again: already complete, and the same results on stdout.
    rc, again, err = cli_process("run", "-", "--job-dir", job, "-o", "-", stdin=data)
    assert rc == 0 and again == out and "already complete" in err
    # Other rows into the same job folder: refused (exit 2), the spooled rows are kept.
    rc, out, err = cli_process("run", "-", "--job-dir", job, stdin=b'{"prompt": "other"}\n')
    assert rc == 2 and "different job" in err and "the input changed" in err
    assert out == b"" and (job / "stdin.jsonl").read_bytes() == data


def test_a_stdin_job_survives_ctrl_c_and_resumes_from_its_spooled_rows(tmp_path):
    rows = [{"custom_id": f"r{i}", "prompt": f"row {i}", "max_tokens": 40, "min_tokens": 40}
            for i in range(200)]
    piped = write_rows(tmp_path / "piped.jsonl", rows)
    job = tmp_path / "job"
    with open(piped, "rb") as stdin:
        proc = subprocess.Popen([sys.executable, "-m", "batchrun", "run", "-", "--job-dir",
                                 str(job), "--quiet", "--max-concurrency", "4"], stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_until(lambda: line_count(job / "results.jsonl") >= 8, proc, timeout=120)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err
    hint = err.split("resume with:")[1].strip()
    assert hint.split()[:3] == ["batchrun", "run", str(job / "stdin.jsonl")]  # not "-"
    rc, _, err = cli_process(*hint.split()[1:])  # the printed command, without stdin
    assert rc == 0, err
    assert "resuming:" in err
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == [r["custom_id"]
                                                                       for r in rows]


def test_rows_from_stdin_need_a_job_dir_said_before_reading_them(tmp_path, monkeypatch):
    no_model(monkeypatch)
    result = invoke("run", "-", "--quiet", input='{"prompt": "hi"}\n')
    assert result.exit_code == 2
    assert "--job-dir" in result.output and "stdin.jsonl" in result.output


def test_the_resume_hint_of_a_stdin_job_names_its_spooled_rows():
    spooled = Path("jobs/x/stdin.jsonl")
    assert resume_command(["-", "-o", "-", "--job-dir", "jobs/x", "--restart"], spooled) == \
        "batchrun run jobs/x/stdin.jsonl -o - --job-dir jobs/x"
    assert resume_command(["-o", "-", "-", "--job-dir", "jobs/x"], spooled) == \
        "batchrun run -o - jobs/x/stdin.jsonl --job-dir jobs/x"


# -- 2. --format -------------------------------------------------------------------------------

def test_format_reads_the_input_whatever_its_suffix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = tmp_path / "rows.txt"
    write_rows(text, rows_of(3))
    refused = run(text, "--job-dir", tmp_path / "no", code=2)
    assert ".jsonl" in refused.output and ".parquet" in refused.output
    assert "--format" in refused.output
    run(text, "--job-dir", tmp_path / "a", "--format", "jsonl")
    assert [r["custom_id"] for r in jsonl(tmp_path / "a" / "results.jsonl")] == ["r0", "r1", "r2"]
    packed = tmp_path / "rows.data"  # gzip JSONL under another name
    packed.write_bytes(gzip.compress(text.read_bytes()))
    run(packed, "--job-dir", tmp_path / "b", "--format", "jsonl")
    assert (tmp_path / "b" / "results.jsonl").read_bytes() == \
        (tmp_path / "a" / "results.jsonl").read_bytes()
    table = tmp_path / "rows.bin"  # Parquet under another name
    pq.write_table(pa.Table.from_pylist(rows_of(3)), table)
    run(table, "--job-dir", tmp_path / "c", "--format", "parquet")
    assert [r["custom_id"] for r in jsonl(tmp_path / "c" / "results.jsonl")] == ["r0", "r1", "r2"]
    forced = run(text, "--job-dir", tmp_path / "d", "--format", "parquet", code=1)
    assert "not a readable Parquet file" in forced.output and "model:" not in forced.output


# -- 3. exit codes -------------------------------------------------------------------------------

def usage_cases(tmp_path: Path) -> list[tuple[list, str]]:
    rows = write_rows(tmp_path / "rows.jsonl", rows_of(2))

    def job_file(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(f'input = "rows.jsonl"\n{text}')
        return path

    return [
        ([tmp_path / "missing.jsonl"], "input file not found"),
        ([tmp_path / "missing.toml"], "job file not found"),
        ([job_file("unknown.toml", "max_tokenz = 3\n")], "unknown keys max_tokenz"),
        ([job_file("broken.toml", "max_tokens = \n")], "is not valid TOML"),
        ([job_file("word.toml", 'max_tokens = "ten"\n')], "max_tokens"),
        ([job_file("negative.toml", "temperature = -1\n")], "temperature"),
        ([job_file("list.toml", 'system = ["a", "b"]\n')], "system takes one value"),
        ([job_file("nodraft.toml", 'draft_model = " "\n')], "nodraft.toml: draft_model is empty"),
        ([job_file("nomodel.toml", 'model = ""\n')], "nomodel.toml: model is empty"),
        ([tmp_path / "noinput.toml"], "needs an 'input' key"),
        ([rows, "--max-tokens", "0"], "--max-tokens"),
        ([rows, "--top-p", "2"], "--top-p"),
        ([rows, "--format", "csv"], "looks like JSONL: pass --format jsonl"),
        ([rows, "--choices", "a,b", "--regex", "x"], "at most one"),
        ([rows, "--regex", "(unclosed"], "--regex"),
        ([rows, "--prompt-template", "Classify: {review"], "--prompt-template"),
        ([job_file("schema.toml", 'json_schema = "schema.json"\n')], "--json-schema"),
        ([rows, "--image-column", "image"], "--image-column needs a vision model"),
        ([rows, "--served-model-name", "a,,b"], "--served-model-name"),
        ([rows, "-o", tmp_path / "out.csv"], "writes JSONL"),
        ([rows, "--json-schema", tmp_path / "nope.json"], "--json-schema"),
        ([tmp_path / "rows.csv"], "looks like JSONL: pass --format jsonl"),
        ([tmp_path / "rows.xlsx"], "--format"),
    ]


def test_every_usage_error_exits_2_before_the_model_loads(tmp_path, monkeypatch):
    (tmp_path / "rows.csv").write_text('{"prompt": "hi"}\n{"prompt": "bye"}\n')
    (tmp_path / "rows.xlsx").write_text('{"prompt": "hi"}\n')
    (tmp_path / "noinput.toml").write_text("max_tokens = 3\n")
    (tmp_path / "schema.json").write_text('{"type": "no such type"}')
    no_model(monkeypatch)
    for args, message in usage_cases(tmp_path):
        result = invoke("run", *args, "--job-dir", tmp_path / "job", "--quiet")
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output and "model:" not in result.output
    assert not (tmp_path / "job").exists()


def test_job_file_values_are_checked_like_the_flags(tmp_path):
    write_rows(tmp_path / "rows.jsonl", rows_of(2))
    (tmp_path / "ok.toml").write_text('input = "rows.jsonl"\nmax_tokens = 2\nmedia_timeout = 5\n'
                                      'stop = "zz"\nchoices = ["a, b", "c"]\n')
    run(tmp_path / "ok.toml")
    saved = orjson.loads((tmp_path / "ok" / "job.json").read_bytes())["options"]["sampling"]
    assert saved["max_tokens"] == 2 and saved["stop"] == ["zz"]
    assert saved["constraint"]["value"] == ["a, b", "c"]  # a label may hold a comma


# -- 4. the different-job refusal ------------------------------------------------------------------

def test_a_different_job_is_refused_in_words_before_the_model_loads(tmp_path, monkeypatch):
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": f"row {i}"} for i in range(3)])
    job = tmp_path / "job"
    run(rows, "--job-dir", job, "--max-tokens", "4")
    no_model(monkeypatch)
    refused = run(rows, "--job-dir", job, "--max-tokens", "9", "--temperature", "0.5",
                  "--system", "Be brief.", code=2)
    text = refused.output
    assert "holds a different job" in text
    assert "max_tokens (--max-tokens): 4 -> 9" in text
    assert "temperature (--temperature): 0 -> 0.5" in text
    assert 'system (--system): unset -> "Be brief."' in text
    assert "{" not in text  # no Python dicts
    assert "another --job-dir" in text and "pass --restart" in text  # the flags that fix it
    assert "Traceback" not in text
    monkeypatch.undo()
    other = model_copy(tmp_path, {"eos_token_id": [0, 2], "top_k": 4})
    no_model(monkeypatch)
    refused = run(rows, "--job-dir", job, "--max-tokens", "4", "--model", other, code=2)
    assert "the model changed" in refused.output
    assert "top_k (--top-k): 0 -> 4 (the model's generation_config.json)" in refused.output
    monkeypatch.undo()
    run(rows, "--job-dir", job, "--max-tokens", "9", "--restart")  # what the refusal named
    assert all(r["usage"]["completion_tokens"] <= 9 for r in jsonl(job / "results.jsonl"))


# -- 5. ls -------------------------------------------------------------------------------------

def test_ls_lists_job_folders_with_their_progress_and_skips_others(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "first.jsonl", rows_of(3))
    write_rows(tmp_path / "second.jsonl", rows_of(2) + [{"custom_id": "bad"}])
    run("first.jsonl")  # default job folders: jobs/first, jobs/second
    run("second.jsonl")
    (tmp_path / "jobs" / "notes").mkdir()  # a folder of the user's
    (tmp_path / "jobs" / "broken").mkdir()
    (tmp_path / "jobs" / "broken" / "job.json").write_text("{garbage")
    shutil.copytree(tmp_path / "jobs" / "first", tmp_path / "jobs" / "fresh")
    (tmp_path / "jobs" / "fresh" / "state.json").unlink()  # job.json only: not started
    (tmp_path / "jobs" / "fresh" / "report.json").unlink()
    no_model(monkeypatch)
    result = invoke("ls")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    first, fresh, second = lines
    assert first.startswith("jobs/first ") and "complete" in first
    assert "3 done, 0 failed of 3 (100%)" in first and "model demo" in first
    assert re.search(r"updated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", first)
    assert "not started" in fresh and "0 done, 0 failed of 3 (0%)" in fresh
    assert "2 done, 1 failed of 3" in second
    assert "skipped 1 folder that is not a job folder (--verbose names it)" in result.stderr
    assert "jobs/notes" not in result.stderr
    verbose = invoke("ls", "--verbose")
    assert "skipped jobs/notes: not a batchrun job folder" in verbose.stderr
    assert verbose.stdout == result.stdout
    assert "skipped jobs/broken" in result.stderr and "job.json is damaged" in result.stderr
    assert "Traceback" not in result.output
    assert invoke("ls", "jobs/first").stdout.startswith("jobs/first ")  # a job folder itself
    assert invoke("ls", tmp_path / "missing").exit_code == 2


def test_ls_reads_job_folders_without_the_model_stack(tmp_path):
    run(write_rows(tmp_path / "rows.jsonl", rows_of(2)), "--job-dir", tmp_path / "jobs" / "a")
    code = ("import sys; from click.testing import CliRunner; from batchrun.cli import cli; "
            "out = CliRunner().invoke(cli, ['ls', sys.argv[1]]).stdout; "
            "heavy = [m for m in ('mlx.core', 'mlx_lm', 'pyarrow', 'transformers') "
            "if m in sys.modules]; print(heavy, out.count('complete'))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "jobs")],
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["[]", "1"], done.stderr


def test_ls_says_which_jobs_run(tmp_path):
    from batchrun.job.state import JobLock

    rows = write_rows(tmp_path / "rows.jsonl", rows_of(2))
    run(rows, "--job-dir", tmp_path / "jobs" / "a")
    lock = JobLock(tmp_path / "jobs" / "a")
    assert lock.acquire()
    try:
        out = invoke("ls", tmp_path / "jobs").stdout
        assert f"running (pid {os.getpid()})" in out
        status = invoke("status", tmp_path / "jobs" / "a").stdout
        assert f"running (pid {os.getpid()})" in status
    finally:
        lock.release()
    assert "complete" in invoke("ls", tmp_path / "jobs").stdout


# -- 6. --dry-run ------------------------------------------------------------------------------

INSTRUCTION = ("You label customer reviews of kitchen appliances. Read the review, decide whether "
               "the customer is satisfied, and answer with one word. " * 4)


def test_dry_run_counts_rows_tokens_and_the_shared_prefix_and_writes_nothing(tmp_path,
                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"custom_id": f"r{i}", "prompt": INSTRUCTION + f"Review {i}: it broke on day {i}.",
             "max_tokens": 5} for i in range(10)] + [{"custom_id": "bad", "prompt": ""}]
    write_rows(tmp_path / "rows.jsonl", rows)
    result = invoke("run", "rows.jsonl", "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert not (tmp_path / "jobs").exists()  # no job folder
    assert not (tmp_path / "cache" / "prefix").exists()  # no prefix-cache entry either
    engine = batchrun.Engine.load()
    ids = [engine.prompts.encode(r["prompt"]) for r in rows[:10]]
    assert "rows:          11 (1 would be error records; first: line 11:" in out
    assert f"prompt tokens: {sum(map(len, ids)):,}" in out
    shared = sum(len(_common(ids[i], ids[:i])) // 64 * 64 for i in range(1, 10))
    assert shared > 0
    assert f"shared prefix: {shared:,} prompt tokens ({100 * shared / sum(map(len, ids)):.1f}%), " \
        in out
    assert "at the start of 9 rows" in out and "at most 50" in out
    assert re.search(r"estimate: +about [\d.]+ (ms|s) on this machine "
                     r"\(an estimate: 8 rows probed", out)
    # The real run's prompt tokens are what the dry run counted.
    run("rows.jsonl")
    assert sum(r["usage"]["prompt_tokens"] for r in jsonl("jobs/rows/results.jsonl")) == \
        sum(map(len, ids))
    from_stdin = invoke("run", "-", "--dry-run", input=(tmp_path / "rows.jsonl").read_text())
    assert from_stdin.exit_code == 0 and f"prompt tokens: {sum(map(len, ids)):,}" in \
        from_stdin.stdout


def _common(ids: list[int], earlier: list[list[int]]) -> list[int]:
    """The longest start `ids` shares with an earlier prompt."""
    best = 0
    for other in earlier:
        n = 0
        while n < min(len(ids), len(other)) and ids[n] == other[n]:
            n += 1
        best = max(best, n)
    return ids[:best]


# -- 7. the model's generation defaults ------------------------------------------------------------

def test_generation_config_sets_defaults_where_row_and_flags_say_nothing(tmp_path):
    model = model_copy(tmp_path, {"eos_token_id": [0, 2], "temperature": 0.7, "top_k": 5,
                                  "max_new_tokens": 3, "repetition_penalty": 1.1})
    rows = write_rows(tmp_path / "rows.jsonl", [
        {"custom_id": "plain", "prompt": "Once upon a time"},
        {"custom_id": "own", "prompt": "Once upon a time", "max_tokens": 6, "min_tokens": 6}])
    result = run(rows, "--model", model, "--job-dir", tmp_path / "a")
    line = next(x for x in result.output.splitlines() if x.startswith("sampling:"))
    assert "temperature 0.7, top_k 5, repetition_penalty 1.1, max_tokens 3 (the model's " \
           "generation_config.json)" in line
    assert "top_p 1, min_p 0 (batchrun's)" in line
    plain, own = jsonl(tmp_path / "a" / "results.jsonl")
    assert plain["usage"]["completion_tokens"] <= 3
    assert own["usage"]["completion_tokens"] == 6  # the row's own wins
    saved = orjson.loads((tmp_path / "a" / "job.json").read_bytes())["options"]["sampling"]
    assert (saved["temperature"], saved["top_k"], saved["max_tokens"]) == (0.7, 5, 3)
    flagged = run(rows, "--model", model, "--job-dir", tmp_path / "b", "--temperature", "0",
                  "--max-tokens", "2")
    assert "temperature 0, max_tokens 2 (flags)" in flagged.output
    # A changed generation_config.json is a different job, said before the model loads.
    (model / "generation_config.json").write_bytes(orjson.dumps(
        {"eos_token_id": [0, 2], "temperature": 0.9, "top_k": 5, "max_new_tokens": 3,
         "repetition_penalty": 1.1}))
    refused = run(rows, "--model", model, "--job-dir", tmp_path / "a", code=2)
    assert "temperature (--temperature): 0.7 -> 0.9 (the model's generation_config.json)" \
        in refused.output and "device:" not in refused.output
    job = batchrun.Job(rows, model=str(model), job_dir=tmp_path / "api", top_k=9)
    assert job.spec.rows.defaults.temperature == 0.9 and job.spec.rows.defaults.top_k == 9


def test_a_bad_generation_config_value_is_a_usage_error_naming_it(tmp_path, monkeypatch):
    model = model_copy(tmp_path, {"top_p": 0})
    rows = write_rows(tmp_path / "rows.jsonl", rows_of(1))
    no_model(monkeypatch)
    refused = run(rows, "--model", model, "--job-dir", tmp_path / "job", code=2)
    assert "top_p" in refused.output and "generation_config.json" in refused.output
    # A flag overrides it: the usage checks pass, and the (refused) model load is next.
    loading = run(rows, "--model", model, "--job-dir", tmp_path / "job", "--top-p", "0.9",
                  code=1)
    assert "the model was loaded" in loading.output


# -- 8. status agrees with the progress bar -----------------------------------------------------

def test_status_counts_the_durable_rows_even_when_the_report_lags(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", rows_of(12))
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    report = orjson.loads((job / "report.json").read_bytes())
    # As if the process died after a commit's state.json and before its report.json.
    report.update(rows_done=5, rows_pending=7)
    (job / "report.json").write_bytes(orjson.dumps(report))
    out = invoke("status", job).stdout
    assert "12 done, 0 failed, 0 pending of 12" in out
    assert "complete" in invoke("ls", tmp_path).stdout
    status = batchrun.Job(rows, job_dir=job).status()
    assert status["rows_done"] == 12 and status["rows_pending"] == 0


def test_status_while_a_job_runs_counts_rows_finished_ahead_of_a_slow_row(tmp_path):
    """Polled while the job runs: status reports state.json's counts (the progress bar's at the
    last commit), spilled rows included, never more than the bar and never going back."""
    slow = {"custom_id": "slow", "prompt": "a long one", "max_tokens": 2500, "min_tokens": 2500}
    rows = write_rows(tmp_path / "rows.jsonl", [slow] + [
        {"custom_id": f"r{i}", "prompt": f"row {i}", "max_tokens": 8} for i in range(300)])
    job = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, "-m", "batchrun", "run", str(rows), "--job-dir",
                             str(job), "--max-concurrency", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen, ahead = [], False
    try:
        while proc.poll() is None:
            if (job / "report.json").exists():
                before = committed_rows(job)
                out = invoke("status", job).stdout
                after = committed_rows(job)
                match = re.search(r"([\d,]+) done, ([\d,]+) failed, ([\d,]+) pending of 301", out)
                if match:
                    count = int(match[1].replace(",", "")) + int(match[2].replace(",", ""))
                    assert before <= count <= after, (before, count, after)
                    assert not seen or count >= seen[-1]
                    seen.append(count)
                    # the ordered output holds nothing past the slow first row yet
                    ahead = ahead or (count > 1 and line_count(job / "results.jsonl") == 0)
            time.sleep(0.2)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 0, err
    assert len(seen) >= 3 and ahead, "status never showed rows finished behind the slow row"
    bar = [int(n) for n in re.findall(r"\| *(\d+)/301 ", err)]
    assert bar and max(seen) <= max(bar) == 301
    assert "301 done, 0 failed, 0 pending of 301" in invoke("status", job).stdout


# -- 9. cache ls names the model --------------------------------------------------------------

def test_cache_ls_names_the_model_of_each_cache_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"custom_id": f"r{i}", "prompt": INSTRUCTION + f"Review {i}.", "max_tokens": 2}
            for i in range(4)]
    write_rows(tmp_path / "rows.jsonl", rows)
    run("rows.jsonl")
    other = model_copy(tmp_path, {"eos_token_id": [0, 2], "top_k": 3}, name="my-model")
    run("rows.jsonl", "--model", other, "--job-dir", "jobs/mine")
    out = invoke("cache", "ls").stdout.splitlines()
    assert len(out) == 2
    names = sorted(line.split()[0] for line in out)
    assert names == sorted(["demo", str(other)])
    monkeypatch.chdir(ROOT / "sample_data")  # no jobs/ here: the demo model is still named
    out = invoke("cache", "ls").stdout
    assert "demo " in out and "unknown model" in out


# -- 10. flags passed through -------------------------------------------------------------------

def test_max_thinking_tokens_and_served_model_names_reach_the_job(tmp_path, monkeypatch):
    rows = write_rows(tmp_path / "rows.jsonl", rows_of(2))
    job = tmp_path / "job"
    run(rows, "--job-dir", job, "--max-thinking-tokens", "7")
    saved = orjson.loads((job / "job.json").read_bytes())["options"]["sampling"]
    assert saved["max_thinking_tokens"] == 7  # part of the job: a changed bound is another job
    refused = run(rows, "--job-dir", job, "--max-thinking-tokens", "8", code=2)
    assert "max_thinking_tokens (--max-thinking-tokens): 7 -> 8" in refused.output
    seen = {}

    def capture(job):
        seen["names"] = job.spec.rows.served_model_names
        seen["thinking"] = job.spec.rows.defaults.max_thinking_tokens
        raise UsageError("stop here")

    monkeypatch.setattr(batchrun.api, "_local_runner", capture)
    monkeypatch.setenv("BATCHRUN_RUN_SERVED_MODEL_NAME", "gpt-4o, mini")
    monkeypatch.setenv("BATCHRUN_RUN_MAX_THINKING_TOKENS", "5")
    run(rows, "--job-dir", tmp_path / "env", code=2)
    assert seen == {"names": ("gpt-4o", "mini"), "thinking": 5}
    run(rows, "--job-dir", tmp_path / "flag", "--served-model-name", "a", code=2)
    assert seen["names"] == ("a",)


# -- 11. OpenAI batch format, validated by openai-python -----------------------------------------

def test_openai_batch_output_validates_with_openai_python(tmp_path):
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi"}], "max_tokens": 5}
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", **chat}},
        {"custom_id": "chat-n", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", **chat, "n": 2, "logprobs": True, "top_logprobs": 2,
                  "temperature": 0.8}},
        {"custom_id": "comp", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "Once upon", "max_tokens": 4, "logprobs": 2}},
        {"custom_id": "comp-stop", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "Once upon", "max_completion_tokens": 4,
                  "stop": ["\n"]}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m"}},
        {"custom_id": "bad-field", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "x", "echo": True}},
    ]
    data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    job = tmp_path / "job"
    rc, out, err = cli_process("run", "-", "--job-dir", job, "-o", "-", "--quiet", stdin=data)
    assert rc == 0, err
    results = [orjson.loads(line) for line in out.splitlines()]
    assert [r["custom_id"] for r in results] == ["chat", "chat-n", "comp", "comp-stop"]
    for line in results:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        if body["object"] == "chat.completion":
            parsed = ChatCompletion.model_validate(body)
            assert parsed.choices[0].message.role == "assistant"
        else:
            parsed = Completion.model_validate(body)
            assert parsed.object == "text_completion"
        assert parsed.model == "demo" and parsed.usage.total_tokens == \
            parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    sampled = ChatCompletion.model_validate(results[1]["response"]["body"])
    assert len(sampled.choices) == 2
    assert all(len(t.top_logprobs) == 2 for c in sampled.choices for t in c.logprobs.content)
    comp = Completion.model_validate(results[2]["response"]["body"])
    assert len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens
    errors = jsonl(job / "errors.jsonl")
    assert [e["custom_id"] for e in errors] == ["bad-url", "bad-body", "bad-field"]
    for i, e in enumerate(errors, start=5):
        # exactly OpenAI's error-file line: no other keys, BatchError's fields strictly
        assert set(e) == {"id", "custom_id", "response", "error"}
        assert e["response"] is None and e["id"].startswith("batch_req_")
        assert isinstance(e["error"]["code"], str) and isinstance(e["error"]["message"], str)
        assert BatchError.model_validate(e["error"], strict=True).line == i
    assert [e["error"]["code"] for e in errors] == ["unsupported_url", "missing_prompt",
                                                    "unsupported_field"]


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_openai_rows_through_a_job_file_keep_the_shape(tmp_path, url):
    """The same body through a job file: the output validates whatever the way in."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    body = ({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in url
            else {"prompt": "Once upon"})
    write_rows(tmp_path / "batch.jsonl", [{"custom_id": f"c{i}", "method": "POST", "url": url,
                                           "body": {"model": "x", **body, "max_tokens": 3}}
                                          for i in range(3)])
    (tmp_path / "job.toml").write_text('input = "batch.jsonl"\n')
    run(tmp_path / "job.toml")
    kind = ChatCompletion if "chat" in url else Completion
    for line in jsonl(tmp_path / "job" / "results.jsonl"):
        kind.model_validate(line["response"]["body"])


# -- hostile review 17: damaged job files, stdin spools, job files, ls, dry runs -------------------

def damaged_copy(job: Path, name: str, file: str, edit) -> Path:
    """A copy of the job folder `job` whose JSON `file` went through `edit` (a hand edit)."""
    folder = job.parent / name
    shutil.copytree(job, folder)
    data = orjson.loads((folder / file).read_bytes())
    edit(data)
    (folder / file).write_bytes(orjson.dumps(data))
    return folder


def test_status_and_report_say_damaged_job_files_in_one_line(tmp_path):
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows_of(2)), "--job-dir", job)
    no_path = damaged_copy(job, "no_path", "job.json", lambda m: m["input"].pop("path"))
    bad_status = damaged_copy(job, "bad_status", "report.json",
                              lambda r: r["runs"][-1].update(status=["x"]))
    bad_speculation = damaged_copy(job, "bad_speculation", "report.json",
                                   lambda r: r["runs"][-1].update(speculation="x"))
    for folder, said in ((no_path, "job.json is damaged (input.path"),
                         (bad_status, "report.json is damaged (run 1: status"),
                         (bad_speculation, "report.json is damaged (run 1: speculation")):
        for command in ("status", "report"):
            result = invoke(command, folder)
            assert result.exit_code == 1 and isinstance(result.exception, SystemExit), \
                result.output
            assert said in result.output and "Traceback" not in result.output


def test_a_resume_drops_damaged_earlier_runs_and_rewrites_the_report(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", rows_of(2))
    run(rows, "--job-dir", tmp_path / "job")
    job = damaged_copy(tmp_path / "job", "damaged", "report.json",
                       lambda r: r["runs"][0].update(started=12345))
    run(rows, "--job-dir", job)
    runs = orjson.loads((job / "report.json").read_bytes())["runs"]
    assert runs and all(isinstance(r["started"], str) for r in runs)
    assert invoke("report", job).exit_code == 0


def test_a_stdin_job_that_never_began_keeps_no_spool(tmp_path):
    job = tmp_path / "job"
    assert invoke("run", "-", "--job-dir", job, "--quiet", input="").exit_code == 0  # no rows
    assert not (job / "stdin.jsonl").exists()
    (job / "results.jsonl").unlink()  # the empty input's empty output
    data = jsonl_text(rows_of(2))
    result = invoke("run", "-", "--job-dir", job, "--quiet", "--model", tmp_path / "nowhere",
                    input=data)
    assert result.exit_code == 1 and not (job / "stdin.jsonl").exists(), result.output
    (job / "stdin.jsonl").write_text(jsonl_text(rows_of(1)))  # left by an older start
    assert invoke("run", "-", "--job-dir", job, "--quiet", input=data).exit_code == 2
    result = CliRunner().invoke(cli, ["run", "-", "--job-dir", str(job), "--quiet",
                                      "--restart"], input=data)
    assert result.exit_code == 0, result.output
    assert line_count(job / "results.jsonl") == 2


def jsonl_text(rows: list[dict]) -> str:
    return "".join(orjson.dumps(r).decode() + "\n" for r in rows)


def test_a_refused_stdin_job_writes_nothing_into_another_jobs_folder(tmp_path, monkeypatch):
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows_of(2)), "--job-dir", job)
    before = sorted(p.name for p in job.iterdir())
    no_model(monkeypatch)
    result = invoke("run", "-", "--job-dir", job, "--quiet", input=jsonl_text(rows_of(2)))
    assert result.exit_code == 2 and "holds a different job" in result.output, result.output
    assert sorted(p.name for p in job.iterdir()) == before


def test_the_resume_hint_of_a_job_file_reading_stdin_gives_it_the_spooled_rows():
    assert resume_command(["jf/job.toml", "--quiet"], Path("jf/job/stdin.jsonl")) == \
        "batchrun run jf/job.toml --quiet < jf/job/stdin.jsonl"


def test_a_job_file_output_dash_writes_to_stdout(tmp_path):
    write_rows(tmp_path / "rows.jsonl", rows_of(2))
    (tmp_path / "job.toml").write_text('input = "rows.jsonl"\noutput = "-"\n')
    code, out, err = cli_process("run", tmp_path / "job.toml", "--quiet")
    assert code == 0, err
    assert [r["custom_id"] for r in map(orjson.loads, out.splitlines())] == ["r0", "r1"]
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("line", ["max_tokens = 1.9", "max_thinking_tokens = true",
                                  "temperature = true"])
def test_job_file_numbers_are_not_coerced(tmp_path, monkeypatch, line):
    no_model(monkeypatch)
    write_rows(tmp_path / "rows.jsonl", rows_of(2))
    (tmp_path / "job.toml").write_text(f'input = "rows.jsonl"\n{line}\n')
    result = invoke("run", tmp_path / "job.toml", "--quiet")
    assert result.exit_code == 2, result.output
    assert "job.toml" in result.output and line.split()[0] in result.output


def test_ls_notes_linked_and_damaged_folders_it_skips(tmp_path, monkeypatch):
    run(write_rows(tmp_path / "rows.jsonl", rows_of(2)), "--job-dir", tmp_path / "elsewhere")
    root = tmp_path / "jobs"
    root.mkdir()
    (root / "linked").symlink_to(tmp_path / "elsewhere")
    damaged_copy(tmp_path / "elsewhere", "negative", "report.json",
                 lambda r: r.update(rows_total=-5)).rename(root / "negative")
    no_model(monkeypatch)
    result = invoke("ls", root)
    assert result.exit_code == 0, result.output
    assert f"skipped {root / 'linked'}: a link" in result.stderr
    assert f"skipped {root / 'negative'}" in result.stderr and "rows_total" in result.stderr
    assert "-5" not in result.stdout.replace(str(tmp_path), "")  # pytest's folder: pytest-5


def test_a_dry_run_with_output_to_stdout_prints_its_findings_on_stdout(tmp_path):
    write_rows(tmp_path / "rows.jsonl", rows_of(2))
    code, out, err = cli_process("run", tmp_path / "rows.jsonl", "--dry-run", "-o", "-")
    assert code == 0, err
    assert out.decode().startswith("rows:          2")


def test_results_stdout_cannot_take_is_one_line_and_the_job_kept(tmp_path):
    """-o - into a full device (ENOSPC) or with stdout closed: one clear line, no traceback;
    the job's records stay in its folder."""
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"".join(orjson.dumps({"custom_id": f"r{i}", "prompt": f"Say {i}"}) + b"\n"
                              for i in range(3)))
    command = [sys.executable, "-m", "batchrun", "run", str(rows), "--job-dir",
               str(tmp_path / "j"), "-o", "-", "--quiet", "--max-tokens", "2"]
    with open("/dev/full", "wb") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, timeout=180)
    err = done.stderr.decode()
    assert done.returncode == 1 and "Traceback" not in err
    assert "could not write the results to stdout: No space left on device" in err
    assert len((tmp_path / "j" / "results.jsonl").read_bytes().splitlines()) == 3
    closed = subprocess.run(command + ["--restart"], stderr=subprocess.PIPE, timeout=180,
                            preexec_fn=lambda: os.close(1))
    err = closed.stderr.decode()
    assert closed.returncode == 2 and "Traceback" not in err
    assert "this process has none (it was closed)" in err


def test_a_dry_run_shows_the_first_prompt_as_the_model_sees_it(tmp_path):
    """The rendered prompt (the template filled, the chat template around it), and a warning
    for a shell's literal backslash-n in a template."""
    rows = write_rows(tmp_path / "rows.jsonl", [{"review": "the lid leaks"}])
    shown = run(rows, "--dry-run", "--prompt-template", "Review: {review}\nSentiment:").output
    assert "first prompt, as the model sees it:" in shown
    assert "  Review: the lid leaks\n  Sentiment:" in shown  # a real line break, indented
    literal = run(rows, "--dry-run", "--prompt-template", "Review: {review}\\nSentiment:")
    assert "backslash and an n" in literal.output and "$'" in literal.output
    assert "Review: the lid leaks\\nSentiment:" in literal.output
    refused = run(rows, "--dry-run", "--prompt-template", "Review: {text}", code=2)
    assert "'review'" in refused.output and "'text'" in refused.output
