"""Output records: batchrun's own result lines, OpenAI Batch API lines, and error records.

Everything in a record is a function of the row and its outputs (ids are hashes, `created` is
the job's creation time), so a resumed job writes the same bytes as an uninterrupted one.

A row has one output per sample (`n`). Token log-probabilities follow OpenAI's formats: chat
(`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`) for batchrun's own lines and
chat rows, the legacy completions format for `/v1/completions` rows. With choices, a record
carries `choice_probs`: each choice's probability, normalized over the choices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from batchrun.engine.decoding.choices import normalized
from batchrun.engine.decoding.reasoning import Markup, ToolCall, parse_tool_calls, split_reasoning
from batchrun.engine.types import Output
from batchrun.job.rows import RowError, Task

TokenBytes = Callable[[int], bytes]  # a token id's bytes in the model's vocabulary
NO_MARKUP = Markup()


def result_record(task: Task, outs: list[Output], model: str, created: int,
                  token_bytes: TokenBytes, markup: Markup = NO_MARKUP) -> dict:
    if task.openai:
        return openai_record(task, outs, model, created, token_bytes, markup)
    first = outs[0]
    reasoning, text, calls = answer_parts(task, first, markup)
    record = {
        "custom_id": task.custom_id,
        "index": task.index,
        "text": text,
        "finish_reason": "tool_calls" if calls else first.finish_reason.value,
        "usage": {
            "prompt_tokens": first.prompt_tokens,
            "completion_tokens": sum(o.completion_tokens for o in outs),
            "cached_tokens": first.cached_tokens,
        },
    }
    if reasoning is not None:
        record["reasoning"] = reasoning
    if calls:
        record["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls]
    if task.expected is not None:
        record["expected"] = task.expected
    if task.columns is not None:
        record["columns"] = task.columns
    if first.choice_logprobs is not None:
        record["choice_probs"] = normalized(first.choice_logprobs)
    if first.logprobs is not None:
        record["logprobs"] = chat_logprobs(first, token_bytes)
    if len(outs) > 1:
        samples = []
        for o in outs:
            reasoning, text, calls = answer_parts(task, o, markup)
            sample = {"text": text,
                      "finish_reason": "tool_calls" if calls else o.finish_reason.value,
                      "completion_tokens": o.completion_tokens}
            if reasoning is not None:
                sample["reasoning"] = reasoning
            if calls:
                sample["tool_calls"] = [{"name": c.name, "arguments": c.arguments}
                                        for c in calls]
            if o.logprobs is not None:
                sample["logprobs"] = chat_logprobs(o, token_bytes)
            samples.append(sample)
        record["samples"] = samples
    return record


def answer_parts(task: Task, out: Output, markup: Markup
                 ) -> tuple[str | None, str, list[ToolCall]]:
    """(reasoning, answer, tool calls) of a chat row's output; a raw prompt's text stays whole
    (it has no template that reasons or calls tools)."""
    if not task.chat:
        return None, out.text, []
    reasoning, answer = split_reasoning(out.text, markup, out.thinking_opened)
    answer, calls = parse_tool_calls(answer, markup, task.tools)
    return reasoning, answer, calls


def _entry(token: int, logprob: float, token_bytes: TokenBytes) -> dict:
    raw = token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
            "bytes": list(raw)}


def chat_logprobs(out: Output, token_bytes: TokenBytes) -> dict:
    """OpenAI chat completions' `logprobs`: one entry per generated token."""
    content = []
    tops = out.top_logprobs or [[] for _ in out.token_ids]
    for token, logprob, top in zip(out.token_ids, out.logprobs, tops, strict=False):
        entry = _entry(token, logprob, token_bytes)
        entry["top_logprobs"] = [_entry(t, lp, token_bytes) for t, lp in top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(out: Output, token_bytes: TokenBytes) -> dict:
    """OpenAI (legacy) completions' `logprobs`: parallel lists."""
    tokens = [token_bytes(t).decode("utf-8", errors="replace") for t in out.token_ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = None
    if out.top_logprobs is not None:
        top = [{token_bytes(t).decode("utf-8", errors="replace"): lp for t, lp in step}
               for step in out.top_logprobs]
    return {"tokens": tokens, "token_logprobs": out.logprobs, "top_logprobs": top,
            "text_offset": offsets}


def _hash_id(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:24]


def openai_record(task: Task, outs: list[Output], model: str, created: int,
                  token_bytes: TokenBytes, markup: Markup = NO_MARKUP) -> dict:
    """A line of the OpenAI Batch API's output file, with a chat.completion or text_completion
    (one choice per sample). `model` is the model that answered (body.model is what the row
    asked for: the report counts those)."""
    key = _hash_id(created, task.index, task.custom_id)
    completion = sum(o.completion_tokens for o in outs)
    per_prompt = outs[::task.n]  # each prompt's first sample (a completions row may list several)
    prompt_tokens = sum(o.prompt_tokens for o in per_prompt)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in per_prompt)},
    }
    choices = []
    for i, out in enumerate(outs):
        if task.openai == "chat":
            logprobs = chat_logprobs(out, token_bytes) if out.logprobs is not None else None
            reasoning, content, calls = answer_parts(task, out, markup)
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if reasoning is not None:
                message["reasoning"] = reasoning  # the name vLLM gives it
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{_hash_id(key, i, j)}", "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for j, c in enumerate(calls)]
            choice = {"index": i, "message": message, "logprobs": logprobs,
                      "finish_reason": "tool_calls" if calls else out.finish_reason.value}
        else:
            logprobs = completion_logprobs(out, token_bytes) if out.logprobs is not None else None
            choice = {"index": i, "text": out.text, "logprobs": logprobs,
                      "finish_reason": out.finish_reason.value}
        if out.choice_logprobs is not None:
            choice["choice_probs"] = normalized(out.choice_logprobs)
        choices.append(choice)
    if task.openai == "chat":
        body = {"id": f"chatcmpl-{key}", "object": "chat.completion"}
    else:
        body = {"id": f"cmpl-{key}", "object": "text_completion"}
    body |= {"created": created, "model": model, "choices": choices,
             "usage": usage}
    record = {
        "id": f"batch_req_{key}",
        "custom_id": task.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{key}", "body": body},
        "error": None,
    }
    if task.expected is not None:
        record["expected"] = task.expected
    return record


def error_record(error: RowError, openai: bool = False, job: object = 0) -> dict:
    """A row's error record: batchrun's own, or for an OpenAI batch job exactly a line of
    OpenAI's batch error file (its `BatchError` fields, the input line inside `error`; the id
    the job's own, from `job`)."""
    if openai:
        return {"id": f"batch_req_{_hash_id('error', job, error.index, error.custom_id)}",
                "custom_id": error.custom_id, "response": None,
                "error": {"code": error.code, "message": error.message, "param": None,
                          "line": error.line}}
    return {
        "custom_id": error.custom_id,
        "index": error.index,
        "line": error.line,
        "error": {"code": error.code, "message": error.message},
    }

