"""Per-request samplers whose randomness belongs to the request, not to the batch.

A seeded request draws step i's token with key i of a key sequence derived from its seed, so the
same row samples the same text whatever else shares its batch and whenever it is admitted.
Greedy requests share one sampler object, which lets mlx-lm sample a greedy batch in one call.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from batchrun.engine.request import SamplingParams


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
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias = (mx.array(ids), mx.array(values, dtype=mx.float32))
        self.end_ids = mx.array(sorted({*end_ids, *params.stop_token_ids}))
        self.generated = 0  # tokens generated before this call

    @property
    def by_position(self) -> bool:
        """Whether what it does to a token's logits depends only on how many tokens came
        before it (logit bias, min_tokens), not on which (penalties): a speculative step can
        then apply it to every guessed position at once (`at_positions`)."""
        p = self.params
        return p.repetition_penalty == 1 and not p.presence_penalty and not p.frequency_penalty

    def at_positions(self, logits: mx.array, offset: int = 0) -> mx.array:
        """`logits` (positions, vocab) of the row's next tokens, the first of them `offset`
        tokens past the one this processor would be called for next, adjusted as those calls
        would (`by_position` only; `advance` counts the ones used)."""
        return self._barred(self._biased(logits), self.generated + offset)

    def advance(self, n: int) -> None:
        """`n` tokens were chosen from `at_positions`' logits."""
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
