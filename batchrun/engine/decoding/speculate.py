"""Speculative decoding in the continuous batch, where the batch is narrow.

A decode step of a narrow batch reads all the model's weights for a few tokens; checking a few
guessed tokens per row costs about the same. So while few rows run (the tail of a job, a job of
few long rows), each speculating row proposes up to `k` tokens past its pending one:

- `ngram`: the tokens that followed the latest earlier occurrence of the row's last 2-3 tokens
  in its own prompt and output (prompt lookup: answers that copy spans of the prompt);
- `draft`: a small model sharing the target's tokenizer, run ahead `k` tokens on its own batch
  cache (`DraftModel`).

One forward of the target over every row's pending token and proposals verifies them all
(`LeanGenerationBatch._verify`, started before the step before returns when that one
speculated too, and `_finish`; n-gram rows are verified as far as the longest
proposal reaches, so a step where no row found a match is a plain step's forward). A row keeps
its proposals up to the first one the target would not have chosen, plus the target's own token
there; the KV of the rest is dropped from its cache (`rollback`). The target's choice at each
position is the one plain decoding makes: the greedy argmax, or for a sampled row the draw with
that row's key for that position (sampling.RowSampler: a Gumbel-max draw), so greedy and seeded
output are the same with and without speculation, and a sampled row keeps its distribution. A
draft model proposes under the same keys, which is what makes its guesses of a sampled row's
tokens good ones.

Rows that report log-probabilities, or have a token to go, propose nothing; a batch holding a
row with logits processors that look at the tokens (penalties, grammars, thinking budgets), or
none that may propose, decodes plainly (logit bias and min_tokens depend on positions only: a
verification applies them at each guessed position, and a draft guesses with them);
architectures whose caches cannot be cut back (sliding windows, recurrent state) do not
speculate, and the log says so once. A draft's KV cache is not counted in the engine's memory
budget (a draft is meant to be small).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from batchrun.engine.config import DEFAULT_DRAFT_TOKENS
from batchrun.engine.stats import SpeculationStats

log = logging.getLogger("batchrun")

METHODS = ("off", "ngram", "draft")
NGRAM_LONGEST = 3  # the longest suffix matched first, down to NGRAM_SHORTEST tokens
# Rows x (k + 1) tokens a verification forward may hold: below it a step's cost is mostly the
# weights' read (or, on a CPU with a small model, the per-call overhead), so checking k guesses
# costs about as much as decoding one token. Wider batches decode plainly.
VERIFY_TOKENS = {"cpu": 64, "gpu": 256}
# Whether a narrow batch speculates is measured: the seconds a row's token took in recent steps
# of each kind at each batch width (widths pooled by powers of two; exponential averages, this
# weight on the newest); the cheaper kind runs, and the other is tried again PROBE_EVERY steps
# later, then twice as long after each try that lost, up to PROBE_EVERY_MOST (measured on this
# CPU: a speculative step that loses costs ~4 plain steps, and a probe every 32 steps cost a
# 256-token job of rows the draft guesses badly ~10%).
COST_WEIGHT = 0.3
PROBE_EVERY = 32
PROBE_EVERY_MOST = 256
MARGIN = 0.05  # speculating must measure this much cheaper a token to go on
NGRAM_SHORTEST = 2  # a single matching token guesses too often to pay
TRIMMABLE = (BatchKVCache,)


def ngram_proposal(context: np.ndarray, k: int, longest: int = NGRAM_LONGEST,
                   shortest: int = NGRAM_SHORTEST) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the context's last n
    tokens (n from `longest` down to `shortest`); none without one."""
    size = len(context)
    for n in range(min(longest, size - 1), shortest - 1, -1):
        tail = context[size - n:]
        # starts of earlier occurrences: every position whose n tokens equal the tail and that
        # is followed by at least one token before the tail itself
        hits = np.flatnonzero(context[: size - n] == tail[0])
        for j in range(1, n):
            hits = hits[context[hits + j] == tail[j]]
        if hits.size:
            start = int(hits[-1]) + n
            return context[start: start + k].tolist()
    return []


def speculates(caches: list) -> bool:
    """Whether every layer's batch cache can drop a row's last tokens."""
    return all(isinstance(c, TRIMMABLE) for c in caches)


def rollback(caches: list, drop: list[int], ordered: list[bool] | None = None) -> None:
    """Drop each row's last `drop[i]` tokens from every layer's batch cache: all rows cut back
    by the least of them (`trim`), then each row's `e` extra dropped slots at the end are
    filled with its first `e` kept keys and values, and its left padding grows by `e` (its
    RoPE offset falls by `e`): the row's kept KV ends where every row's does, as a batch cache
    needs. That moves at most `e` slots a row, where rolling the row's whole KV right (mlx-lm's
    right-padding `finalize`) moved them all: 14.2 ms for 6 layers of 8 rows at 256 slots on
    this 2-core CPU (benchmarks/history/scripts/probe_speculation.py costs). The kept keys are no
    longer in token order within the row, which attention does not see (each key carries its
    position's rotation; the mask is each row's range): a speculating batch's KV is never
    stored as prefix blocks. Rows `ordered` marks (a choices row's KV is read in token order to
    score its choices, choices.py) keep their order: when one of them drops more than the
    least, every row rolls as before."""
    least = min(drop)
    extra = [d - least for d in drop]
    for c in caches:
        if least:
            c.trim(least)
    if not any(extra):
        return
    if ordered and any(o and e for o, e in zip(ordered, extra, strict=True)):
        for c in caches:
            c.prepare(right_padding=extra)
            c.finalize()
        return
    end = caches[0]._idx
    rows, src, dst = [], [], []
    for row, (start, e) in enumerate(zip(caches[0].left_padding.tolist(), extra, strict=True)):
        moved = min(e, end - e - start)  # a row keeps at least one token
        rows += [row] * moved
        src += range(start, start + moved)
        dst += range(end - moved, end)
    rows, src, dst = mx.array(rows), mx.array(src), mx.array(dst)
    grown = mx.array(extra)
    for c in caches:
        c.keys[rows, :, dst] = c.keys[rows, :, src]
        c.values[rows, :, dst] = c.values[rows, :, src]
        c.left_padding = c.left_padding + grown
        c.offset = c.offset - grown


class DraftCache(BatchKVCache):
    """The draft's batch cache: a guess's forward (one token a row) takes its mask as one
    comparison of the rows' starts with the key positions, where mlx-lm's builds the causal
    part too (all true for one query) in ~5 operations; a draft's forward is mostly
    per-operation cost, 6 of them a speculative step. Other calls are mlx-lm's."""

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if N != 1 or kwargs.get("window_size") is not None:
            return super().make_mask(N, return_array=return_array, **kwargs)
        return self.left_padding[:, None, None, None] <= mx.arange(self._idx + 1)


COMPILE_DRAFT = True  # whether a draft's guesses run compiled (CompiledForward)
CAPACITY_STEP = 256  # a compiled draft forward's cache capacity grows in these (one trace each)


def _last_logits(model, tokens: mx.array, cache: list, vocab: int | None) -> mx.array:
    """The model's logits at each row's last position (rows, vocab), in float32: a guess's."""
    return model(tokens, cache=cache)[:, -1, :vocab].astype(mx.float32)


class _Slot:
    """One layer's draft cache as the compiled forward (`CompiledForward`) sees it: the whole
    buffer of keys and values, the rows' starts and RoPE offsets, and the slot the step's first
    token takes (`at`, an array: the same trace serves every position). A step's keys and values
    go in at `at` (a dynamic slice update), and attention reads the whole buffer under a mask of
    each row's keys, from its start to the query's own position."""

    def __init__(self, keys, values, at, left_padding, offset):
        self.keys, self.values, self.at = keys, values, at
        self.left_padding, self.offset = left_padding, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.at, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.at, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, **kwargs) -> mx.array:
        position = mx.arange(self.keys.shape[2])
        last = self.at + mx.arange(N)[:, None]  # (N, 1): each query's own position
        return (self.left_padding[:, None, None, None] <= position) & (position <= last)


class CompiledForward:
    """The draft's forward of a step's tokens as one compiled graph (mx.compile) over its batch
    caches' buffers: the model's own code, traced once for each (rows, tokens, capacity) with a
    cache (`_Slot`) that writes at a slot given as an array and masks the rest of the buffer.
    A draft's forward is mostly the cost of its many small operations (the guesses of a step
    are k forwards one after another); compiled, its elementwise ones run fused (the mask, the
    norms, the rotary embedding on a CPU), and the host re-encodes a recorded graph instead of
    running the model's Python. Capacities grow by CAPACITY_STEP, so a job traces a few."""

    def __init__(self, model, vocab: int | None):
        self.model, self.vocab = model, vocab
        self._forward = mx.compile(self._graph)

    def _graph(self, tokens, at, left_padding, offset, *buffers):
        slots = [_Slot(buffers[i], buffers[i + 1], at, left_padding, offset)
                 for i in range(0, len(buffers), 2)]
        logits = _last_logits(self.model, tokens, slots, self.vocab)
        return (logits, *(a for s in slots for a in (s.keys, s.values)))

    def __call__(self, tokens: mx.array, caches: list[BatchKVCache]) -> mx.array:
        """The last position's logits (rows, vocab) in float32, the caches advanced by the
        tokens (rows, n) as a forward of the model over them would."""
        n = tokens.shape[1]
        reserve(caches, caches[0]._idx + n)
        first = caches[0]
        out = self._forward(tokens, mx.array([first._idx]), first.left_padding, first.offset,
                            *(a for c in caches for a in (c.keys, c.values)))
        for i, c in enumerate(caches):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c._idx += n
            c.offset = c.offset + n
        return out[0]

    def works(self, layers: int) -> bool:
        """Whether the model traces with the compiled forward's cache and gives what its own
        forward gives (an architecture that reads its cache otherwise does not), within the
        rounding a fused half-precision operation may differ by."""
        try:
            tokens = mx.array([[1, 2, 3, 4]])
            mine, theirs = ([DraftCache([1]) for _ in range(layers)] for _ in range(2))
            self.model(tokens[:, :3], cache=mine)
            self.model(tokens[:, :3], cache=theirs)
            got = self(tokens[:, 3:], mine)
            want = self.model(tokens[:, 3:], cache=theirs)[:, -1, : self.vocab]
            tolerance = (1e-3 if want.dtype == mx.float32 else 2e-2) * (
                1 + mx.abs(want).max().item())
            want = want.astype(mx.float32)
            if mx.abs(got - want).max().item() <= tolerance:
                return True
            log.info("the draft model's compiled forward differs from its own: drafting "
                     "uncompiled")
            return False
        except Exception as e:  # noqa: BLE001 (any failure means: draft uncompiled)
            log.info("the draft model's forward does not compile (%s: %s): drafting uncompiled",
                     type(e).__name__, e)
            return False


def reserve(caches: list[BatchKVCache], slots: int) -> None:
    """Make each batch cache's buffer hold at least `slots` positions, its capacity a multiple
    of CAPACITY_STEP (a filter cuts a buffer's front, leaving any size)."""
    size = caches[0].keys.shape[2]
    want = max(size, slots)
    want = -(-want // CAPACITY_STEP) * CAPACITY_STEP
    if want == size:
        return
    for c in caches:
        pad = [(0, 0), (0, 0), (0, want - size), (0, 0)]
        c.keys, c.values = mx.pad(c.keys, pad), mx.pad(c.values, pad)


class DraftModel:
    """A small model proposing tokens for the rows of a batch, on a batch cache of its own that
    follows the batch's rows (by uid): rows that left are filtered out, rows that joined are
    prefilled from the tokens in the target's cache, and rows that decoded without it (steps
    that did not speculate) catch up on the tokens they missed.

    The cache holds a row's tokens in the target's cache but the last (`seen`): a step's first
    forward takes that token and the pending one, so k proposals cost k forwards, and after
    the verification each row drops what the target's cache drops (the proposals it did not
    keep; its last kept token is the next step's first)."""

    def __init__(self, model, prefill_step: int = 512, vocab: int | None = None,
                 compiled: bool | None = None):
        self.model = model
        self.vocab = vocab  # the target's token ids: a wider draft's guesses stay below
        self.prefill_step = prefill_step
        self.caches: list[BatchKVCache] | None = None
        self.uids: list[int] = []
        self.seen: list[int] = []  # tokens each row's cache holds: its context's but the last
        caches = make_prompt_cache(model)
        self.usable = all(type(c) is KVCache for c in caches)
        self._layers = len(caches)
        if compiled is None:
            compiled = COMPILE_DRAFT
        self.compiled = CompiledForward(model, vocab) if compiled and self.usable else None
        if self.compiled is not None and not self.compiled.works(self._layers):
            self.compiled = None

    def sync(self, uids: list[int], contexts: list[list[int]]) -> bool:
        """Make the cache's rows the batch's `uids` (in order), each holding `contexts[i]`
        (the tokens in the target's cache for row i, at least 2) but its last token. Whether
        the draft computed anything for it (rows prefilled, or fed the tokens of steps that did
        not speculate: a one-time cost, not the speculating step's; evaluated here, so the
        caller can time it apart)."""
        now = set(uids)
        keep = [i for i, u in enumerate(self.uids) if u in now]
        if len(keep) < len(self.uids):
            if keep:
                for c in self.caches:
                    c.filter(keep)
            else:
                self.caches = None
            self.uids = [self.uids[i] for i in keep]
            self.seen = [self.seen[i] for i in keep]
        have = set(self.uids)
        new = [i for i, u in enumerate(uids) if u not in have]
        if self.uids + [uids[i] for i in new] != uids:  # an order this cache cannot follow
            self.reset()
            new = list(range(len(uids)))
        worked = bool(self.uids) and self._catch_up(contexts[: len(self.uids)])
        if new:
            caches = self._prefill([contexts[i] for i in new])
            if self.caches is None:
                self.caches = caches
            else:
                for mine, theirs in zip(self.caches, caches, strict=True):
                    mine.extend(theirs)
            self.uids = self.uids + [uids[i] for i in new]
            self.seen = self.seen + [len(contexts[i]) - 1 for i in new]
        if worked or new:
            mx.eval([c.state for c in self.caches])
        return worked or bool(new)

    def _catch_up(self, contexts: list[list[int]]) -> bool:
        """Feed the rows the tokens their target cache gained without the draft (the same
        number for every row: the steps that did not speculate), or rebuild the rows' cache;
        whether there was anything to do."""
        behind = {len(c) - 1 - n for c, n in zip(contexts, self.seen, strict=True)}
        if behind == {0}:
            return False
        if len(behind) == 1 and min(behind) > 0:
            m = behind.pop()
            tokens = mx.array([c[-m - 1: -1] for c in contexts])
            for start in range(0, m, self.prefill_step):
                self.model(tokens[:, start: start + self.prefill_step], cache=self.caches)
            self.seen = [len(c) - 1 for c in contexts]
            return True
        uids = self.uids
        self.reset()
        self.caches = self._prefill(contexts)
        self.uids, self.seen = list(uids), [len(c) - 1 for c in contexts]
        return True

    def _prefill(self, contexts: list[list[int]]) -> list[BatchKVCache]:
        """A batch cache of the contexts but their last tokens."""
        contexts = [c[:-1] for c in contexts]
        longest = max(map(len, contexts))
        padding = [longest - len(c) for c in contexts]
        tokens = mx.array([[0] * p + c for p, c in zip(padding, contexts, strict=True)])
        caches = [DraftCache(padding) for _ in range(self._layers)]
        for start in range(0, longest, self.prefill_step):
            self.model(tokens[:, start: start + self.prefill_step], cache=caches)
            mx.eval([c.state for c in caches])
        return caches

    def propose(self, last: list[int], pending: mx.array, k: int, pick, adjust=None
                ) -> mx.array:
        """(rows, k) proposals after each row's `pending` token: the draft's choice at each
        position (`pick(logprobs, j)` for the j-th proposal, of the logits `adjust(logits, j)`
        makes of them, (rows, 1, vocab), when given: the rows' logit bias and min_tokens; a
        `pick` whose `greedy` is true, an argmax, takes the logits unnormalized), fed
        back in turn, the first
        forward taking each row's `last` token in the target's cache (the one this cache lacks)
        and its pending one. Each forward starts on the device as soon as it is built, so the
        host builds the next one (and then the verification) while the device runs it."""
        x = mx.concatenate([mx.array(last, dtype=pending.dtype)[:, None], pending[:, None]],
                           axis=1)
        out = []
        for j in range(k):
            logits = self.compiled(x, self.caches) if self.compiled is not None else \
                _last_logits(self.model, x, self.caches, self.vocab)
            if adjust is not None:
                short = (self.vocab or 0) - logits.shape[-1]
                if short > 0:  # the ids a bias or a stop may name, past the draft's: never guessed
                    logits = mx.pad(logits, [(0, 0), (0, short)], constant_values=-mx.inf)
                logits = adjust(logits[:, None], j)[:, 0]
            if not getattr(pick, "greedy", False):  # a sampler reads log-probabilities
                logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = pick(logits, j)
            mx.async_eval(token)
            out.append(token)
            x = token[:, None]
        self.seen = [n + k + 1 for n in self.seen]
        return mx.stack(out, axis=1)

    def rollback(self, drop: list[int]) -> None:
        rollback(self.caches, drop)
        self.seen = [n - d for n, d in zip(self.seen, drop, strict=True)]

    def reset(self) -> None:
        self.caches, self.uids, self.seen = None, [], []


class Speculator:
    """What a batch needs to speculate: the method, the guesses a row, the batch width from
    which it never does, and the measured cost of each kind of step at each narrower width."""

    def __init__(self, method: str, k: int = DEFAULT_DRAFT_TOKENS, draft: DraftModel | None = None,
                 verify_tokens: int | None = None):
        if method not in METHODS or method == "off":
            raise ValueError(f"unknown speculation method {method!r}")
        if method == "draft" and draft is None:
            raise ValueError("draft speculation needs a draft model")
        self.method, self.k, self.draft = method, k, draft
        if verify_tokens is None:
            verify_tokens = VERIFY_TOKENS["cpu" if mx.default_device() == mx.cpu else "gpu"]
        self.max_rows = max(1, verify_tokens // (k + 1))
        self.stats = SpeculationStats()
        self.adaptive = True  # False: every narrow batch speculates, measured or not (tests)
        self._cost: dict[tuple[bool, int], float] = {}  # (speculated, width) -> s a token
        # The step before: its start, kind, rows, tokens, seconds of one-time work, and whether
        # it was a probe (the kind not running, tried again).
        self._step: tuple[float, bool, int, int, float, bool] | None = None
        self._started = 0.0
        self._probing = False
        self._void = False  # the step under way shares its time with other work
        self._since_probe = 0
        self._probe_every: dict[int, int] = {}  # width -> steps between tries (PROBE_EVERY)
        self._refused = False

    def wants(self, rows: int, caches: list, allowed: Callable[[], bool] = lambda: True
              ) -> bool:
        """Whether the step starting now speculates: a narrow batch (then `allowed()`, asked
        only of a narrow one: no row's logits are processed in a way a guess cannot follow),
        caches that can be cut back, and speculating measured (or still to be measured) cheaper
        a token than not. Called at the start of every step: the step before is timed until
        now."""
        now = time.perf_counter()
        self._close_step(now)
        self._started, self._probing, self._void = now, False, False
        if rows > self.max_rows or not allowed():  # a wide batch's rows are not looked at
            return False
        if not speculates(caches):
            if not self._refused:
                self._refused = True
                log.warning("this model's KV cache cannot drop tokens (a sliding window or "
                            "recurrent state): no speculative decoding")
            return False
        if not self.adaptive:
            return True
        width = _width(rows)
        spec, plain = self._cost.get((True, width)), self._cost.get((False, width))
        if spec is None and plain is None:  # a width not measured yet
            return self._inherited(width)
        if spec is None:  # plain steps measured: now the other kind
            return True
        cheaper = plain is None or spec < plain * (1 - MARGIN)
        self._since_probe += 1
        if self._since_probe >= self._probe_every.get(width, PROBE_EVERY):
            self._since_probe, self._probing = 0, True
            return not cheaper  # try the kind not running
        return cheaper

    def _inherited(self, width: int) -> bool:
        """For a width not measured yet, what the nearest wider width measured (a narrower
        batch gains more from speculating, not less); plain steps first (the yardstick) when
        none has been."""
        for w in sorted({w for _, w in self._cost if w > width}):
            spec, plain = self._cost.get((True, w)), self._cost.get((False, w))
            if spec is not None and plain is not None:
                return spec < plain * (1 - MARGIN)
        return False

    def step(self, speculated: bool, rows: int, tokens: int, one_time_s: float = 0.0) -> None:
        """The step that started at the last `wants` made `tokens` tokens for `rows` rows,
        `one_time_s` of its time spent on work that is not the step's own (bringing the draft's
        cache up to the batch after steps that did not speculate, or prefilling new rows)."""
        self._step = None if self._void else \
            (self._started, speculated, rows, tokens, one_time_s, self._probing)
        self._void = False

    def discard(self) -> None:
        """The last step shares its time with other work (rows admitted, prompts prefilled
        before the next step starts): not a measure of its kind; nor is the step under way
        when a speculative step decided it at its end (its time runs from then). A probe that
        measured nothing neither wins nor backs off."""
        self._step, self._void = None, True

    def _close_step(self, now: float) -> None:
        if self._step is None:
            return
        start, speculated, rows, tokens, one_time_s, probe = self._step
        self._step = None
        if rows > self.max_rows or not tokens:
            return
        cost = max(0.0, now - start - one_time_s) / tokens
        width = _width(rows)
        old = self._cost.get((speculated, width))
        # A probe's kind last ran PROBE_EVERY steps ago or more: its own measure replaces what
        # it measured then (a blend kept a stale figure deciding for many probes more).
        self._cost[speculated, width] = cost if old is None or probe else \
            (1 - COST_WEIGHT) * old + COST_WEIGHT * cost
        spec, plain = self._cost.get((True, width)), self._cost.get((False, width))
        if probe and spec is not None and plain is not None:  # sooner after a try that won
            won = (spec < plain * (1 - MARGIN)) == speculated
            # each width its own: tries that lose at one width say nothing of another
            self._probe_every[width] = PROBE_EVERY if won else \
                min(2 * self._probe_every.get(width, PROBE_EVERY), PROBE_EVERY_MOST)

    def record(self, proposed: int, accepted: int) -> None:
        self.stats.steps += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted


def _width(rows: int) -> int:
    """Batch widths pooled for costs: 1, 2, 3-4, 5-8, 9-16..."""
    return (rows - 1).bit_length()
