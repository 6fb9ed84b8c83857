"""Dirty input and fatal problems: every row accounted for once, clear errors, no tracebacks."""

import errno
import threading
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchrun import models
from batchrun.cli import cli
from batchrun.engine.backends.prompt import PromptBuilder
from batchrun.io.jsonl import is_gzip_header, read_jsonl
from batchrun.job.rows import RowError, RowOptions, Task, build_task
from batchrun.job.sink import OrderedSink

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def jsonl(path):
    return [orjson.loads(x) for x in Path(path).read_bytes().splitlines() if x.strip()]


def test_every_kind_of_bad_row_gets_one_error_naming_line_and_field(tmp_path):
    long_prompt = "word " * 9000  # past the demo model's 8,192-token context
    lines = [
        '{"prompt": "fine", "custom_id": "a"}',
        '{"prompt": "broken',
        "null",
        "[1, 2]",
        '"just a string"',
        '{"no_prompt_here": 1}',
        '{"prompt": 42}',
        '{"prompt": ""}',
        orjson.dumps({"prompt": long_prompt}).decode(),
        '{"messages": [{"role": "wizard", "content": "hi"}]}',
        '{"prompt": "x", "max_tokens": -1}',
        '{"prompt": "x", "temperature": -0.5}',
        '{"prompt": "x", "top_p": 1.5}',
        '{"prompt": "dup", "custom_id": "a"}',
        '{"custom_id": "o1", "url": "/v1/embeddings", "body": {"input": "x"}}',
        "",
        "   ",
        '{"prompt": "fine too", "custom_id": "b"}',
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"prompt": "\xff\xfe"}\n'
    path = tmp_path / "dirty.jsonl"
    path.write_bytes(raw)
    result = invoke("run", path, "--job-dir", tmp_path / "job", "--max-tokens", "3", "--quiet")
    assert result.exit_code == 0, result.output
    results = jsonl(tmp_path / "job" / "results.jsonl")
    errors = jsonl(tmp_path / "job" / "errors.jsonl")
    assert [r["custom_id"] for r in results] == ["a", "b"]
    # an OpenAI line's error has OpenAI's shape: its line inside `error`
    by_line = {e.get("line", e["error"].get("line")): e["error"] for e in errors}
    expect = {2: "not valid JSON", 3: "null", 4: "a list", 5: "a string", 6: "prompt",
              7: "prompt must be a string", 8: "prompt is empty", 9: "context",
              10: "role", 11: "max_tokens", 12: "temperature", 13: "top_p",
              14: "already used by the row on line 1", 15: "url must be one of",
              19: "UTF-8"}
    assert set(by_line) == set(expect)
    for line, fragment in expect.items():
        assert fragment in by_line[line]["message"], (line, by_line[line])
    assert by_line[14]["code"] == "duplicate_custom_id"
    # Every non-blank line is accounted for exactly once (the OpenAI line's error by its line).
    from batchrun.io.readers import read_rows
    from batchrun.job.recovery import ordered_records

    merged = list(ordered_records(tmp_path / "job" / "results.jsonl",
                                  tmp_path / "job" / "errors.jsonl", read_rows(path)))
    assert len(merged) == 17 == len(results) + len(errors)
    assert [r.get("custom_id") for r in merged][14] == "o1"


def test_rows_without_a_prompt_are_refused_before_the_model_loads(tmp_path):
    """No row has a prompt or messages and no template builds one: every row would fail, so
    the job is refused before the model loads (exit 2), naming the flag and the columns; a
    larger JSONL file whose first rows lack one still runs, each such row its own error."""
    path = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    result = invoke("run", path, "--job-dir", tmp_path / "job", "--model",
                    tmp_path / "no-such-model", "--quiet")
    assert result.exit_code == 2, result.output
    assert "--prompt-template" in result.output and "'text'" in result.output
    assert not (tmp_path / "job" / "job.json").exists()
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join('{"text": "a"}\n' for _ in range(101)) + '{"prompt": "hi"}\n')
    result = invoke("run", rows, "--job-dir", tmp_path / "mixed", "--quiet",
                    "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    errors = jsonl(tmp_path / "mixed" / "errors.jsonl")
    assert len(errors) == 101
    assert all("--prompt-template" in e["error"]["message"] for e in errors)


def test_fatal_problems_exit_1_with_a_hint_and_no_traceback(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = [
        (["run", rows, "--model", tmp_path / "nope", "--job-dir", tmp_path / "j2"],
         "model folder not found"),
        (["run", rows, "--model", not_a_model, "--job-dir", tmp_path / "j3"],
         "not an mlx-lm model folder"),
        (["run", rows, "--model", blocker, "--job-dir", tmp_path / "j4"],
         "a-file is a file, not a model folder"),
        (["run", rows, "--draft-model", blocker, "--job-dir", tmp_path / "j5"],
         "a-file is a file, not a model folder"),
    ]
    for args, message in cases:
        result = invoke(*args, "--quiet")
        assert result.exit_code == 1, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output


def test_an_empty_input_is_exit_0_with_an_empty_output_and_a_warning(tmp_path):
    """As vLLM's run-batch does: nothing to run is no failure."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    for out in (tmp_path / "out.jsonl", tmp_path / "out.parquet"):
        result = invoke("run", empty, "--job-dir", tmp_path / f"job-{out.suffix[1:]}", "-o", out,
                        "--quiet")
        assert result.exit_code == 0, result.output
        assert "warning: " in result.output and "has no rows: nothing to run" in result.output
        assert out.is_file()
    assert (tmp_path / "out.jsonl").read_bytes() == b""
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 0
    dry = invoke("run", empty, "--dry-run")
    assert dry.exit_code == 0 and "has no rows: nothing to run" in dry.output


@pytest.mark.parametrize("url", ["https://example.com/out.jsonl", "s3://bucket/out.parquet"])
def test_an_output_url_is_a_usage_error_not_a_local_folder(tmp_path, url, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    monkeypatch.chdir(tmp_path)
    result = invoke("run", rows, "--job-dir", tmp_path / "job", "-o", url, "--quiet")
    assert result.exit_code == 2 and "not URLs" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


def test_a_model_that_is_not_there_gets_how_to_get_one_and_the_models_there_are(
        tmp_path, monkeypatch):
    import shutil

    from batchrun.models import DEMO_MODEL

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    (tmp_path / "models").mkdir()
    shutil.copytree(DEMO_MODEL, tmp_path / "models" / "mine")
    (tmp_path / "models" / "notes").mkdir()  # no model in it
    (tmp_path / "hub" / "models--org--small-model").mkdir(parents=True)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    result = invoke("run", rows, "--model", "./qwen", "--job-dir", tmp_path / "j", "--quiet")
    assert result.exit_code == 1 and "model folder not found: ./qwen" in result.output
    hint = result.output.splitlines()[1]
    assert "huggingface-cli download" in hint and "mlx_lm.convert" in hint
    assert hint.endswith("models here: models/mine, org/small-model")


def test_a_missing_input_or_job_file_is_a_usage_error(tmp_path):
    for name, message in (("missing.jsonl", "input file not found"),
                          ("missing.toml", "job file not found")):
        result = invoke("run", tmp_path / name, "--quiet")
        assert result.exit_code == 2, (name, result.output)
        assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "jobs").exists()


def test_an_empty_model_or_draft_model_is_a_usage_error_not_the_demo(tmp_path):
    """`--model "$MODEL"` with MODEL unset would have run the demo model in its place."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    for flag in ("--model", "--draft-model"):
        result = invoke("run", rows, flag, " ", "--job-dir", tmp_path / "job", "--quiet")
        assert result.exit_code == 2, (flag, result.output)
        assert f"{flag} is empty" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "job").exists()


def test_a_model_id_the_hub_cannot_serve_is_one_line_without_retries(tmp_path, monkeypatch,
                                                                       caplog):
    """A Hugging Face id missing from the local cache, the Hub out of reach (offline mode, its
    name not resolving) or without that model: one line naming the model and why. The
    unreachable Hub is found before any request: a download retried for ~25 s first, printing
    a line a retry."""
    import http.server
    import socket

    from huggingface_hub import constants

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    hub_host = "huggingface.test"

    def hub_at(endpoint: str) -> None:  # as HF_ENDPOINT would set them at import
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")

    hub_at(f"https://{hub_host}")
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)  # behind a proxy, the name is its to resolve
    resolve = socket.getaddrinfo

    resolved = []

    def no_hub(host, *args, **kw):  # no packet leaves for the Hub's name
        if host == hub_host:
            resolved.append(host)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return resolve(host, *args, **kw)

    def run_with(flag: str, job: str):
        result = invoke("run", rows, flag, "nobody/no-such-model", "--job-dir", tmp_path / job,
                        "--quiet")
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        return result.output.strip().splitlines()[0]

    caplog.set_level("WARNING")
    monkeypatch.setattr(socket, "getaddrinfo", no_hub)
    for flag in ("--model", "--draft-model"):
        monkeypatch.setattr(models, "_hub_resolved", {})
        resolved.clear()
        line = run_with(flag, "j1")
        assert "nobody/no-such-model is neither a local folder nor in the local Hugging Face " \
               "cache, and the Hugging Face Hub cannot be reached (huggingface.test does not " \
               "resolve: Name or service not known)" in line, line
        assert resolved == [hub_host]  # once a run: its sampling defaults, then its model
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "(HF_HUB_OFFLINE is set)" in run_with("--model", "j2")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    asked = []

    class NoModels(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoModels)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        hub_at(f"http://127.0.0.1:{httpd.server_port}")
        line = run_with("--model", "j3")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert line.startswith("Error: nobody/no-such-model could not be fetched from the Hugging "
                           "Face Hub: "), line
    # the model's files only, and huggingface_hub's agent registry (fetched with its first
    # request's headers, a download's)
    assert asked and all("nobody/no-such-model" in path for path in asked
                         if path != "/api/agent-harnesses")
    assert "Retrying" not in caplog.text  # no download waited to try again


def test_disk_full_stops_cleanly_and_the_rerun_completes(tmp_path, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(orjson.dumps({"prompt": f"row {i} " * (1 + i % 4),
                                          "custom_id": f"r{i}"}).decode() + "\n"
                            for i in range(40)))
    job = tmp_path / "job"
    real_fsync = OrderedSink.fsync
    calls = {"n": 0}

    def full_disk(self, pending):
        """The first commit works, the next meet a full disk; so does a first one that holds
        every row (a busy machine may finish them all before the first commit)."""
        calls["n"] += 1
        if calls["n"] >= 2 or pending.progress.rows_done + pending.progress.rows_failed >= 40:
            raise OSError(errno.ENOSPC, "No space left on device", str(job / "results.jsonl"))
        return real_fsync(self, pending)

    monkeypatch.setattr("batchrun.job.runner.COMMIT_INTERVAL_S", 0.0)
    monkeypatch.setattr(OrderedSink, "fsync", full_disk)
    result = invoke("run", rows, "--job-dir", job, "--max-tokens", "4", "--quiet")
    assert result.exit_code == 1
    assert "No space left on device" in result.output and "resume with" in result.output
    assert "Traceback" not in result.output
    monkeypatch.setattr(OrderedSink, "fsync", real_fsync)
    result = invoke("run", rows, "--job-dir", job, "--max-tokens", "4", "--quiet")
    assert result.exit_code == 0, result.output
    results = jsonl(job / "results.jsonl")
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(40)]


def test_a_slow_disk_does_not_stall_the_engine(tmp_path, monkeypatch):
    """A commit's fsyncs run beside the engine: rows go on finishing while one is in flight."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(orjson.dumps({"prompt": f"row {i} " * (1 + i % 4),
                                          "custom_id": f"r{i}"}).decode() + "\n"
                            for i in range(48)))
    job = tmp_path / "job"
    real_fsync, real_put = OrderedSink.fsync, OrderedSink.put
    seen = {"puts": 0, "during_commit": 0, "blocked": False}
    all_finished = threading.Event()

    def put(self, *args, **kwargs):
        real_put(self, *args, **kwargs)
        seen["puts"] += 1
        seen["during_commit"] += seen["blocked"]
        if seen["puts"] == 48:
            all_finished.set()

    def slow_fsync(self, pending):  # the first mid-run commit lasts until every row finished
        if not seen["blocked"] and seen["puts"] < 48:
            seen["blocked"] = True
            all_finished.wait(timeout=60)
            seen["blocked"] = False
        return real_fsync(self, pending)

    monkeypatch.setattr("batchrun.job.runner.COMMIT_INTERVAL_S", 0.0)
    # and no interval from the disk's measured write cost (a busy machine's made the first
    # commit wait past the job's end: this test failed once under load)
    monkeypatch.setattr("batchrun.job.runner.COMMIT_SHARE", float("inf"))
    monkeypatch.setattr(OrderedSink, "fsync", slow_fsync)
    monkeypatch.setattr(OrderedSink, "put", put)
    result = invoke("run", rows, "--job-dir", job, "--max-tokens", "4", "--max-concurrency", "4",
                    "--quiet")
    assert result.exit_code == 0, result.output
    assert all_finished.is_set() and seen["during_commit"] > 0
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == [f"r{i}" for i in range(48)]
    state = orjson.loads((job / "state.json").read_bytes())
    assert state["next_index"] == 48 and state["spill_bytes"] == 0


# -- property tests of the readers ------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=60), max_size=30))
def test_jsonl_reader_accounts_for_every_non_blank_line_whatever_the_bytes(tmp_path_factory,
                                                                         chunks):
    data = b"\n".join(c.replace(b"\n", b" ").replace(b"\r", b" ") for c in chunks)
    assume(not is_gzip_header(data[:10]))  # a file whose bytes are gzip is read as gzip
    path = tmp_path_factory.mktemp("h") / "in.jsonl"
    path.write_bytes(data)
    rows = list(read_jsonl(path))
    non_blank = [i + 1 for i, line in enumerate(data.split(b"\n")) if line.strip()]
    assert [r.line for r in rows] == non_blank
    assert [r.index for r in rows] == list(range(len(non_blank)))
    assert all((r.error is None) != (r.value is None and r.error is not None) or
               r.error is None for r in rows)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["prompt", "messages", "role", "content", "max_tokens",
                                       "temperature", "top_p", "seed", "stop", "custom_id",
                                       "url", "body", "tools", "logprobs", "top_k"]) | st.text(),
                      children, max_size=5),
    max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(json_values)
def test_any_json_value_becomes_a_task_or_a_row_error_never_an_exception(demo, value):
    out = build_task(value, 0, 1, PromptBuilder(demo.tokenizer), RowOptions())
    assert isinstance(out, Task | RowError)
    if isinstance(out, RowError):
        assert out.message and out.line == 1
