"""Requests as the seed's API takes them (text, token ids or chat messages) made into the token
ids the engine speaks, and the sampling of a `generate` call; Engine.add_request and
Engine.generate are these over the engine's prompts and add_tokens."""

from __future__ import annotations

from typing import Any

from batchrun.engine.types import SamplingParams


def prompt_ids(prompts: Any, prompt: str | list[int] | None = None, *,
               messages: list[dict] | None = None, tools: list[dict] | None = None,
               chat_template_kwargs: dict | None = None,
               enable_thinking: bool | None = None,
               continue_final_message: bool = False) -> list[int]:
    """A request's token ids (from token ids, a raw prompt, or chat messages), encoded with a
    backend's prompts."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt (text or token ids) and messages")
    if messages is not None:
        return prompts.encode_chat(messages, tools=tools, enable_thinking=enable_thinking,
                                   chat_template_kwargs=chat_template_kwargs,
                                   continue_final_message=continue_final_message)
    if isinstance(prompt, str):
        return prompts.encode(prompt)
    return [int(t) for t in prompt]


def sampling_params(params: SamplingParams | None, keywords: dict) -> SamplingParams:
    """`generate`'s sampling: `params`, or SamplingParams of the keyword arguments."""
    if params is None:
        return SamplingParams(**keywords)
    if keywords:
        raise ValueError("give sampling as params or as keyword arguments, not both")
    return params


def is_chat(prompt: object) -> bool:
    """Whether a `generate` prompt is a chat (a list of messages)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
