"""A thinking model's reasoning block and a model's tool calls, taken out of its answer.

What the markup is comes from mlx-lm's tokenizer wrapper, which knows the families: the
reasoning block's start and end (`<think>`/`</think>` and the others it infers from the
vocabulary), a tool call's start and end (hermes/qwen `<tool_call>`, mistral `[TOOL_CALLS]`, ...)
and the parser of what sits between them. Llama-3 writes a call as a bare JSON object
(`{"name": ..., "parameters": ...}`, maybe after `<|python_tag|>`); that family has no markers
and is recognized here, when the row offered tools.

`ThinkingGate` is the engine's part: a row whose answer is constrained reasons freely first; the
constraint starts after the block ends, and a block that reaches `max_thinking_tokens` is ended
by forcing its end token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

PYTHON_TAG = "<|python_tag|>"
# A template that opens the reasoning block puts its start at the very end of the generation
# prompt ("<|im_start|>assistant\n<think>\n"): only the last this many tokens are looked at.
OPENED_WITHIN = 4


@dataclass(frozen=True)
class Markup:
    """A tokenizer's reasoning and tool-call markup (None where it has none)."""

    think_start: str | None = None
    think_end: str | None = None
    think_start_id: int | None = None  # single-token markers only: the gate needs one token
    think_end_id: int | None = None
    tool_start: str | None = None
    tool_end: str | None = None
    tool_parser: Callable[[str, Any], Any] | None = None
    # How calls are written, for a grammar (tool_grammar.FORMS): mlx-lm's parser's name, with
    # Mistral's two forms apart; "bare" for a template that shows tools but has no markers.
    tool_format: str | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> Markup:
        def attr(name: str) -> Any:
            try:
                return getattr(tokenizer, name, None)
            except (AttributeError, TypeError, ValueError):
                return None

        start_ids, end_ids = attr("think_start_tokens"), attr("think_end_tokens")
        return cls(think_start=attr("think_start") if attr("has_thinking") else None,
                   think_end=attr("think_end") if attr("has_thinking") else None,
                   think_start_id=_single(start_ids), think_end_id=_single(end_ids),
                   tool_start=attr("tool_call_start") if attr("has_tool_calling") else None,
                   tool_end=attr("tool_call_end") if attr("has_tool_calling") else None,
                   tool_parser=attr("tool_parser") if attr("has_tool_calling") else None,
                   tool_format=_tool_format(attr("tool_parser") if attr("has_tool_calling")
                                            else None, attr("chat_template")))

    @property
    def thinks(self) -> bool:
        return bool(self.think_start and self.think_end)

    def opens_thinking(self, prompt: list[int]) -> bool:
        """Whether the template opened a reasoning block for the answer: its start among the
        prompt's last few tokens (after the assistant's turn begins), not closed since. A
        `<think>` a user wrote further up is text."""
        if self.think_start_id is None or self.think_end_id is None:
            return False
        for token in reversed(prompt[-OPENED_WITHIN:]):
            if token == self.think_end_id:
                return False
            if token == self.think_start_id:
                return True
        return False


def _tool_format(parser: Any, template: Any) -> str | None:
    template = template if isinstance(template, str) else ""
    if parser is None:
        return "bare" if "tools" in template else None
    name = (getattr(parser, "__module__", "") or "").rsplit(".", 1)[-1]
    if name == "mistral":
        return "mistral_args" if "[ARGS]" in template else "mistral_list"
    return name


def _single(ids: Any) -> int | None:
    return int(ids[0]) if ids is not None and len(ids) == 1 else None


def split_reasoning(text: str, markup: Markup, opened: bool = False
                    ) -> tuple[str | None, str]:
    """(reasoning, answer) of a generated text; reasoning is None without a block. `opened`: the
    prompt already started the block. A block the answer never closed is all reasoning."""
    if not markup.thinks:
        return None, text
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(markup.think_start):
            return None, text
        text = stripped[len(markup.think_start):]
    end = text.find(markup.think_end)
    if end < 0:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(markup.think_end):].lstrip()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it


def parse_tool_calls(answer: str, markup: Markup, tools: list | None
                     ) -> tuple[str, list[ToolCall]]:
    """(the answer without its tool calls, the calls). An answer whose calls do not all parse
    is left as it is, with no calls (the text then shows what the model wrote)."""
    if not tools:
        return answer, []
    try:
        if markup.tool_start:
            return _marked_calls(answer, markup, tools)
        return _bare_json_call(answer, tools)
    except Exception:  # noqa: BLE001  (the parsers are mlx-lm's, the text the model's:
        return answer, []  # RecursionError on deep nesting, MemoryError... -> plain text)


def _marked_calls(answer: str, markup: Markup, tools: list) -> tuple[str, list[ToolCall]]:
    start, end = markup.tool_start, markup.tool_end
    calls, kept, at = [], [], 0
    while (i := answer.find(start, at)) >= 0:
        kept.append(answer[at:i])
        body_from = i + len(start)
        j = answer.find(end, body_from) if end else -1
        body = answer[body_from:j] if j >= 0 else answer[body_from:]
        calls.extend(_calls_of(markup.tool_parser(body, tools)))
        at = j + len(end) if j >= 0 else len(answer)
    if not calls:
        return answer, []
    kept.append(answer[at:])
    return "".join(kept).strip(), calls


def _bare_json_call(answer: str, tools: list) -> tuple[str, list[ToolCall]]:
    """Llama-3's form: the whole answer is one JSON call naming an offered tool."""
    text = answer.strip().removeprefix(PYTHON_TAG).strip()
    if not text.startswith("{"):
        return answer, []
    call = json.loads(text)
    names = {t.get("function", {}).get("name") for t in tools if isinstance(t, dict)}
    if not isinstance(call, dict) or call.get("name") not in names:
        return answer, []
    arguments = call.get("parameters", call.get("arguments", {}))
    return "", _calls_of({"name": call["name"], "arguments": arguments})


def _calls_of(parsed: Any) -> list[ToolCall]:
    """mlx-lm's parsers give one call or a list: {"name", "arguments"} each."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        name, arguments = item["name"], item.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise ValueError("a tool call without a name")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        name.encode(), arguments.encode()  # a lone surrogate from a JSON escape: not a call
        calls.append(ToolCall(name, arguments))
    return calls


class ThinkingGate:
    """Where a row stands with its reasoning block: `free` while it reasons (no constraint),
    `forced_end` when the block reached its budget (only the end token is allowed), and
    `answering` after it (the constraint applies). Tokens are fed with `see`."""

    def __init__(self, markup: Markup, budget: int | None, opened: bool):
        self.end_id = markup.think_end_id
        self.start_id = markup.think_start_id
        self.budget = budget
        self.state = "thinking" if opened else "start"  # start: may open a block or answer
        self.thought = 0

    @property
    def answering(self) -> bool:
        return self.state == "answering"

    def see(self, token: int) -> bool:
        """Feed a generated token; True when it belongs to the answer (the constraint's)."""
        if self.state == "start":
            if token == self.start_id:
                self.state = "thinking"
                return False
            self.state = "answering"
            return True
        if self.state == "thinking":
            if token == self.end_id:
                self.state = "answering"
            else:
                self.thought += 1
            return False
        return True

    @property
    def forcing_end(self) -> bool:
        return self.state == "thinking" and self.budget is not None \
            and self.thought >= self.budget

    def widen(self, words: np.ndarray) -> None:
        """Adjust a constrained row's allowed-token bitmask (uint32 words) before its answer:
        the first token may also open a block; inside one every token is allowed, or only its
        end once the budget is spent."""
        if self.state == "start":
            _set_bit(words, self.start_id)
        elif self.forcing_end:
            words[:] = 0
            _set_bit(words, self.end_id)
        else:
            words[:] = 0xFFFFFFFF


def _set_bit(words: np.ndarray, token: int) -> None:
    words[token // 32] |= np.uint32(1 << (token % 32))


class ThinkingBudget:
    """A logits processor for a row without a constraint: ends its reasoning block after
    `max_thinking_tokens` by allowing only the end token. Called before each generated token
    (mlx-lm's processor protocol: the tokens so far, the generated one last)."""

    def __init__(self, gate: ThinkingGate):
        self.gate = gate
        self.started = False

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if self.started:
            self.gate.see(int(context[-1].item()))
        self.started = True
        if not self.gate.forcing_end:
            return logits
        keep = mx.arange(logits.shape[-1]) == self.gate.end_id
        return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))
