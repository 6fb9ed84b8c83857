"""From the backend's tokens to a request's Output: stop strings, log-probabilities, the text.

Stop strings are looked for incrementally (a streaming detokenizer; only text a new token could
complete is searched), so a long answer costs linear, not quadratic, time. The final text is
one decode of all the tokens (as mlx-lm's batch_generate does), cut at the first stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from batchrun.engine.sequence import Sequence
from batchrun.engine.types import FinishReason, Output

# A row's finish reason when its log-probabilities are not numbers (NaN, or an infinite
# normalizer): an overflow in half precision, or damaged weights. The row fails.
NOT_FINITE = "not_finite"


@dataclass(slots=True)
class Step:
    """One row's token from one backend step, in the same shape for every backend."""

    uid: int
    token: int
    finish_reason: str | None  # the backend's: "stop", "length", NOT_FINITE, or None (running)
    logprobs: mx.array | None = None  # the whole distribution, where the backend gives it
    token_logprob: float | None = None  # else the sampled token's ...
    top: list[tuple[int, float]] | None = None  # ... and the top alternatives


class StopScanner:
    """Whether a row's text so far holds one of its stop strings, looking at new text only."""

    def __init__(self, detokenizer: Any, stops: tuple[str, ...]):
        self.detokenizer = detokenizer
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self.scan_from = 0  # no stop string starts before this text offset

    def add(self, token: int) -> bool:
        self.detokenizer.add_token(token)
        text = self.detokenizer.text
        hit = find_stop(text, self.stops, self.scan_from)
        self.scan_from = max(0, len(text) - self.longest + 1)
        return hit is not None


def find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Where the first stop string in `text[start:]` begins, or None."""
    if not stops:
        return None
    hits = [i for s in stops if (i := text.find(s, max(0, start))) >= 0]
    return min(hits) if hits else None


def record_logprobs(seq: Sequence, step: Step) -> None:
    """Keep the sampled token's log-probability and the top alternatives, if asked for."""
    if step.logprobs is not None:
        if seq.logprobs is not None:
            seq.logprobs.append(step.logprobs[step.token].item())
        if seq.top_logprobs is not None:
            k = seq.params.top_logprobs
            top = mx.argpartition(-step.logprobs, kth=k - 1)[:k]
            pairs = zip(top.tolist(), step.logprobs[top].tolist(), strict=True)
            seq.top_logprobs.append(sorted(pairs, key=lambda p: -p[1]))
        return
    if seq.logprobs is not None:
        seq.logprobs.append(float(step.token_logprob))
    if seq.top_logprobs is not None:
        top = sorted(((int(t), float(lp)) for t, lp in step.top or ()), key=lambda p: -p[1])
        seq.top_logprobs.append(top[: seq.params.top_logprobs])


def make_output(seq: Sequence, reason: FinishReason, decode, error: str | None = None) -> Output:
    """The request's Output; `decode` turns token ids into text."""
    text = decode(seq.tokens) if seq.tokens else ""
    if seq.answer is not None:
        text = seq.answer
    hit = find_stop(text, seq.params.stop, 0)
    if hit is not None:  # also one that only the last, held-back tokens completed
        text, reason = text[:hit], FinishReason.STOP
    return Output(
        request_id=seq.id if seq.caller_id is None else seq.caller_id, text=text,
        token_ids=seq.tokens, finish_reason=reason,
        prompt_tokens=len(seq.prompt), cached_tokens=seq.cached, logprobs=seq.logprobs,
        top_logprobs=seq.top_logprobs, ttft_s=seq.ttft, error=error,
        constraint_complete=(seq.processor.complete if seq.processor
                             else True if seq.answer is not None else None),
        constraint_error=_first_line(seq.processor.error) if seq.processor else None,
        choice_logprobs=seq.choice_logprobs,
        thinking_opened=seq.thinking_opened,
    )


def _first_line(error: str | None) -> str | None:
    """The reason in the grammar engine's error, without the parser state it appends."""
    return error.strip().splitlines()[0] if error and error.strip() else None
