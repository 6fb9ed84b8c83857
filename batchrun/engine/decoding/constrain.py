"""Constrained decoding: answers that follow a JSON schema, a regex or a list of choices.

The grammar engine is llguidance (pinned): it compiles JSON schemas, regexes and Lark grammars
against the model's tokenizer and computes a row's allowed-token bitmask in tens of
microseconds, from NumPy, with no PyTorch. (outlines-core builds a full index per schema up
front; xgrammar's Python package needs PyTorch.)

A request's `Constraint` (what its answer must match) is a value in types.py; this module
compiles it. A constrained row carries a `GrammarProcessor` as its logits processor. The decode
step (backends/batch.py) finds the rows that have one, lets each matcher consume the row's last
token, fills all their bitmasks in one parallel call and masks the rows' logits with one
operation, so constrained and free rows share a batch. The processor also works alone as an
mlx-lm logits processor (mlx-lm calls it for the first token after a prompt).
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np

from batchrun.engine.decoding.reasoning import ThinkingGate
from batchrun.engine.types import Constraint, ConstraintError

# llguidance numbers a grammar's symbols in 16 bits and panics past 65,525 of them (1.9:
# `grammar.symbols.len() < u16::MAX - 10`); its size limit, held below that, refuses such a
# grammar with an error instead (a tool call of many arguments reaches it; tool_grammar.py).
MAX_GRAMMAR_SYMBOLS = 60_000


def response_format_constraint(response_format: Any) -> Constraint | None:
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ConstraintError("response_format must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintError("response_format json_schema needs "
                                  "{'json_schema': {'name': ..., 'schema': {...}}}")
        return Constraint.json_schema(spec["schema"])
    raise ConstraintError(f"response_format type must be text, json_object or json_schema, "
                          f"got {kind!r}")


class Grammars:
    """Compiles constraints for one model's tokenizer; one compiled matcher per constraint,
    copied for each row."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int] | None = None):
        """`tokenizer`: mlx-lm's TokenizerWrapper or a Hugging Face fast tokenizer."""
        import llguidance.hf

        if eos is None:
            eos = sorted(tokenizer.eos_token_ids)
        inner = getattr(tokenizer, "_tokenizer", None)  # mlx-lm's wrapper holds the HF one
        hf = inner if hasattr(inner, "backend_tokenizer") else tokenizer
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self._templates: dict[Constraint, llguidance.LLMatcher] = {}
        self._executor = llguidance.LLExecutor()

    def check(self, constraint: Constraint) -> None:
        """Raise ConstraintError if the constraint does not compile."""
        self.matcher(constraint)

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        template = self._templates.get(constraint)
        if template is None:
            try:
                grammar = constraint.grammar()
            except ValueError as e:  # llguidance rejects the schema or the regex
                raise ConstraintError(f"{constraint.describe()} does not compile: {e}") from None
            limits = llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS)
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=limits)
            if error and not error.startswith("WARNING"):
                raise ConstraintError(f"{constraint.describe()} does not compile: {error}")
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
            if template.is_error():
                raise ConstraintError(f"{constraint.describe()} does not compile: "
                                      f"{template.get_error()}")
            self._templates[constraint] = template
        return template.deep_copy()

    def processor(self, constraint: Constraint, gate: ThinkingGate | None = None
                  ) -> GrammarProcessor:
        return GrammarProcessor(self.matcher(constraint), self, gate)

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])

    def mask_rows(self, logits: mx.array, processors: list[GrammarProcessor]) -> mx.array:
        """Mask every row of `logits` (one per processor) to its grammar's allowed tokens."""
        bitmask = llg_numpy.allocate_token_bitmask(len(processors), self.vocab_size)
        llg_numpy.fill_next_token_bitmask_par(
            self._executor, [(p.matcher, i) for i, p in enumerate(processors)], bitmask)
        for i, p in enumerate(processors):
            if p.gate is not None and not p.gate.answering:
                p.gate.widen(bitmask.view(np.uint32)[i])
        return apply_bitmask(logits, bitmask)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """Logits with -inf wherever a row's bit is 0 (bit j of word w: token 32 * w + j)."""
    words = mx.array(bitmask.view(np.uint32))
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(bits.shape[0], -1)[:, : logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


class GrammarProcessor:
    """A row's grammar state. Called once per generated token, before sampling: it first
    consumes the token sampled last (none before the first), then masks the logits."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: Grammars,
                 gate: ThinkingGate | None = None):
        self.matcher = matcher
        self.grammars = grammars
        self.gate = gate  # a reasoning block first: the grammar starts after it
        self.started = False
        self.consumed = 0  # generated tokens seen (the grammar's and the reasoning's)

    def advance(self, last_token: int) -> None:
        """Consume the token sampled at the previous step (a no-op before the first)."""
        if self.started:
            if self.gate is None or self.gate.see(last_token):
                self.matcher.consume_token(last_token)
            self.consumed += 1
        self.started = True

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        self.advance(int(context[-1].item()) if self.started else -1)
        return self.grammars.mask_rows(logits, [self])

    def process_last_token(self, token: int, logits: mx.array) -> mx.array:
        """mlx-vlm's processor call in a decode step: the last token comes as an int."""
        self.advance(token)
        return self.grammars.mask_rows(logits, [self])

    @property
    def complete(self) -> bool:
        """The answer so far is a whole match (it may stop here)."""
        return (self.gate is None or self.gate.answering) and self.matcher.is_accepting() \
            and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


def choice_token_ids(tokenizer: Any, choices: tuple[str, ...]) -> list[list[int]]:
    """Each choice's tokens as the model would write it after the prompt."""
    return [tokenizer.encode(c, add_special_tokens=False) for c in choices]


