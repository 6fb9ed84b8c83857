"""Requests' sampling parameters, constraints and finished outputs: the engine's vocabulary.

The engine speaks token ids and integer request ids; row ids, files and reports live above it.
This module is the engine's ground floor: it imports nothing from the engine.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

import llguidance


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the request could not be run (see Output.error)


MAX_SEED = 2**64 - 1  # a seed is one unsigned 64-bit integer (mx.random.key's)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling. Raises ValueError naming the field on a bad value."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # The answer must match this (JSON schema, regex, choices): Constraint, below.
    constraint: Constraint | None = None
    # OpenAI's penalties (generated tokens), vLLM's repetition penalty (prompt and generated
    # tokens; 1 is none), additive logit bias per token id, and a floor under the answer's
    # length (EOS and stop_token_ids are barred until then): sampling.LogitAdjustments.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # A thinking model's reasoning block ends after at most this many tokens (None: unbounded);
    # a constraint applies to the answer after it (engine/decoding/reasoning.py).
    max_thinking_tokens: int | None = None
    # The row asked its template for a reasoning block (enable_thinking: True): a constrained
    # answer may reason first, and the constraint applies after the block; False: a raw prompt,
    # never read as reasoning; None: the prompt decides (a template that opened a block).
    thinking: bool | None = None
    # The caller's own logits processors, as mlx-lm takes them: processor(tokens, logits) ->
    # logits, with the row's tokens so far (prompt and generated); run after penalties and
    # bias, before a constraint's mask.
    logits_processors: tuple = ()

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "logit_bias", "logits_processors"):
            if getattr(self, name) is None:  # as vllm-mlx reads None: none
                object.__setattr__(self, name, ())
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", self.max_tokens, "an integer >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "a number >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 0 (0 disables it)")
        _check(_finite(self.min_p) and 0 <= self.min_p < 1, "min_p", self.min_p, "in [0, 1)")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and 0 <= self.seed <= MAX_SEED),
               "seed", self.seed, f"an integer in [0, {MAX_SEED}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "non-empty strings")
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20,
               "top_logprobs", self.top_logprobs, "an integer in [0, 20]")
        _check(self.constraint is None or isinstance(self.constraint, Constraint),
               "constraint", self.constraint, "a Constraint")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "a number > 0 (1 is none)")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and _finite(b)
                   and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias",
               dict(self.logit_bias), "token ids mapped to numbers in [-100, 100]")
        _check(self.max_thinking_tokens is None
               or (type(self.max_thinking_tokens) is int and self.max_thinking_tokens >= 0),
               "max_thinking_tokens", self.max_thinking_tokens, "an integer >= 0")
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
               and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"an integer in [0, max_tokens = {self.max_tokens}]")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "token ids")
        _check(isinstance(self.logits_processors, tuple | list)
               and all(callable(f) for f in self.logits_processors), "logits_processors",
               self.logits_processors, "a list of callables (tokens, logits) -> logits")
        if isinstance(self.logits_processors, list):
            object.__setattr__(self, "logits_processors", tuple(self.logits_processors))

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, logit bias or min_tokens apply (sampling.LogitAdjustments)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.min_tokens or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


@dataclass(slots=True)
class Output:
    """A finished request."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0
    # Per generated token: the sampled token's logprob, and the top alternatives.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ttft_s: float | None = None
    error: str | None = None
    # Constrained rows: whether the answer is a whole match of the constraint (False when it
    # was cut short, e.g. by max_tokens); with choices, log P(choice | prompt) for each.
    constraint_complete: bool | None = None
    # ... and where the grammar engine gave up on the answer (a limit of its own), why
    constraint_error: str | None = None
    choice_logprobs: dict[str, float] | None = None
    thinking_opened: bool = False  # the prompt ended inside a reasoning block (reasoning.py)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens(self) -> list[int]:
        """token_ids, under the name vllm-mlx's outputs give them."""
        return self.token_ids

    @property
    def usage(self) -> dict[str, int]:
        """The tokens, as OpenAI's usage (and vllm-mlx's Output.usage) counts them."""
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "cached_tokens": self.cached_tokens}


# Compact JSON, no free whitespace: a weak model cannot wander off into blank space.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A schema, regex or choice list that cannot be compiled; the message says why."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a row's answer must match. `kind`: json_schema, json_object, regex, choices, or
    lark (a grammar: decoding.tool_grammar's)."""

    kind: str
    value: str | tuple[str, ...] = ""  # the schema as JSON text, the regex, or the choices

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConstraintError("a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def choices(cls, choices: Any) -> Constraint:
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise ConstraintError("choices must be a non-empty list of non-empty strings")
        if len(set(choices)) != len(choices):
            raise ConstraintError(f"choices must be distinct, got {list(choices)!r}")
        return cls("choices", tuple(choices))

    @classmethod
    def regex(cls, pattern: Any) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError("a regex must be a non-empty string")
        return cls("regex", pattern)

    def grammar(self) -> str:
        """The llguidance grammar for this constraint."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.value,
                                                                 defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choices":
            alternatives = " | ".join(json.dumps(c) for c in self.value)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.value)
        raise ConstraintError(f"unknown constraint kind {self.kind!r}")

    def describe(self) -> str:
        if self.kind == "choices":
            return "choices " + ", ".join(self.value)
        return {"json_schema": "the JSON schema", "json_object": "a JSON object",
                "regex": f"the regex {self.value!r}", "lark": "a tool call"}[self.kind]
