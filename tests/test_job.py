"""The batch job end to end: input shapes, output formats, resume, refusal, lock, reports."""

import gzip
import math
import shutil
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.job.state import JobLock

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"
REPORT_FIELDS = {"rows_total", "rows_done", "rows_failed", "prompt_tokens",
                 "cached_prompt_tokens", "completion_tokens", "wall_s", "prefill_tokens_per_s",
                 "decode_tokens_per_s", "completion_tokens_per_s", "requests_per_s",
                 "peak_memory_bytes", "max_concurrency", "mean_batch_size", "ttft_p50_s",
                 "ttft_p95_s", "model", "device", "batchrun_version", "runs"}


def jsonl(path):
    return [orjson.loads(x) for x in Path(path).read_bytes().splitlines() if x.strip()]


def invoke(*args, code=0):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result


def run(*args, code=0):
    return invoke("run", *args, "--quiet", code=code)


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(
        orjson.dumps({"custom_id": f"r{i}", "prompt": f"Review number {i}: it is sturdy.",
                      "max_tokens": 4 + i % 5}).decode() + "\n" for i in range(30)))
    return path


def test_report_json_and_html(rows_file, tmp_path):
    job = tmp_path / "job"
    run(rows_file, "--job-dir", job)
    report = orjson.loads((job / "report.json").read_bytes())
    assert set(report) >= REPORT_FIELDS
    assert (report["rows_total"], report["rows_done"], report["rows_failed"]) == (30, 30, 0)
    results = jsonl(job / "results.jsonl")
    assert report["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in results)
    assert len(report["runs"]) == 1 and report["runs"][0]["status"] == "completed"
    assert REPORT_FIELDS - {"runs", "model", "device", "batchrun_version", "rows_total"} \
        <= set(report["runs"][0])
    page = (job / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "http" not in page
    manifest = orjson.loads((job / "job.json").read_bytes())
    assert manifest["input"]["sha256"] and manifest["model"]["fingerprint"]


def test_rerun_resumes_and_a_finished_job_is_not_recomputed(rows_file, tmp_path):
    job = tmp_path / "job"
    run(rows_file, "--job-dir", job)
    first = (job / "results.jsonl").read_bytes()
    result = run(rows_file, "--job-dir", job)
    assert (job / "results.jsonl").read_bytes() == first
    assert "already complete: 30 rows done, 0 failed" in result.output
    report = orjson.loads((job / "report.json").read_bytes())
    assert len(report["runs"]) == 1  # nothing ran: no model loaded, no run added
    lines = first.splitlines(keepends=True)
    (job / "results.jsonl").write_bytes(b"".join(lines[:10]))  # as if stopped after 10 rows
    result = run(rows_file, "--job-dir", job)
    assert "resuming: 10 of 30 rows done (0 failed), 20 to go" in result.output
    assert (job / "results.jsonl").read_bytes() == first


def test_changed_input_or_options_are_refused_unless_restart(rows_file, tmp_path):
    job = tmp_path / "job"
    run(rows_file, "--job-dir", job)
    refused = run(rows_file, "--job-dir", job, "--max-tokens", "9", code=2)
    assert "different job" in refused.output and "max_tokens" in refused.output
    # the flag that runs it in place is named, with what it costs (the folder's progress)
    assert "pass --restart (the folder's progress is discarded)" in refused.output
    assert "another --job-dir" in refused.output
    assert "model:" not in refused.output  # refused before the model loads
    with open(rows_file, "a") as f:
        f.write('{"prompt": "one more"}\n')
    refused = run(rows_file, "--job-dir", job, code=2)
    assert "the input changed" in refused.output
    run(rows_file, "--job-dir", job, "--restart")
    assert len(jsonl(job / "results.jsonl")) == 31


def test_a_running_job_folder_is_refused(rows_file, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    lock = JobLock(job)
    assert lock.acquire()
    try:
        refused = run(rows_file, "--job-dir", job, code=1)
        assert "in use by another batchrun process" in refused.output
        status = invoke("status", job, code=1)  # no job.json yet: not a job folder
        assert "not a batchrun job folder" in status.output
    finally:
        lock.release()
    run(rows_file, "--job-dir", job)  # a released (or dead process's) lock is taken over


def test_status_after_a_run(rows_file, tmp_path):
    job = tmp_path / "job"
    run(rows_file, "--job-dir", job)
    out = invoke("status", job).output
    assert "not running" in out and "30 done, 0 failed, 0 pending of 30" in out
    out = invoke("report", job).output
    assert "30 done" in out and (job / "report.html").exists()


def test_gzip_input(rows_file, tmp_path):
    gz = tmp_path / "rows.jsonl.gz"
    gz.write_bytes(gzip.compress(rows_file.read_bytes()))
    run(gz, "--job-dir", tmp_path / "gz")
    run(rows_file, "--job-dir", tmp_path / "plain")
    assert jsonl(tmp_path / "gz" / "results.jsonl") == jsonl(tmp_path / "plain" /
                                                              "results.jsonl")


def test_identical_rows_are_computed_once_but_each_gets_its_result(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(orjson.dumps({"id": f"d{i}", "prompt": "same prompt"}).decode()
                            + "\n" for i in range(6)) + '{"id": "other", "prompt": "another"}\n')
    result = run(path, "--job-dir", tmp_path / "job", "--max-tokens", "6")
    results = jsonl(tmp_path / "job" / "results.jsonl")
    assert [r["custom_id"] for r in results] == [f"d{i}" for i in range(6)] + ["other"]
    assert len({r["text"] for r in results[:6]}) == 1
    assert "5 reused" in result.output


def test_requests_are_identical_only_when_every_sampling_field_is():
    import dataclasses

    from batchrun.engine.types import SamplingParams
    from batchrun.job.runner import _payload_key

    base = SamplingParams(max_tokens=8)
    assert _payload_key(b"p", base) == _payload_key(b"p", SamplingParams(max_tokens=8))
    assert _payload_key(b"p", base) != _payload_key(b"q", base)
    changed = {"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
               "seed": 3, "stop": ("x",), "stop_token_ids": (7,), "logprobs": True,
               "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
               "repetition_penalty": 1.1, "logit_bias": ((5, 1.0),), "min_tokens": 2,
               "max_thinking_tokens": 4, "thinking": False}
    for field in dataclasses.fields(SamplingParams):
        assert field.repr, field.name  # the key is the repr: every field in it
        if field.name in changed:
            other = dataclasses.replace(base, **{field.name: changed[field.name]})
            assert _payload_key(b"p", other) != _payload_key(b"p", base), field.name


def test_a_prompt_digest_covers_every_token_and_image():
    """The digest is hashed in pieces (to keep the GIL): no token may fall between them."""
    import hashlib

    import numpy as np

    from batchrun.job.runner import _prompt_digest

    prompt = list(range(1, 1001))  # 8,000 bytes: several pieces
    whole = hashlib.blake2b(np.asarray(prompt, dtype="<i8").tobytes(), digest_size=16)
    assert _prompt_digest(prompt) == whole.digest()  # the pieces hash as the whole
    digests = {_prompt_digest(prompt)}
    for i in range(len(prompt)):
        digests.add(_prompt_digest(prompt[:i] + [0] + prompt[i + 1:]))
    assert len(digests) == len(prompt) + 1
    images = tuple(f"{i:064x}" for i in range(40))  # 2,600 characters: more than one piece
    assert len({_prompt_digest(prompt, images), _prompt_digest(prompt, images[:-1] + ("0",)),
                _prompt_digest(prompt)}) == 3


def test_parquet_round_trip_keeps_columns_and_types(tmp_path):
    out = tmp_path / "labels.parquet"
    run(SAMPLE / "reviews.parquet", "--job-dir", tmp_path / "job", "-o", out,
        "--prompt-template", "Sentiment of: {review}", "--id-column", "id", "--max-tokens", "3")
    source = pq.read_table(SAMPLE / "reviews.parquet")
    table = pq.read_table(out)
    assert table.num_rows == source.num_rows
    for field in source.schema:  # every input column, same type, same values
        assert table.schema.field(field.name).type == field.type
        assert table.column(field.name).equals(source.column(field.name))
    assert table.schema.field("rating").type == pa.int8()
    assert table.schema.field("tags").type == pa.list_(pa.string())
    for name, type_ in [("text", pa.string()), ("finish_reason", pa.string()),
                        ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                        ("cached_tokens", pa.int64()), ("error", pa.string())]:
        assert table.schema.field(name).type == type_
    assert table.column("error").null_count == table.num_rows
    assert all(0 < n <= 3 for n in table.column("completion_tokens").to_pylist())
    results = jsonl(tmp_path / "job" / "results.jsonl")  # the durable progress beside it
    assert [r["custom_id"] for r in results] == source.column("id").to_pylist()
    assert table.column("text").to_pylist() == [r["text"] for r in results]


def test_parquet_output_marks_failed_rows(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "fine", "n": 1}\n{"prompt": "", "n": 2}\n'
                    '{"prompt": "also fine", "n": 3}\n')
    out = tmp_path / "out.parquet"
    run(path, "--job-dir", tmp_path / "job", "-o", out, "--max-tokens", "2")
    table = pq.read_table(out).to_pylist()
    assert [r["n"] for r in table] == [1, 2, 3]
    assert table[0]["error"] is None and table[2]["error"] is None
    assert "prompt is empty" in table[1]["error"] and table[1]["text"] is None


def test_openai_batch_input_gives_openai_batch_output(tmp_path):
    path = tmp_path / "batch.jsonl"
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "my-model", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 5}},
        {"custom_id": "comp-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "my-model", "prompt": "Once upon", "max_completion_tokens": 4}},
        {"custom_id": "bad-1", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": "x"}},
    ]
    path.write_text("".join(orjson.dumps(x).decode() + "\n" for x in lines))
    run(path, "--job-dir", tmp_path / "job")
    chat, comp = jsonl(tmp_path / "job" / "results.jsonl")
    for line, cid in ((chat, "chat-1"), (comp, "comp-1")):
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert line["custom_id"] == cid and line["error"] is None
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        body = response["body"]
        # The model that answered; the one the row asked for is counted in the report.
        assert body["model"] == "demo" and isinstance(body["created"], int)
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        assert len(body["choices"]) == 1 and body["choices"][0]["index"] == 0
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["id"].startswith("chatcmpl-")
    message = chat["response"]["body"]["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert chat["response"]["body"]["usage"]["completion_tokens"] <= 5
    assert comp["response"]["body"]["object"] == "text_completion"
    assert isinstance(comp["response"]["body"]["choices"][0]["text"], str)
    assert comp["response"]["body"]["usage"]["completion_tokens"] <= 4
    (error,) = jsonl(tmp_path / "job" / "errors.jsonl")
    # exactly a line of OpenAI's batch error file: BatchError's fields, the line inside
    assert set(error) == {"id", "custom_id", "response", "error"}
    assert error["id"].startswith("batch_req_") and error["response"] is None
    assert error["custom_id"] == "bad-1" and error["error"]["code"] == "unsupported_url"
    assert set(error["error"]) == {"code", "message", "param", "line"}
    assert error["error"]["line"] == 3 and error["error"]["param"] is None


def test_job_file_in_jobs_folder_labels_the_sample_reviews(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    shutil.copy(ROOT / "jobs" / "label_reviews.toml", jobs)
    (tmp_path / "sample_data").mkdir()
    shutil.copy(SAMPLE / "reviews.parquet", tmp_path / "sample_data")
    result = invoke("run", jobs / "label_reviews.toml", "--quiet", "--max-tokens", "2")
    labels = pq.read_table(jobs / "label_reviews" / "labels.parquet")
    assert labels.num_rows == 200 and "review" in labels.schema.names
    assert max(labels.column("completion_tokens").to_pylist()) <= 2  # the flag beat the file
    manifest = orjson.loads((jobs / "label_reviews" / "job.json").read_bytes())
    assert manifest["options"]["prompt_template"].startswith("Review of a {product}")
    assert "200 done" in result.output


def test_a_commit_fsyncs_only_the_files_that_grew(tmp_path, monkeypatch):
    """An fsync can take a quarter of a second on a network disk: a commit with no errors and
    an empty spill syncs the results file alone (and state.json's atomic write)."""
    import os

    from batchrun.job.sink import OrderedSink
    from batchrun.job.state import Progress

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(
        f"/proc/self/fd/{fd}")), real(fd)))
    sink = OrderedSink(tmp_path / "r.jsonl", tmp_path / "e.jsonl", tmp_path / "s.jsonl",
                       Progress())
    sink.sync()  # the first sync: every file
    assert len(synced) == 3
    synced.clear()
    sink.put(0, b'{"a": 1}\n', is_error=False)
    sink.sync()
    assert [os.path.basename(p) for p in synced] == ["r.jsonl"]
    synced.clear()
    sink.put(2, b'{"a": 3}\n', is_error=True)  # out of order: spilled
    sink.sync()
    assert [os.path.basename(p) for p in synced] == ["s.jsonl"]
    synced.clear()
    sink.sync()
    assert synced == []  # nothing new
    sink.close()


def test_a_gpu_jobs_warm_up_changes_no_result_or_report_figure(rows_file, tmp_path, monkeypatch):
    """On a GPU the job runs two short rows through the engine before its own (here forced
    on the CPU): the same records, and the report counts only the job's rows."""
    from batchrun.engine.engine import Engine

    run(rows_file, "--job-dir", tmp_path / "plain", "--cache-dir", tmp_path / "c1")
    warmed = []
    real = Engine.warm_up
    monkeypatch.setattr(Engine, "warm_up",
                        lambda self, cpu_too=False: (warmed.append(1), real(self, cpu_too=True)))
    run(rows_file, "--job-dir", tmp_path / "warm", "--cache-dir", tmp_path / "c2")
    assert warmed == [1]
    plain, warm = (jsonl(tmp_path / j / "results.jsonl") for j in ("plain", "warm"))
    assert [(r["custom_id"], r["text"], r["usage"]) for r in warm] == \
        [(r["custom_id"], r["text"], r["usage"]) for r in plain]
    a, b = (orjson.loads((tmp_path / j / "report.json").read_bytes()) for j in ("plain", "warm"))
    fields = ("rows_done", "rows_failed", "prompt_tokens", "cached_prompt_tokens",
              "completion_tokens")
    assert [b[f] for f in fields] == [a[f] for f in fields]


def test_the_bars_figures_say_what_they_count():
    """`batch 1` beside 250 rows still to run read as a stall: each figure is named, and
    rows queued for the batch are counted apart from those in it."""
    from types import SimpleNamespace

    from batchrun.job.runner import JobRunner

    runner = SimpleNamespace(engine=SimpleNamespace(generated_tokens=3000, num_running=1,
                                                    num_waiting=250))
    text = JobRunner._rates(runner, 2.0, SimpleNamespace(held=4))
    assert text == "1,500 tok/s, 1 in batch, 250 queued, 4 done ahead"
    runner.engine.num_waiting = 0
    assert JobRunner._rates(runner, 2.0, SimpleNamespace(held=0)) == "1,500 tok/s, 1 in batch"


def test_the_report_command_prints_what_status_prints_of_the_records(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [
        {"prompt": "Review: great", "expected": "good"}, {"prompt": "Review: awful"},
        {"prompt": ""}]))
    job = tmp_path / "job"
    run(rows, "--job-dir", job, "--choices", "good,bad", "--expected-column", "expected",
        code=0)
    status, report = invoke("status", job).output, invoke("report", job).output
    for line in ("labels:", "accuracy:", "row errors:"):
        assert line in status and line in report, line


def test_an_answer_prefix_begins_every_chat_answer_and_results_hold_the_rest(tmp_path, demo):
    """--answer-prefix "Sentiment:" (or a row's own final assistant message with
    continue_final_message): the template renders it as the start of the assistant's turn,
    the model goes on from it, and the result holds only what follows."""
    from batchrun.engine.engine import Engine
    from batchrun.engine.types import SamplingParams

    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [
        {"review": "It broke after three days."}, {"review": "Lovely, works great."}]))
    job = tmp_path / "job"
    run(rows, "--job-dir", job, "--prompt-template", "Review: {review}",
        "--answer-prefix", "Sentiment:", "--max-tokens", "4")
    engine = Engine(demo.model, demo.tokenizer)
    for record, review in zip(jsonl(job / "results.jsonl"), ("It broke after three days.",
                                                              "Lovely, works great."),
                              strict=True):
        messages = [{"role": "user", "content": f"Review: {review}"},
                    {"role": "assistant", "content": "Sentiment:"}]
        ids = engine.prompts.encode_chat(messages, continue_final_message=True)
        text = engine.prompts.tokenizer.decode(ids)
        assert text.endswith("Sentiment:")  # inside the assistant's turn, not after it
        want = engine.generate([ids], SamplingParams(max_tokens=4))[0]
        assert record["text"] == want.text and record["usage"]["prompt_tokens"] == len(ids)
        assert not record["text"].startswith("Sentiment:")
    # a row's own begun answer does the same; without an assistant message to continue, the
    # row's error
    own = tmp_path / "own.jsonl"
    own.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [
        {"messages": [{"role": "user", "content": "Review: It broke after three days."},
                      {"role": "assistant", "content": "Sentiment:"}],
         "continue_final_message": True, "max_tokens": 4},
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}]))
    run(own, "--job-dir", tmp_path / "own")
    (result,) = jsonl(tmp_path / "own" / "results.jsonl")
    assert result["text"] == jsonl(job / "results.jsonl")[0]["text"]
    (error,) = jsonl(tmp_path / "own" / "errors.jsonl")
    assert error["index"] == 1 and "continue_final_message" in error["error"]["message"]
    # another prefix is another job
    refused = run(rows, "--job-dir", job, "--prompt-template", "Review: {review}",
                  "--answer-prefix", "Label:", "--max-tokens", "4", code=2)
    assert "--answer-prefix" in refused.output


def test_choices_are_scored_after_the_answer_prefix(tmp_path, demo):
    from helpers import choice_logprob

    from batchrun.engine.engine import Engine

    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(orjson.dumps({"review": "It broke after three days."}) + b"\n")
    job = tmp_path / "job"
    run(rows, "--job-dir", job, "--prompt-template", "Review: {review}",
        "--answer-prefix", "Sentiment:", "--choices", "positive,negative")
    (record,) = jsonl(job / "results.jsonl")
    engine = Engine(demo.model, demo.tokenizer)
    prompt = engine.prompts.render([{"role": "user", "content": "Review: It broke after three "
                                     "days."}, {"role": "assistant", "content": "Sentiment:"}],
                                   continue_final_message=True)
    logprobs = {c: choice_logprob(demo, prompt, c) for c in ("positive", "negative")}
    total = sum(math.exp(v) for v in logprobs.values())
    for choice, logprob in logprobs.items():
        assert record["choice_probs"][choice] == pytest.approx(math.exp(logprob) / total,
                                                               abs=1e-4)
