"""One request's life in the engine: WAITING (queued, or back in the queue after a fault) ->
RUNNING (in the backend's batch, `uid` set) -> FINISHED (its Output made, exactly once).

A sequence that is restarted (a fault, see scheduler.py) goes back to WAITING with everything it
generated forgotten: it runs again from its prompt and, with its own seed, gives the same text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from batchrun.cache.prefix import Media
from batchrun.engine.decoding.constrain import GrammarProcessor
from batchrun.engine.types import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    id: int
    prompt: list[int]  # token ids (a vision row's include its image placeholders)
    params: SamplingParams
    max_tokens: int  # params.max_tokens, bounded by the context (2 for a choices row)
    inputs: Any = None  # what the backend needs beyond the tokens (a vision row's images)
    media: Media = ()  # where its images start in the prompt, and their digests
    status: Status = Status.WAITING
    uid: int | None = None  # the backend batch's id while RUNNING
    caller_id: Any = None  # the id the caller chose (add_request's request_id), if any
    # What it generated (reset by a restart).
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stops: Any = None  # postprocess.StopScanner for rows with stop strings
    processor: GrammarProcessor | None = None  # constrained rows, from admission on
    admitted_at: float = 0.0
    ttft: float | None = None
    # Prefix cache (prefix_plan.py): the prompt's block keys, the tokens served from the cache,
    # and whether the prefix it shares with other rows was computed for it (tried once).
    block_keys: list[bytes] = field(default_factory=list)
    cached: int = 0
    cached_disk: int = 0  # of them, in blocks a run before computed (read from disk)
    prefix_computed: bool = False
    # Choices rows (choices.py): each choice's tokens, their log-probabilities, the answer.
    choice_tokens: list[list[int]] | None = None
    choice_logprobs: dict[str, float] | None = None
    answer: str | None = None
    # Reasoning (reasoning.py): the prompt ends inside a block; the gate of a constrained or
    # budgeted row (None: the row has none).
    thinking_opened: bool = False
    thinking_budget: Any = None  # reasoning.ThinkingBudget of an unconstrained row

    @property
    def length(self) -> int:
        """The most tokens its KV cache will hold."""
        return len(self.prompt) + self.max_tokens

    @property
    def seed(self) -> int:
        """The row's own seed, or one derived from its id."""
        return self.params.seed if self.params.seed is not None else self.id

    def start_output(self, stops: Any) -> None:
        """Empty what it generated: at creation, and when a fault restarts it."""
        self.status, self.uid, self.ttft = Status.WAITING, None, None
        self.tokens = []
        self.logprobs = [] if self.params.logprobs else None
        self.top_logprobs = [] if self.params.top_logprobs else None
        self.stops = stops
        self.processor, self.choice_logprobs, self.answer = None, None, None
        self.thinking_budget = None
        self.cached = self.cached_disk = 0
