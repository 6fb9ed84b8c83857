"""Per-request samplers whose randomness belongs to the request, not to the batch.

A seeded request draws step i's token with key i of a key sequence derived from its seed, so the
same row samples the same text whatever else shares its batch and whenever it is admitted.
Greedy requests share one sampler object, which lets mlx-lm sample a greedy batch in one call.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from batchrun.engine.types import SamplingParams


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class RowSampler:
    """A sampled request's sampler: the token at its generated position n is drawn by
    mx.random.categorical with key n of the request's key sequence (a Gumbel-max draw: the
    argmax of the filtered log-probabilities / temperature plus that key's noise). The draw
    belongs to the position, so speculative decoding (speculate.py) picks the very token plain
    decoding would at every position it verifies: seeded output does not change with it."""

    def __init__(self, params: SamplingParams, seed: int):
        self.filters = []
        if params.top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, params.top_k))
        if 0 < params.top_p < 1:
            self.filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0:
            self.filters.append(lambda x: apply_min_p(x, params.min_p))
        base = params.seed if params.seed is not None else seed
        self.keys = mx.random.split(mx.random.key(base & 0xFFFF_FFFF_FFFF_FFFF),
                                    params.max_tokens)
        self.last = params.max_tokens - 1
        self.inv_temp = 1.0 / params.temperature
        self.position = 0  # the generated position the next call samples

    def __call__(self, logprobs: mx.array) -> mx.array:
        for f in self.filters:
            logprobs = f(logprobs)
        token = mx.random.categorical(logprobs * self.inv_temp,
                                      key=self.keys[min(self.position, self.last)])
        self.position += 1
        return token

    def at(self, logprobs: mx.array, positions: list[int]) -> mx.array:
        """The tokens at `positions`, one row of `logprobs` (m, vocab) each, as __call__ would
        draw them there (row by row: a draw depends on its array's shape), without moving
        on."""
        for f in self.filters:
            logprobs = f(logprobs)
        scaled = logprobs * self.inv_temp
        return mx.concatenate([
            mx.random.categorical(scaled[j: j + 1], key=self.keys[min(p, self.last)])
            for j, p in enumerate(positions)])


def make_sampler(params: SamplingParams, seed: int):
    """A sampler for one request; `seed` is used when the request sets none."""
    return greedy if params.greedy else RowSampler(params, seed)


class LogitAdjustments:
    """One row's logit bias, penalties and min_tokens, as a logits processor: called before
    each generated token with the row's tokens so far (its prompt, then what it generated),
    the generated ones last.

    - presence / frequency penalty (OpenAI): minus `presence` for every token generated at
      least once, minus `frequency` for each time it was generated;
    - repetition penalty (vLLM): a seen token's logit (prompt or generated) is divided by it
      when positive, multiplied when negative;
    - logit_bias: added to the token's logit;
    - min_tokens: end-of-sequence and stop token ids barred until that many were generated.
    """

    def __init__(self, params: SamplingParams, end_ids: tuple[int, ...]):
        self.params = params
        self.bias = None
        if params.logit_bias:
            # one entry a token ("1" and "01" name the same one): a logit gains their sum in
            # one addition, plain or speculating (a sum in two steps would round otherwise)
            merged: dict[int, float] = {}
            for token, value in params.logit_bias:
                merged[token] = merged.get(token, 0.0) + value
            self.bias = (mx.array(list(merged)), mx.array(list(merged.values()), mx.float32))
        self.ends = sorted({*end_ids, *params.stop_token_ids})
        self.end_ids = mx.array(self.ends)
        self.generated = 0  # tokens generated before this call

    @property
    def by_position(self) -> bool:
        """Whether what it does to a token's logits depends only on how many tokens came
        before it (logit bias, min_tokens), not on which (penalties): a speculative step can
        then apply it to every guessed position at once (`RowAdjustments`)."""
        p = self.params
        return p.repetition_penalty == 1 and not p.presence_penalty and not p.frequency_penalty

    def advance(self, n: int) -> None:
        """`n` tokens were chosen at once (a speculative step's kept guesses and the
        model's token after them)."""
        self.generated += n

    def _biased(self, logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        if self.bias is not None:
            logits = logits.at[:, self.bias[0]].add(self.bias[1])
        return logits

    def _barred(self, logits: mx.array, n: int) -> mx.array:
        """The end ids barred in the rows (consecutive tokens, the first with `n` generated
        before it) that come before min_tokens."""
        barred = min(logits.shape[0], max(0, self.params.min_tokens - n))
        if barred:
            logits[:barred, self.end_ids] = -mx.inf
        return logits

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        p = self.params
        n, self.generated = self.generated, self.generated + 1
        logits = self._biased(logits)
        if p.repetition_penalty != 1 and context.size:
            seen = logits[:, context]
            logits[:, context] = mx.where(seen > 0, seen / p.repetition_penalty,
                                          seen * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and n:
            mine = context[-n:]
            counts = mx.zeros((logits.shape[-1],), mx.float32).at[mine].add(1)
            logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        return self._barred(logits, n)


class RowAdjustments:
    """The logit bias and min_tokens of several rows (LogitAdjustments that go `by_position`),
    applied to all their rows and positions in a few operations, as each row's own calls would
    apply them one position at a time (a row's calls cost ~0.1 ms a row a step on the CPU, and
    ~2 ms a speculative step of 8 rows): a bias is added as a dense row (x + 0 is x; a token
    named twice gets its one sum), and end and stop ids are barred at the positions before a
    row's min_tokens (one operation where every row's positions are all before it, as in a
    long answer's draft guesses, or none where all are past it). The caller counts the tokens
    chosen (`LogitAdjustments.advance`)."""

    def __init__(self, processors: list[LogitAdjustments]):
        self.processors = processors
        self._dense: dict[int, tuple[mx.array | None, mx.array]] = {}  # vocab -> (bias, ends)

    def serves(self, processors: list) -> bool:
        return len(processors) == len(self.processors) and \
            all(a is b for a, b in zip(processors, self.processors, strict=True))

    def __call__(self, logits: mx.array, offset: int = 0) -> mx.array:
        """Float32 logits (rows, positions, vocab) of these rows, the first position `offset`
        tokens past the one each row's processor would be called for next."""
        bias, ends = self._rows(logits.shape[-1])
        logits = logits.astype(mx.float32)
        if bias is not None:
            logits = logits + bias[:, None]
        remaining = [p.params.min_tokens - p.generated - offset for p in self.processors]
        if max(remaining) <= 0:  # every row past its min_tokens: nothing barred
            return logits
        if min(remaining) >= logits.shape[1]:  # every position of every row before it
            return mx.where(ends[:, None], -mx.inf, logits)
        barred = mx.arange(logits.shape[1])[None] < mx.array(remaining)[:, None]
        return mx.where(barred[..., None] & ends[:, None], -mx.inf, logits)

    def _rows(self, vocab: int) -> tuple[mx.array | None, mx.array]:
        if vocab not in self._dense:
            rows = len(self.processors)
            marks = [(i, t) for i, p in enumerate(self.processors) for t in p.ends if t < vocab]
            ends = mx.zeros((rows, vocab), mx.bool_)
            if marks:
                r, t = zip(*marks, strict=True)
                ends[mx.array(r), mx.array(t)] = True
            bias = None
            if any(p.bias is not None for p in self.processors):
                bias = mx.zeros((rows, vocab), mx.float32)
                for i, p in enumerate(self.processors):
                    if p.bias is not None:
                        bias[i, p.bias[0]] = p.bias[1]
            self._dense[vocab] = (bias, ends)
        return self._dense[vocab]
