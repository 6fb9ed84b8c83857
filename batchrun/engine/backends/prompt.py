"""Turn raw prompts and chat messages into token ids with the model's own tokenizer.

Raw prompts are encoded as mlx-lm's `generate` encodes them (a BOS token when the tokenizer has
one); chat messages go through the model's chat template with tools, `chat_template_kwargs` and
`enable_thinking`, then are encoded without adding special tokens a second time.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from batchrun.engine.backends.tokens import Encoder, SharedStarts

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class PromptError(ValueError):
    """A prompt that cannot be rendered; the message names the field."""


class PromptBuilder:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._bos = getattr(tokenizer, "bos_token", None)
        self._encode = Encoder(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._chat_tokens = SharedStarts(
            self._encode, [t.content for t in added.values() if getattr(t, "special", False)])

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (a prompt given as ids must be under it)."""
        try:
            return len(self.tokenizer.get_vocab())
        except (AttributeError, TypeError):
            return int(getattr(self.tokenizer, "vocab_size", 0)) or (1 << 31)

    def encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise PromptError(f"prompt must be a string, got {type(prompt).__name__}")
        add_special = self._bos is None or not prompt.startswith(self._bos)
        return self._encode(prompt, add_special_tokens=add_special)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        enable_thinking: bool | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The chat-templated prompt text, ending with the assistant's generation prompt; with
        `continue_final_message`, ending inside the last message (an assistant's answer begun:
        the model goes on from it), as transformers renders it."""
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise PromptError("this model has no chat template: send rows with 'prompt' instead")
        kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        messages = normalize_messages(messages)
        if tools is not None and not isinstance(tools, list):
            raise PromptError("tools must be a list of tool definitions")
        if continue_final_message:
            if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
                raise PromptError("continue_final_message needs the last message to be the "
                                  "assistant's, with the text the answer begins with")
            kwargs["continue_final_message"] = True
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=not continue_final_message,
                tokenize=False, **kwargs,
            )
        except Exception as e:  # jinja errors: template raise_exception, bad structure
            raise PromptError(f"messages: the chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict], **kwargs: Any) -> list[int]:
        return self._chat_tokens(self.render(messages, **kwargs))


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI-style messages; flatten text-only content parts to a string."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise PromptError(
                f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role!r}"
            )
        content = m.get("content")
        if isinstance(content, list):
            content = _flatten_parts(content, i)
        elif content is not None and not isinstance(content, str):
            raise PromptError(f"messages[{i}].content must be a string or a list of parts")
        if content is None and not m.get("tool_calls"):
            raise PromptError(f"messages[{i}].content is missing")
        message = {**m, "content": content if content is not None else ""}
        if isinstance(m.get("tool_calls"), list):
            message["tool_calls"] = [_call_with_mapping(c) for c in m["tool_calls"]]
        out.append(message)
    return out


def _call_with_mapping(call: Any) -> Any:
    """An assistant's earlier tool call with its arguments as a mapping: OpenAI sends them as
    a JSON string, and templates that write `arguments | tojson` (Qwen's, Llama's) would
    render a string of JSON inside the JSON. Arguments that are not a JSON object stay as
    given."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def _flatten_parts(parts: list, i: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_image", "image"):
            raise PromptError(
                f"messages[{i}].content[{j}] is an image: this needs a vision model"
            )
        else:
            raise PromptError(
                f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': ...}}"
            )
    return "".join(texts)
