"""The decoding batch: mlx-lm's GenerationBatch with the per-row host work taken out of a step.

mlx-lm (pinned 0.32.2) keeps every row's log-probabilities as an array of its own: each step cuts
the (rows, vocab) matrix into one array per row and evaluates them all, samples row by row as soon
as two rows have different samplers, and cuts a copy of the KV cache out for every row that
finishes. Measured on the H200 with 1,024 rows of a 1B model, that host work took ~32 ms of a
~58 ms step while the model's own step took ~21 ms (benchmarks/history/BENCHMARKS-2026-12.md).

`LeanGenerationBatch` keeps the matrix whole and hands a row's log-probabilities only to the
requests that asked for them (`logprob_uids`), samples each group of rows sharing a sampler in
one call, applies logits processors only to the rows that have some (grammar masks for all
constrained rows in one parallel call, see constrain.py), and leaves a finished row's
cache alone (the engine cuts out the prefix blocks it stores itself). Tokens, stops and the
order of operations on the device are mlx-lm's, so outputs are identical.

With a `speculator` (speculate.py), a narrow batch's step verifies each row's proposed tokens in
one forward and hands out every token a row keeps. Such a step decides the next one at its end
and, when that one speculates, starts it on the device (`_verify`) before returning, so the
device runs while the host hands out this step's tokens, as plain steps overlap; a row joining,
leaving or having its cache read undoes it first (`_cancel_ahead`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, _extend_cache
from mlx_lm.models.cache import TokenBuffer

from batchrun.engine.decoding.constrain import GrammarProcessor
from batchrun.engine.decoding.sampling import LogitAdjustments, RowAdjustments, greedy
from batchrun.engine.decoding.speculate import Speculator, ngram_proposal, rollback
from batchrun.engine.postprocess import NOT_FINITE


def _broken(logprobs: mx.array) -> mx.array:
    """Per row, whether its log-probabilities are no distribution, judged by the first token's
    (NaN spreads over the row; an infinite normalizer makes it NaN or positive): no pass over
    the vocabulary."""
    return ~(logprobs[:, 0] < 1.0)


def _rows(broken: mx.array) -> set[int]:
    flags = np.asarray(broken)
    return set(np.flatnonzero(flags).tolist()) if flags.any() else set()


def _matrix(logprobs) -> mx.array | None:
    """mlx-lm's per-row list (from a freshly prefilled batch) as one matrix."""
    if isinstance(logprobs, list):
        return mx.stack(logprobs) if logprobs else None
    return logprobs


def _by_position(processors: list) -> bool:
    """Whether a row's logits processors let it speculate: none, or one LogitAdjustments that
    depends on positions only (logit bias, min_tokens)."""
    return not processors or (len(processors) == 1 and isinstance(processors[0], LogitAdjustments)
                              and processors[0].by_position)


@dataclass
class _Verification:
    """A speculative step's forward, started on the device: what finishing it needs (for the
    batch's rows as they were then: rows joining or leaving undo it first)."""
    width: int  # the positions it added to each row's cache (and to the draft's)
    pending: list[int]  # a row's
    current: mx.array  # the pending tokens' log-probabilities
    room: list[int]  # the proposals each row made
    drafts: mx.array  # (rows, width - 1)
    choices: mx.array  # (rows, width): the model's token at each position
    logprobs: mx.array  # (rows, width, vocab)
    adjusted: list[int]  # rows whose logit adjustments were applied at each position
    one_time_s: float
    dtype: mx.Dtype  # the tokens'


class LeanGenerationBatch(GenerationBatch):
    logprob_uids: set[int]  # rows whose Response carries their log-probabilities
    speculator: Speculator | None = None  # speculative decoding where the batch is narrow
    # The next step, decided at the end of a speculative one: started (the device verifies it
    # while the host hands out this step's tokens), or to run plainly. Rows joining or leaving
    # clear both.
    _ahead: _Verification | None = None
    _plain_next = False
    _adjustments: RowAdjustments | None = None  # the rows' logit bias and min_tokens, as one
    # Per row of _next_logprobs, whether it is no distribution (NaN; made with them, so reading
    # it costs no extra pass): None where rows joined or a speculative step made them.
    _next_broken: mx.array | None = None

    @classmethod
    def empty(cls, model, fallback_sampler, logprob_uids: set[int] | None = None):
        batch = super().empty(model, fallback_sampler)
        batch.logprob_uids = logprob_uids if logprob_uids is not None else set()
        return batch

    @classmethod
    def fresh(cls, model, uids: list[int], inputs: mx.array, prompt_cache: list, tokens: list,
              samplers: list, fallback_sampler, logits_processors: list, stop_sequences: list,
              max_tokens: list[int]) -> LeanGenerationBatch:
        """Freshly prefilled rows, their first step started: what mlx-lm's GenerationBatch
        does on creation, but only a row with logits processors gets the token buffer they
        read (mlx-lm copies every row's prompt into one: 18 ms for 510 rows of 1,800 tokens on
        this project's CPU), and the step keeps the log-probabilities as one matrix."""
        batch = cls.__new__(cls)
        batch.model, batch.uids, batch.prompt_cache, batch.tokens = model, uids, prompt_cache, \
            tokens
        batch.samplers, batch.fallback_sampler = samplers, fallback_sampler
        batch.logits_processors, batch.stop_sequences = logits_processors, stop_sequences
        batch.max_tokens = max_tokens
        batch.logprob_uids = set()  # the batch these rows join decides
        batch._current_tokens, batch._current_logprobs = None, []
        batch._next_tokens, batch._next_logprobs = inputs, []
        batch._token_context = [TokenBuffer(t) if p else None
                                for t, p in zip(tokens, logits_processors, strict=True)]
        batch._num_tokens = [0] * len(uids)
        batch._matchers = [ss.matcher() for ss in stop_sequences]
        if uids:
            batch._step()
        return batch

    def extend(self, batch: GenerationBatch) -> None:
        """Append a freshly prefilled batch (mlx-lm's own class) to this one."""
        self._cancel_ahead()
        self.uids.extend(batch.uids)
        self.prompt_cache = _extend_cache(self.prompt_cache, batch.prompt_cache)
        self.tokens.extend(batch.tokens)
        self.samplers.extend(batch.samplers)
        self.logits_processors.extend(batch.logits_processors)
        self.max_tokens.extend(batch.max_tokens)
        self.stop_sequences.extend(batch.stop_sequences)
        self._token_context.extend(batch._token_context)
        self._num_tokens.extend(batch._num_tokens)
        self._matchers.extend(batch._matchers)
        self._next_broken = None
        mine, theirs = _matrix(self._next_logprobs), _matrix(batch._next_logprobs)
        if mine is None or self._next_tokens is None or self._next_tokens.size == 0:
            self._next_tokens, self._next_logprobs = batch._next_tokens, theirs
        elif theirs is not None:
            self._next_tokens = mx.concatenate([self._next_tokens, batch._next_tokens])
            self._next_logprobs = mx.concatenate([mine, theirs])

    def filter(self, keep: list[int]) -> None:
        """Keep only the rows at the `keep` positions."""
        self._cancel_ahead()
        for name in ("uids", "tokens", "samplers", "logits_processors", "max_tokens",
                     "stop_sequences", "_token_context", "_num_tokens", "_matchers"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])
        if not keep:
            self.prompt_cache.clear()
            self._next_tokens, self._next_logprobs, self._next_broken = None, None, None
            return
        for c in self.prompt_cache:
            c.filter(keep)
        index = mx.array(keep)
        self._next_tokens = self._next_tokens[index]
        self._next_logprobs = _matrix(self._next_logprobs)[index]
        if self._next_broken is not None:
            self._next_broken = self._next_broken[index]

    def _step(self) -> tuple[list[int], mx.array]:
        """Start the next step on the device; return the tokens (and logprobs) of this one."""
        inputs, current = self._next_tokens, _matrix(self._next_logprobs)
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        contexts = []
        if any(self.logits_processors):
            # Start this step's forward pass now: the grammar masks need the tokens of the
            # step before, and are computed on the host while the device runs the model.
            mx.async_eval(logits)
            logits, contexts = self._process(logits, inputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        broken = self._next_broken if self._next_broken is not None or current is None \
            else _broken(current)
        self._next_tokens = self._sample(logprobs)
        self._next_logprobs = logprobs
        self._next_broken = _broken(logprobs)
        mx.async_eval(self._next_tokens, logprobs, self._next_broken, contexts)
        mx.eval(inputs, current, broken)
        self._not_finite = set() if broken is None else _rows(broken)
        tokens = inputs.tolist()
        for row, token in zip(self.tokens, tokens, strict=True):
            row.append(token)
        return tokens, current

    def _process(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """Apply the rows' logits processors: a logit bias and min_tokens (alone in a row) for
        all such rows at once, grammar rows all at once, and any other processor (penalties,
        thinking budgets) on its row only."""
        rows, processed, contexts = [], [], []
        grammar_rows, grammars, positional = [], [], []
        tokens = None
        for e, processors in enumerate(self.logits_processors):
            if not processors:
                continue
            if _by_position(processors):  # they need no context
                positional.append(e)
                continue
            others = [p for p in processors if not isinstance(p, GrammarProcessor)]
            if others:
                context = self._token_context[e].update_and_fetch(inputs[e: e + 1])
                contexts.append(context)
                row = logits[e: e + 1]
                for processor in others:
                    row = processor(context, row)
                rows.append(e)
                processed.append(row)
            if len(others) < len(processors):
                if tokens is None:
                    tokens = inputs.tolist()  # the grammar needs the token sampled last
                grammar = next(p for p in processors if isinstance(p, GrammarProcessor))
                grammar.advance(tokens[e])
                grammar_rows.append(e)
                grammars.append(grammar)
        if positional:  # as a speculative step adjusts them, at one position
            logits = self._adjuster(positional)(logits[:, None], 0)[:, 0]
            for i in positional:
                self.logits_processors[i][0].advance(1)
        if rows:
            logits[mx.array(rows)] = mx.concatenate(processed).astype(logits.dtype)
        if grammars:
            index = mx.array(grammar_rows)
            logits[index] = grammars[0].grammars.mask_rows(logits[index], grammars)
        return logits, contexts

    def _sample(self, logprobs: mx.array) -> mx.array:
        """One sampler call per group of rows sharing a sampler (one call for a greedy batch)."""
        samplers = [s or self.fallback_sampler for s in self.samplers] or [self.fallback_sampler]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logprobs)
        groups: dict[int, tuple] = {}
        for e, s in enumerate(samplers):
            groups.setdefault(id(s), (s, []))[1].append(e)
        order, parts = [], []
        for sampler, rows in groups.values():
            order.extend(rows)
            parts.append(sampler(logprobs[mx.array(rows)]).reshape(-1))
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return mx.concatenate(parts)[mx.array(inverse)]

    def extract_cache(self, idx: int) -> list:
        self._cancel_ahead()
        return super().extract_cache(idx)

    def _cancel_ahead(self) -> None:
        """Undo a verification started ahead (rows are about to join, leave or be read): its
        positions leave every row's cache and the draft's."""
        ahead, self._ahead, self._plain_next = self._ahead, None, False
        if ahead is None:
            return
        for c in self.prompt_cache:
            c.trim(ahead.width)
        if self.speculator.method == "draft":
            self.speculator.draft.rollback([ahead.width] * len(ahead.pending))

    def _wants(self, spec: Speculator) -> bool:
        return spec.wants(len(self.uids), self.prompt_cache,
                          allowed=lambda: all(map(_by_position, self.logits_processors))
                          and any(self._room(1)) and min(map(len, self.tokens)) > 1)

    def next(self) -> list[GenerationBatch.Response]:
        if not self.uids:
            return []
        spec = self.speculator
        rows = len(self.uids)
        ahead, plain_next = self._ahead, self._plain_next
        self._ahead, self._plain_next = None, False
        if ahead is not None:  # rows joining, leaving or read since would have undone it
            speculating = True
        elif plain_next:
            speculating = False
        else:
            speculating = spec is not None and self._wants(spec)
        one_time_s = 0.0
        if speculating:
            emitted, logprobs, one_time_s = self._finish(spec, ahead or self._verify(spec))
            broken: set[int] = set()
        else:
            tokens, logprobs = self._step()
            emitted = [[t] for t in tokens]
            broken = self._not_finite
        if spec is not None:
            spec.step(speculating, rows, sum(map(len, emitted)) if speculating else rows,
                      one_time_s)
        keep, responses = [], []
        wanted = self.logprob_uids
        for i, (uid, tokens) in enumerate(zip(self.uids, emitted, strict=True)):
            reason = None
            for n, token in enumerate(tokens):
                self._num_tokens[i] += 1
                reason = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
                if self._matchers[i].advance(token):
                    reason = "stop"
                if i in broken:
                    reason = NOT_FINITE  # the token came from no distribution: the row fails
                responses.append(self.Response(
                    uid=uid, token=token,
                    logprobs=logprobs[i] if n == 0 and uid in wanted else None,
                    finish_reason=reason, prompt_cache=None,
                    all_tokens=self.tokens[i] if reason else None))
                if reason is not None:
                    break
            if reason is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        if speculating and self.uids:  # decide the next step now; start it if it speculates
            if self._wants(spec):
                self._ahead = self._verify(spec)
            else:
                self._plain_next = True
        return responses

    def _room(self, k: int) -> list[int]:
        """The tokens each row may guess past its pending one, at most `k`: none for a row that
        reports log-probabilities or has one token to go."""
        return [0 if uid in self.logprob_uids else
                max(0, min(k, self.max_tokens[i] - self._num_tokens[i] - 1))
                for i, uid in enumerate(self.uids)]

    def _verify(self, spec: Speculator) -> _Verification:
        """Start a speculative step on the device: each row's pending token, then its
        proposals, in one forward of the model (and, for a draft, the draft's forwards that
        propose them), each position's choice of the model computed."""
        inputs, current = self._next_tokens, _matrix(self._next_logprobs)
        pending = inputs.tolist()
        rows, k = len(self.uids), spec.k
        room = self._room(k)
        choose = self._chooser()
        adjusted = [i for i, p in enumerate(self.logits_processors) if p]
        adjust = self._adjuster(adjusted) if adjusted else None
        one_time_s = 0.0
        if spec.method == "draft":
            start = time.perf_counter()
            if spec.draft.sync(self.uids, self.tokens):
                one_time_s = time.perf_counter() - start
            drafts = spec.draft.propose([t[-1] for t in self.tokens], inputs, k, choose, adjust)
        else:
            guesses = []
            for i in range(rows):
                guess = ngram_proposal(np.asarray(self.tokens[i] + [pending[i]]), room[i]) \
                    if room[i] else []
                room[i] = len(guess)
                guesses.append(guess)
            # verify as many positions as the longest guess: none where no row found a match
            # (the start of an answer), and then the step costs what a plain one does
            k = max(room)
            drafts = mx.array([g + [0] * (k - len(g)) for g in guesses], dtype=inputs.dtype
                              ).reshape(rows, k)
        logits = self.model(mx.concatenate([inputs[:, None], drafts], axis=1),
                            cache=self.prompt_cache)
        if adjust is not None:  # logit bias, min_tokens: what each position's call would do
            logits = adjust(logits, 0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (rows, k + 1, V)
        if choose.greedy:  # every position's argmax in one operation, not one per position
            choices = mx.argmax(logprobs, axis=-1)
        else:
            choices = mx.stack([choose(logprobs[:, j], j) for j in range(k + 1)], axis=1)
        mx.async_eval(choices, drafts)
        return _Verification(k + 1, pending, current, room, drafts, choices, logprobs, adjusted,
                             one_time_s, inputs.dtype)

    def _adjuster(self, adjusted: list[int]) -> Callable[[mx.array, int], mx.array]:
        """Logits (rows, positions, vocab) of each row's tokens from `offset` past its pending
        one, with the logit bias and min_tokens of the `adjusted` rows applied as plain
        decoding's calls there would: the verification's, the draft's guesses (a draft
        guessing without them loses guesses), and a plain step's (`_process`)."""
        index, rows = mx.array(adjusted), self._row_adjustments(adjusted)
        every = adjusted == list(range(len(self.logits_processors)))

        def adjust(logits: mx.array, offset: int) -> mx.array:
            if every:  # no rows to pick out and put back
                return rows(logits, offset).astype(logits.dtype)
            logits[index] = rows(logits[index], offset).astype(logits.dtype)
            return logits
        return adjust

    def _row_adjustments(self, rows: list[int]) -> RowAdjustments:
        """The rows' LogitAdjustments as one (kept from step to step while the rows stay)."""
        processors = [self.logits_processors[i][0] for i in rows]
        if self._adjustments is None or not self._adjustments.serves(processors):
            self._adjustments = RowAdjustments(processors)
        return self._adjustments

    def _chooser(self) -> Callable[[mx.array, int], mx.array]:
        """The rows' choice at a position (below), with each row's sampler as it stands; its
        `greedy` says whether every row's is the argmax (then the choices at several positions
        are one argmax, and a draft may pick from its logits unnormalized: the same argmax but
        where rounding ties two tokens)."""
        samplers = [s or self.fallback_sampler for s in self.samplers]
        sampled = [i for i, s in enumerate(samplers) if s is not greedy]

        def choose(logprobs: mx.array, offset: int) -> mx.array:
            """The model's (or the draft's) token at each row's position `offset` past its
            pending one: the argmax, or a sampled row's pick under that position's noise."""
            out = mx.argmax(logprobs, axis=-1)
            if sampled:
                index = mx.array(sampled)
                out[index] = mx.concatenate([samplers[i].at(logprobs[i: i + 1],
                                                            [samplers[i].position + offset])
                                             for i in sampled])
            return out
        choose.greedy = not sampled
        return choose

    def _finish(self, spec: Speculator, v: _Verification) -> tuple[list[list[int]], mx.array,
                                                                      float]:
        """Finish a speculative step: (each row's tokens this step: the pending one and the
        proposals it keeps, the pending tokens' log-probabilities, the seconds it spent
        bringing the draft's cache up to the batch: not the step's own cost). The token the
        model chose after the last kept proposal is the row's next pending one, and the KV of
        the proposals it did not keep is dropped."""
        rows, k, room, pending = len(v.pending), v.width - 1, v.room, v.pending
        chosen, proposed = v.choices.tolist(), v.drafts.tolist()
        kept = []
        for i in range(rows):
            n = 0
            while n < room[i] and proposed[i][n] == chosen[i][n]:
                n += 1
            kept.append(n)
        drop = [k - n for n in kept]
        rollback(self.prompt_cache, drop, [uid in self.logprob_uids for uid in self.uids])
        if spec.method == "draft":
            spec.draft.rollback(drop)
        for i in v.adjusted:  # positions 0 .. kept chose tokens (the last one the next pending)
            self.logits_processors[i][0].advance(kept[i] + 1)
        emitted = [[pending[i], *proposed[i][:n]] for i, n in enumerate(kept)]
        for i, tokens in enumerate(emitted):
            self.tokens[i].extend(tokens)  # what the cache holds
        samplers = [s or self.fallback_sampler for s in self.samplers]
        for i, sampler in enumerate(samplers):
            if sampler is not greedy:
                sampler.position += kept[i] + 1
        self._next_tokens = mx.array([chosen[i][n] for i, n in enumerate(kept)],
                                     dtype=v.dtype)
        self._next_logprobs = v.logprobs[mx.arange(rows), mx.array(kept)]
        self._next_broken = None
        # the rollback's moves too: the device makes them while the host hands out the tokens
        caches = self.prompt_cache + (spec.draft.caches if spec.method == "draft" else [])
        mx.async_eval(self._next_tokens, self._next_logprobs,
                      [(c.keys, c.values) for c in caches])
        spec.record(sum(room), sum(kept))
        return emitted, v.current, v.one_time_s


class LeanPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch, whose prefilled rows go on as a LeanGenerationBatch made directly
    instead of mlx-lm's own (made, stepped once, then merged into the lean batch)."""

    def generate(self, tokens: list[list[int]]) -> LeanGenerationBatch:
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        batch = LeanGenerationBatch.fresh(
            self.model, self.uids, mx.array([t[-1] for t in tokens]), self.prompt_cache,
            self.tokens, self.samplers, self.fallback_sampler, self.logits_processors,
            self.stop_sequences, self.max_tokens)
        self.uids, self.prompt_cache, self.tokens, self.samplers = [], [], [], []
        self.logits_processors, self.max_tokens, self.stop_sequences = [], [], []
        return batch
