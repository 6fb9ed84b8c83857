"""Output records: batchrun's own result lines, OpenAI Batch API lines, and error records.

Everything in a record is a function of the row and its output (ids are hashes, `created` is
the job's creation time), so a resumed job writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import hashlib

from batchrun.engine.request import Output
from batchrun.job.rows import RowError, Task


def result_record(task: Task, out: Output, model: str, created: int) -> dict:
    if task.openai:
        return openai_record(task, out, model, created)
    record = {
        "custom_id": task.custom_id,
        "index": task.index,
        "text": out.text,
        "finish_reason": out.finish_reason.value,
        "usage": {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
        },
    }
    if out.logprobs is not None:
        record["logprobs"] = out.logprobs
    return record


def _hash_id(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:24]


def openai_record(task: Task, out: Output, model: str, created: int) -> dict:
    """A line of the OpenAI Batch API's output file, with a chat.completion or text_completion."""
    key = _hash_id(created, task.index, task.custom_id)
    usage = {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }
    if task.openai == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": None, "finish_reason": out.finish_reason.value}
        body = {"id": f"chatcmpl-{key}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None,
                  "finish_reason": out.finish_reason.value}
        body = {"id": f"cmpl-{key}", "object": "text_completion"}
    body |= {"created": created, "model": task.model or model, "choices": [choice],
             "usage": usage}
    return {
        "id": f"batch_req_{key}",
        "custom_id": task.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{key}", "body": body},
        "error": None,
    }


def error_record(error: RowError, openai: bool = False) -> dict:
    record = {
        "custom_id": error.custom_id,
        "index": error.index,
        "line": error.line,
        "error": {"code": error.code, "message": error.message},
    }
    if openai:  # also a valid line of an OpenAI batch error file
        record = {"id": f"batch_req_{_hash_id('error', error.index, error.custom_id)}",
                  **record, "response": None}
    return record
