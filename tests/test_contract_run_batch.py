"""vLLM's `run-batch` contract, ported: the cases of vLLM's tests/entrypoints/openai/
test_run_batch.py (and its example batch file) as batchrun behaviours, checked with
openai-python's types.

Where batchrun differs by design, its documented behaviour is asserted instead (docs/inputs.md,
docs/outputs.md, docs/reasoning-and-tools.md, docs/resume.md's exit codes): a failed row goes to
the job folder's errors.jsonl in OpenAI's error-file shape, not to the output file; a malformed
line is that row's error, not the whole batch's; a URL batchrun does not serve (embeddings,
score, rerank, audio) is that row's `unsupported_url` error; a job whose every row failed exits 1.
The demo model has random weights: every job is a few rows of a few tokens."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion

from batchrun.models import RANDOM_DEMO_MODEL
from tests.helpers import jsonl, run

SERVED = "tiny-chat"  # the name the batch asks for, served with --served-model-name
CHAT = "/v1/chat/completions"
KEYS = {"id", "custom_id", "response", "error"}  # an OpenAI batch output or error-file line


def batch(path: Path, lines: list[dict]) -> Path:
    """A batch file as vLLM's tests write one: JSON lines joined by newlines, none at the end."""
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


def chat_line(custom_id, system="You are a helpful assistant.", model=SERVED, url=CHAT,
              **body):
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": "Hello world!"}],
                     **body}}


def other_line(custom_id, url, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def check_result(line: dict, custom_id: str) -> ChatCompletion | Completion:
    """One line of the output: OpenAI's batch output shape, the body a strict openai type."""
    assert set(line) == KEYS and line["custom_id"] == custom_id and line["error"] is None
    assert line["id"].startswith("batch_req_")
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"}
    assert response["status_code"] == 200 and isinstance(response["request_id"], str)
    body = response["body"]
    kind = ChatCompletion if body["object"] == "chat.completion" else Completion
    parsed = kind.model_validate(body, strict=True)
    assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + \
        parsed.usage.completion_tokens
    return parsed


def check_errors(job: Path, expected: list[tuple]) -> list[BatchError]:
    """errors.jsonl: OpenAI's error-file lines exactly, one a failed row, as
    (custom_id, code, line) in input order."""
    lines = jsonl(job / "errors.jsonl")
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in lines] == expected
    errors = []
    for e in lines:
        assert set(e) == KEYS and e["response"] is None and e["id"].startswith("batch_req_")
        assert set(e["error"]) == {"code", "message", "param", "line"}
        errors.append(BatchError.model_validate(e["error"], strict=True))
    return errors


def test_empty_file(tmp_path):
    """Ports vLLM's test_empty_file: an empty input exits 0 and leaves an empty output file."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out.jsonl"
    result = run(empty, "--job-dir", tmp_path / "job", "-o", out)
    assert out.read_bytes() == b""
    assert "has no rows: nothing to run" in result.output


def test_completions(tmp_path):
    """Ports vLLM's test_completions (INPUT_BATCH): exit 0, every line OpenAI-shaped; batchrun
    writes the two answers to -o and the three failed rows to the job's errors.jsonl."""
    rows = batch(tmp_path / "batch.jsonl", [
        chat_line("request-1", max_tokens=4),
        chat_line("request-2", "You are an unhelpful assistant.", max_tokens=4),
        chat_line("request-3", "You are an unhelpful assistant.", model="NonExistModel",
                  max_tokens=4),
        chat_line("request-4", "You are an unhelpful assistant.", url="/bad_url", max_tokens=4),
        chat_line("request-5", "You are an unhelpful assistant.", stream="True", max_tokens=4),
    ])
    out, job = tmp_path / "out.jsonl", tmp_path / "job"
    # vLLM serves the model under one name and refuses others; batchrun does with this flag
    # (without it, any body.model is accepted: docs/reasoning-and-tools.md).
    run(rows, "--job-dir", job, "-o", out, "--served-model-name", SERVED)
    results = jsonl(out)
    assert [r["custom_id"] for r in results] == ["request-1", "request-2"]
    for line in results:
        body = check_result(line, line["custom_id"])
        assert isinstance(body, ChatCompletion) and body.model == SERVED
        assert body.choices[0].message.role == "assistant"
        assert body.usage.completion_tokens <= 4
    errors = check_errors(job, [("request-3", "model_not_found", 3),
                                ("request-4", "unsupported_url", 4),
                                ("request-5", "unsupported_field", 5)])
    assert "NonExistModel" in errors[0].message and "/bad_url" in errors[1].message
    assert "stream" in errors[2].message


def test_completions_invalid_input(tmp_path):
    """Ports vLLM's test_completions_invalid_input: vLLM rejects the batch (non-zero exit);
    batchrun by design makes the line without custom_id (and a non-JSON line) that row's error
    and answers the rest; --fail-on-row-errors gives the non-zero exit (3)."""
    rows = tmp_path / "batch.jsonl"
    bad = chat_line("request-1", max_tokens=4)
    bad["invalid_field"] = bad.pop("custom_id")
    rows.write_text("\n".join([json.dumps(bad),
                               json.dumps(chat_line("request-2", "You are an unhelpful "
                                                    "assistant.", max_tokens=4)),
                               '{"custom_id": "request-3", "method": "POST", "url": ']))
    job = tmp_path / "job"
    run(rows, "--job-dir", job, "--fail-on-row-errors", code=3)
    (result,) = jsonl(job / "results.jsonl")
    check_result(result, "request-2")
    # a row without a custom_id is known by its 0-based index (docs/inputs.md, row ids)
    check_errors(job, [("0", "missing_custom_id", 1), ("2", "invalid_json", 3)])


def test_embeddings(tmp_path):
    """Ports vLLM's test_embeddings: batchrun serves no /v1/embeddings, so each row is its own
    unsupported_url error line; with every row failed the job exits 1 (documented)."""
    model = "intfloat/multilingual-e5-small"
    rows = batch(tmp_path / "batch.jsonl", [
        other_line("request-1", "/v1/embeddings", model=model,
                   input="You are a helpful assistant."),
        other_line("request-2", "/v1/embeddings", model=model,
                   input="You are an unhelpful assistant."),
        other_line("request-3", "/v1/embeddings", model=model, input="Hello world!"),
        other_line("request-4", "/v1/embeddings", model="NonExistModel", input="Hello world!"),
    ])
    job, out = tmp_path / "job", tmp_path / "out.jsonl"
    result = run(rows, "--job-dir", job, "-o", out, code=1)
    assert "every row failed" in result.output
    assert out.read_bytes() == b""
    errors = check_errors(job, [(f"request-{i}", "unsupported_url", i) for i in range(1, 5)])
    assert all("/v1/embeddings" in e.message for e in errors)


SCORE_DOCUMENTS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
SCORE = [other_line("request-1", "/score", queries="What is the capital of France?",
                    documents=SCORE_DOCUMENTS),
         other_line("request-2", "/v1/score", queries="What is the capital of France?",
                    documents=SCORE_DOCUMENTS)]
# vLLM's rerank batch reuses "request-2" on its third line; kept as it is.
RERANK = [other_line(cid, url, query="What is the capital of France?",
                     documents=SCORE_DOCUMENTS)
          for cid, url in (("request-1", "/rerank"), ("request-2", "/v1/rerank"),
                           ("request-2", "/v2/rerank"))]


@pytest.mark.parametrize(("lines", "expected"), [
    (SCORE, [("request-1", "unsupported_url", 1), ("request-2", "unsupported_url", 2)]),
    (RERANK, [("request-1", "unsupported_url", 1), ("request-2", "unsupported_url", 2),
              ("request-2", "duplicate_custom_id", 3)]),
], ids=["score", "rerank"])
def test_score(tmp_path, lines, expected):
    """Ports vLLM's test_score (score and rerank batches): vLLM answers them; batchrun makes
    each row an unsupported_url error line (a repeated custom_id is duplicate_custom_id)."""
    job, out = tmp_path / "job", tmp_path / "out.jsonl"
    run(batch(tmp_path / "batch.jsonl", lines), "--job-dir", job, "-o", out, code=1)
    assert out.read_bytes() == b""
    check_errors(job, expected)


def think_token_id() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(RANDOM_DEMO_MODEL / "tokenizer.json")).token_to_id("<think>")


def test_reasoning_parser(tmp_path):
    """Ports vLLM's test_reasoning_parser: each chat answer carries a non-empty
    message.reasoning (the random demo model is pushed to think by a logit bias)."""
    bias = {str(think_token_id()): 100}
    rows = batch(tmp_path / "batch.jsonl", [
        {"custom_id": cid, "method": "POST", "url": CHAT,
         "body": {"model": "Qwen/Qwen3-0.6B", "logit_bias": bias,
                  "chat_template_kwargs": {"enable_thinking": True},
                  "messages": [{"role": "system", "content": "You are a helpful assistant."},
                               {"role": "user", "content": question}]}}
        for cid, question in (("request-1", "Solve this math problem: 2+2=?"),
                              ("request-2", "What is the capital of France?"))])
    job = tmp_path / "job"
    run(rows, "--job-dir", job, "--max-tokens", "6", "--max-thinking-tokens", "2")
    results = jsonl(job / "results.jsonl")
    assert [r["custom_id"] for r in results] == ["request-1", "request-2"]
    assert not (job / "errors.jsonl").exists() or jsonl(job / "errors.jsonl") == []
    for line in results:
        check_result(line, line["custom_id"])
        message = line["response"]["body"]["choices"][0]["message"]
        assert isinstance(message["reasoning"], str) and len(message["reasoning"]) > 0
        assert "</think>" not in (message["content"] or "")


WAV = "data:audio/wav;base64,UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQAAAAA="


def test_transcription(tmp_path):
    """Ports vLLM's test_transcription: batchrun transcribes nothing, so the
    /v1/audio/transcriptions row (audio as a data URL) is its unsupported_url error."""
    rows = batch(tmp_path / "batch.jsonl", [other_line(
        "request-1", "/v1/audio/transcriptions", model="openai/whisper-large-v3", file_url=WAV,
        response_format="json")])
    job, out = tmp_path / "job", tmp_path / "out.jsonl"
    run(rows, "--job-dir", job, "-o", out, code=1)
    assert out.read_bytes() == b""
    (error,) = check_errors(job, [("request-1", "unsupported_url", 1)])
    assert "/v1/audio/transcriptions" in error.message
    assert "UklGR" not in error.message  # the audio's content is never quoted


class _Counting(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):  # noqa: N802
        type(self).hits += 1
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def audio_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    _Counting.hits = 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/mary_had_lamb.ogg", _Counting
    server.shutdown()
    server.server_close()


def test_transcription_http_url(tmp_path, audio_server):
    """Ports vLLM's test_transcription_http_url: the row with an http audio URL is its
    unsupported_url error, and the URL is never fetched."""
    url, handler = audio_server
    rows = batch(tmp_path / "batch.jsonl", [other_line(
        "request-1", "/v1/audio/transcriptions", model="openai/whisper-large-v3", file_url=url,
        response_format="json")])
    job = tmp_path / "job"
    run(rows, "--job-dir", job, code=1)
    check_errors(job, [("request-1", "unsupported_url", 1)])
    assert handler.hits == 0


def test_translation(tmp_path, audio_server):
    """Ports vLLM's test_translation: the /v1/audio/translations row is its unsupported_url
    error, and its audio URL is never fetched."""
    url, handler = audio_server
    rows = batch(tmp_path / "batch.jsonl", [other_line(
        "request-1", "/v1/audio/translations", model="openai/whisper-small", file_url=url,
        response_format="text", language="it", to_language="en", temperature=0.0)])
    job = tmp_path / "job"
    run(rows, "--job-dir", job, code=1)
    (error,) = check_errors(job, [("request-1", "unsupported_url", 1)])
    assert "/v1/audio/translations" in error.message
    assert handler.hits == 0


WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["location"],
                   "properties": {
                       # bounded so that a random-weight model's call ends in a few tokens
                       "location": {"type": "string", "maxLength": 6,
                                    "description": "The city and state"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}


def test_tool_calling(tmp_path):
    """Ports vLLM's test_tool_calling: with tool_choice "required" the answer is
    message.tool_calls, each with an id, type function, the offered tool's name and
    arguments (a call takes ~25-45 tokens, so this row gets max_tokens 64)."""
    rows = batch(tmp_path / "batch.jsonl", [{
        "custom_id": "request-1", "method": "POST", "url": CHAT,
        "body": {"model": "Qwen/Qwen3-0.6B", "tools": [WEATHER], "tool_choice": "required",
                 "messages": [{"role": "user",
                               "content": "What is the weather in San Francisco?"}],
                 "max_tokens": 64}}])
    job = tmp_path / "job"
    run(rows, "--job-dir", job)
    (line,) = jsonl(job / "results.jsonl")
    body = check_result(line, "request-1")
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id and call.type == "function"
        assert call.function.name == "get_current_weather"
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments.get("location"), str)
        assert set(arguments) <= {"location", "unit"}


def test_example_batch_file(tmp_path):
    """Ports vLLM's example batch file (openai_example_batch.jsonl): both rows, which limit
    tokens with max_completion_tokens, answer as chat.completion bodies."""
    rows = tmp_path / "openai_example_batch.jsonl"
    rows.write_text("".join(json.dumps(chat_line(
        f"request-{i}", system, model="meta-llama/Meta-Llama-3-8B-Instruct",
        max_completion_tokens=3)) + "\n" for i, system in (
            (1, "You are a helpful assistant."), (2, "You are an unhelpful assistant."))))
    job, out = tmp_path / "job", tmp_path / "results.jsonl"
    run(rows, "--job-dir", job, "-o", out)
    results = jsonl(out)
    assert [r["custom_id"] for r in results] == ["request-1", "request-2"]
    for line in results:
        body = check_result(line, line["custom_id"])
        assert isinstance(body, ChatCompletion)
        assert 0 < body.usage.completion_tokens <= 3
        assert body.choices[0].finish_reason in ("stop", "length")
    assert not (job / "errors.jsonl").exists() or jsonl(job / "errors.jsonl") == []
