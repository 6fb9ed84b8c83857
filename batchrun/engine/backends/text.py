"""The text backend: mlx-lm's BatchGenerator, with the lean decoding batch (batch.py).

Each row brings its own sampler (sampling.py: its randomness is its own), its logits processors
(a grammar) and its stop tokens; a row that starts from cached prefix blocks is inserted with
those blocks as its KV cache and only the rest of its prompt to prefill.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from batchrun.cache.layout import layer_kinds
from batchrun.cache.prefix import Block, PrefixCache, window_cache
from batchrun.engine.backends.batch import LeanGenerationBatch, LeanPromptBatch
from batchrun.engine.backends.prompt import PromptBuilder
from batchrun.engine.backends.tokens import common_length
from batchrun.engine.config import EngineConfig
from batchrun.engine.decoding.choices import batch_choice_logprobs, score_alone
from batchrun.engine.decoding.sampling import LogitAdjustments, make_sampler
from batchrun.engine.kernels import (
    decode_attention,
    gated_delta,
    host_attention,
    prefix_attention,
)
from batchrun.engine.kernels.nvrtc import compile_ahead
from batchrun.engine.kernels.shared_prefix import (
    CopiedCache,
    PrefixedCache,
    SharedPrefix,
    SharedPrefixBatchCache,
    attention_shape,
    install,
)
from batchrun.engine.postprocess import Step
from batchrun.engine.sequence import Sequence
from batchrun.engine.types import SamplingParams

log = logging.getLogger("batchrun")
SHARED_PREFIXES_KEPT = 8  # distinct shared prefixes kept for rows still to come
SHARED_TAILS = True  # False: rows compute what they share past their blocks each (benchmarks)
TAIL_PEERS = 256  # waiting rows a shared tail is chosen to fit (_share_tails)
# On the CPU a shared prefix is computed this many tokens a step (_compute_in_steps).
CPU_PREFIX_STEP = 256

LEAN_STEP = True  # False: mlx-lm's own GenerationBatch (kept for the side-by-side benchmark)


def vocab_size(model: Any, tokenizer: Any) -> int:
    """The token ids a text model scores: its config's vocab_size (the rows of its embedding
    and output, padding included), else as many as its tokenizer has."""
    return (getattr(getattr(model, "args", None), "vocab_size", None)
            or len(tokenizer._tokenizer))


class TextBackend:
    scores_choices = True
    prefix_cache = True
    windowed_prefixes = True  # rows of sliding-window models start from cached blocks too
    stateful_prefixes = True  # ... and of recurrent ones, from a block's state snapshot
    snapshot_every = 64  # tokens: the prefix cache's block size (the engine sets it)
    accepts_images = False

    def __init__(self, model: Any, tokenizer: Any):
        self.model = self.kv_model = model
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.eos = tuple(sorted(tokenizer.eos_token_ids))
        self.vocab_size = vocab_size(model, tokenizer)
        self._eos_stops = StopSequences([(t,) for t in self.eos])
        self._logprob_uids: set[int] = set()  # running rows whose steps carry logprobs
        self._choice_blocks: dict[int, list[Block]] = {}  # a choices row's cached blocks
        self._gen: BatchGenerator | None = None
        self._speculator = None  # speculate.Speculator: speculative decoding, narrow batches
        self.shares_prefix = False  # rows attend one shared copy of a cached prefix
        self._shared: OrderedDict[tuple[bytes, int], SharedPrefix] = OrderedDict()
        caches = make_prompt_cache(model)
        self._layers = len(caches)
        # Each layer's kind (cache/layout.py: None, attends every position; a sliding window;
        # ("state", n), recurrent). Rows sharing a prefix share it in the full-attention
        # layers; a sliding layer's cache holds the prefix's last window a row (shared-prefix
        # attention has no window), a recurrent layer's a copy of the state at its end.
        self._kinds = layer_kinds(model) or (None,) * len(caches)
        self._windowed = any(isinstance(k, int) for k in self._kinds)
        self._stateful = any(isinstance(k, tuple) for k in self._kinds)
        # a layer's place among the layers with keys and values (blocks hold only theirs)
        kv = itertools.count()
        self._kv_index = [None if isinstance(k, tuple) else next(kv) for k in self._kinds]
        # Decode steps take each row's key range instead of a mask (decode_attention.py) where
        # every layer's cache is a growing one and the model calls the shared attention.
        self._ranged = (decode_attention.wanted() and all(type(c) is KVCache for c in caches)
                        and install(model))
        if host_attention.wanted():  # the CPU's prefills and verifications: through NumPy
            install(model, warn=False)
        if gated_delta.wanted():  # recurrent layers' prompts by chunks (gated_delta.py)
            gated_delta.install(model)
        if decode_attention.on_cuda():
            self._compile_kernels_ahead()

    def _compile_kernels_ahead(self) -> None:
        """The attention kernels this model's rows will take, compiled on a thread while the
        job starts (their first use waits for it), not inside the job's warm-up: 0.04 and
        0.015 s on the H200 host, ~0.15 s a kernel on a 2-core CPU."""
        shape = attention_shape(self.model)
        if shape is None:
            return
        dtype, D, G = shape
        calls = [prefix_attention.compile_call(dtype, D)]
        if self._ranged:
            calls.append(decode_attention.compile_call(dtype, D, G))
        compile_ahead(*(c for c in calls if c is not None))

    def share_prefixes(self, on: bool) -> bool:
        """Rows starting from cached blocks attend one shared copy of them (shared_prefix.py)
        where the model's architecture allows (else each holds a copy of them); returns
        whether they share."""
        self.shares_prefix = on and install(self.model)
        return self.shares_prefix

    def start(self, max_concurrency: int, config: EngineConfig) -> None:
        self.close()
        self._prefill_step = config.prefill_step_size
        self._logprob_uids.clear()
        self._choice_blocks.clear()
        self._gen = BatchGenerator(
            self.model, stop_tokens=[[t] for t in self.eos],
            completion_batch_size=max_concurrency,
            prefill_batch_size=min(config.prefill_batch_size or max_concurrency,
                                   max_concurrency),
            prefill_step_size=config.prefill_step_size)
        if LEAN_STEP:
            self._gen._generation_batch = LeanGenerationBatch.empty(
                self.model, self._gen.sampler, self._logprob_uids)
            self._gen._prompt_batch = LeanPromptBatch.empty(
                self.model, self._gen.sampler, prefill_step_size=config.prefill_step_size)
            self._gen._generation_batch.speculator = self._speculator
        if self._speculator is not None and self._speculator.draft is not None:
            self._speculator.draft.reset()  # a fresh batch numbers its rows afresh

    def speculate(self, speculator) -> None:
        """Decode narrow batches speculatively (speculate.py), from the next start()."""
        self._speculator = speculator

    def detokenizer(self) -> Any:
        return self.tokenizer.detokenizer

    def reject(self, params: SamplingParams) -> str | None:
        return None

    def prepare(self, seq: Sequence) -> str | None:
        return None

    def insert(self, seqs: list[Sequence], blocks: list[list[Block]],
               upcoming: Iterable[Sequence] = ()) -> list[int]:
        # First: a shared tail may serve more of a row's prompt (seq.cached).
        if self._speculator is not None:  # building these rows' caches is not a step's time
            self._speculator.discard()
        caches = self._row_caches(seqs, blocks, upcoming)
        uids = self._gen.insert(
            [s.prompt[s.cached:] for s in seqs],
            max_tokens=[s.max_tokens for s in seqs],
            caches=caches,
            all_tokens=[s.prompt[: s.cached] for s in seqs],
            samplers=[make_sampler(s.params, s.seed) for s in seqs],
            logits_processors=[self._processors(s) for s in seqs],
            stop_sequences=[self._stops(s.params) for s in seqs],
        )
        for uid, s, b in zip(uids, seqs, blocks, strict=True):
            if s.params.logprobs or s.params.top_logprobs or s.choice_tokens:
                self._logprob_uids.add(uid)
            if s.choice_tokens and b and (self._windowed or self._stateful):
                self._choice_blocks[uid] = b  # its choices are scored from them (score_choices)
        return uids

    def _processors(self, seq: Sequence) -> list:
        """The row's logits processors: penalties and bias first, then its grammar."""
        processors = [LogitAdjustments(seq.params, self.eos)] if seq.params.adjusts_logits \
            else []
        if seq.thinking_budget is not None:
            processors.append(seq.thinking_budget)
        processors.extend(seq.params.logits_processors)
        return processors + ([seq.processor] if seq.processor else [])

    def _row_caches(self, seqs: list[Sequence], blocks: list[list[Block]],
                    upcoming: Iterable[Sequence]) -> list:
        """The rows' starting caches: a copy of each row's cached blocks, or (sharing) a
        reference to the one shared copy of them, extended by the tokens rows go on sharing
        past their blocks (`_share_tails`)."""
        if not self.shares_prefix:
            # The batch cache that takes row ranges, a row's cached blocks (--no-shared-prefix)
            # copied into its own part. Every row gets one of one class: one prefill can hold
            # rows of two inserts, and mlx-lm merges their caches by the first's class.
            if self._ranged:
                return [self._copied(b) for b in blocks]
            return [PrefixCache.to_row_caches(b, self._kinds) if b else None for b in blocks]
        prefixes = [self._shared_prefix(b) if b else None for b in blocks]
        # a tail is computed through shared-prefix attention alone: no window, no state
        if SHARED_TAILS and any(prefixes) and not (self._windowed or self._stateful):
            self._share_tails(seqs, blocks, prefixes, upcoming)
        return [self._prefixed(p, b) for p, b in zip(prefixes, blocks, strict=True)]

    def _prefixed(self, prefix: SharedPrefix | None, blocks: list[Block]) -> list:
        """A row's caches after `prefix` (or none): a reference to it in each full-attention
        layer, its last window in each sliding one, a copy of the last block's state snapshot
        in each recurrent one."""
        caches, state = [], (blocks[-1].state if blocks else None) or []
        at = 0
        for kind, kv in zip(self._kinds, self._kv_index, strict=True):
            if isinstance(kind, tuple):
                c = ArraysCache(size=kind[1])
                if prefix is not None:
                    c.cache = list(state[at: at + kind[1]])
                at += kind[1]
            elif kind is None:
                c = PrefixedCache(prefix, kv)
            elif prefix is None:
                c = RotatingKVCache(max_size=kind)
            else:
                c = window_cache(prefix.keys[kv], prefix.values[kv], kind)
            caches.append(c)
        return caches

    def _copied(self, blocks: list[Block]) -> list[CopiedCache]:
        if not blocks:
            return [CopiedCache(layer) for layer in range(self._layers)]
        caches = PrefixCache.to_kv_caches(blocks, make=CopiedCache)
        for layer, cache in enumerate(caches):
            cache.layer = layer
        return caches

    def _shared_prefix(self, blocks: list[Block]) -> SharedPrefix:
        key = (blocks[-1].key, len(blocks))
        prefix = self._shared.get(key)
        if prefix is None:
            prefix = self._shared[key] = SharedPrefix.from_blocks(blocks)
            if len(self._shared) > SHARED_PREFIXES_KEPT:
                self._shared.popitem(last=False)  # rows running with it still hold it
        self._shared.move_to_end(key)
        return prefix

    def _share_tails(self, seqs: list[Sequence], blocks: list[list[Block]],
                     prefixes: list[SharedPrefix | None], upcoming: Iterable[Sequence]) -> None:
        """Rows that go on sharing tokens past their cached blocks (a long instruction seldom
        ends on a block boundary: up to a block of it each row would compute for itself)
        attend one copy of those tokens too. The tail is what most of these rows and the
        waiting rows after the same blocks share (`best_tail`); it is computed once, on top of
        the blocks' shared copy, and kept with it for rows to come. `prefixes[i]` and
        `seqs[i].cached` then cover it; a row keeps at least one prompt token of its own."""
        rows_of: dict[int, list[int]] = {}
        for i, prefix in enumerate(prefixes):
            if prefix is not None:
                rows_of.setdefault(id(prefix), []).append(i)
        for rows in rows_of.values():
            base = prefixes[rows[0]]
            loose = []
            for i in rows:
                tail = base.tail_for(seqs[i].prompt, seqs[i].cached)
                if tail is None:
                    loose.append(i)
                else:
                    prefixes[i], seqs[i].cached = tail, seqs[i].cached + len(tail.tail)
            if not loose:
                continue
            start, n_blocks = seqs[loose[0]].cached, len(blocks[loose[0]])
            last = blocks[loose[0]][-1].key  # block keys are chained: the same whole prefix
            peers = [seqs[i].prompt[start:] for i in loose]
            for seq in itertools.islice(upcoming, TAIL_PEERS):
                if len(seq.block_keys) >= n_blocks and seq.block_keys[n_blocks - 1] == last:
                    peers.append(seq.prompt[start:])
            tokens = best_tail(peers, len(blocks[loose[0]][0].tokens), base.length)
            if not tokens:
                continue
            try:
                base.add_tail(self._extend(base, tokens))
            except Exception as e:  # the rows compute these tokens themselves, as before
                log.warning("computing a shared prompt tail once failed (%s: %s); the rows "
                            "compute it each", type(e).__name__, e)
                continue
            for i in loose:
                tail = base.tail_for(seqs[i].prompt, start)
                if tail is not None:
                    prefixes[i], seqs[i].cached = tail, start + len(tail.tail)

    def _extend(self, base: SharedPrefix, tokens: list[int]) -> SharedPrefix:
        """`base` followed by `tokens`, computed as a batch row after it would be."""
        caches = [SharedPrefixBatchCache([base], layer) for layer in range(self._layers)]
        self.model(mx.array(tokens)[None], cache=caches)
        keys = [mx.concatenate([base.keys[i], c.keys[..., : c._idx, :]], axis=2)
                for i, c in enumerate(caches)]
        values = [mx.concatenate([base.values[i], c.values[..., : c._idx, :]], axis=2)
                  for i, c in enumerate(caches)]
        mx.eval(keys, values)
        return SharedPrefix(keys, values, tail=base.tail + tuple(tokens))

    def compute_prefix(self, seq: Sequence, upto: int, blocks: list[Block]) -> list[tuple]:
        """Prefill the row's first `upto` tokens on its own (after `blocks`, their first part
        already cached); each layer's (keys, values) over all of them (the layers with keys
        and values; for a recurrent model a PrefixKV, with their state at `upto`)."""
        tokens = seq.prompt[:upto]
        plain = not (self._windowed or self._stateful)
        if self.shares_prefix and mx.default_device() == mx.cpu and plain:
            return self._compute_in_steps(tokens, blocks)
        # Every layer keeps all of the prefix (a sliding one attends its window by the mask the
        # model makes with the window's size): its blocks serve prompts ending anywhere.
        if blocks:
            caches = PrefixCache.to_row_caches(blocks, self._kinds, whole=True)
        elif plain:
            caches = make_prompt_cache(self.model)
        else:
            caches = [ArraysCache(size=k[1]) if isinstance(k, tuple) else KVCache()
                      for k in self._kinds]
        done = sum(len(b.tokens) for b in blocks)
        out = PrefixKV()
        # A recurrent model's state is snapshotted at each block's end: rows and later
        # prefixes start at any of them (its blocks' size: the first block's, or the cache's).
        every = len(blocks[0].tokens) if blocks else self.snapshot_every
        while done < len(tokens):
            step = self._prefill_step
            if self._stateful:
                step = min(step, every - done % every)
            chunk = tokens[done: done + step]
            self.model(mx.array(chunk)[None], cache=caches)
            mx.eval([_arrays(c) for c in caches])
            done += len(chunk)
            if self._stateful and done % every == 0:
                out.snapshots[done] = [a for c in caches if isinstance(c, ArraysCache)
                                       for a in c.cache]
        out.extend((c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
                   for c in caches if not isinstance(c, ArraysCache))
        return out

    def _compute_in_steps(self, tokens: list[int], blocks: list[Block]) -> list[tuple]:
        """compute_prefix on the CPU: CPU_PREFIX_STEP tokens at a time, each step attending the
        ones before it as a shared prefix, whose part of attention goes through NumPy (MLX's
        CPU exp is scalar: a 2,240-token instruction's own attention was most of a cold job)."""
        if blocks:
            prefix = SharedPrefix.from_blocks(blocks)
        else:
            caches = make_prompt_cache(self.model)
            self.model(mx.array(tokens[:CPU_PREFIX_STEP])[None], cache=caches)
            prefix = SharedPrefix([c.keys[..., : c.offset, :] for c in caches],
                                  [c.values[..., : c.offset, :] for c in caches])
        while prefix.length < len(tokens):
            prefix = self._extend(prefix, tokens[prefix.length: prefix.length + CPU_PREFIX_STEP])
        return list(zip(prefix.keys, prefix.values, strict=True))

    def score_choices(self, items: list[tuple[Sequence, Step]]) -> list[list[list[float]]]:
        """The choices of rows that finished their prompt this step, scored (choices.py): each
        row's per-token log-probabilities of each choice. Rows still in the batch are scored
        together from the batch's own KV (`_choice_caches`: a row's shared prefix referenced,
        its own tokens copied once per choice path), with one read for all of them. A
        sliding-window layer's cache may already hold the next position in its window and a
        recurrent one's state is past the prompt: such a model's rows are scored alone from
        the cached blocks they started from, the rest of their prompt computed again, as is a
        row that left the batch at its first token (a stop)."""
        out: list[list[list[float]] | None] = [None] * len(items)
        together = []
        batch = self._gen._generation_batch if self._gen is not None else None
        gathers = batch is not None and all(
            type(c) in (SharedPrefixBatchCache, BatchKVCache) for c in batch.prompt_cache)
        for n, (seq, step) in enumerate(items):
            blocks = self._choice_blocks.pop(step.uid, None)
            if self._windowed or self._stateful:
                start = sum(len(b.tokens) for b in blocks) if blocks else 0
                caches = PrefixCache.to_row_caches(blocks, self._kinds) if blocks else None
                out[n] = score_alone(seq, self.model, caches, None, start)
            elif step.finish_reason is not None or not gathers:
                out[n] = score_alone(seq, self.model, None, None)
            else:
                together.append(n)
        if together:
            batch, rows = self._batch_rows([items[n][1].uid for n in together])
            scores = batch_choice_logprobs(
                self.model, [items[n][1].logprobs for n in together],
                [items[n][0].choice_tokens for n in together],
                self._choice_caches(batch.prompt_cache, rows,
                                    [len(items[n][0].prompt) for n in together]))
            for n, score in zip(together, scores, strict=True):
                out[n] = score
        return out

    @property
    def keeps_prompts(self) -> bool:
        """Whether prompt_kv serves (growing KV caches: a sliding window's batch cache holds
        only the window, a recurrent layer no positions)."""
        return not (self._windowed or self._stateful)

    def prompt_kv(self, uids: list[int], upto: list[int]) -> list[list[tuple]]:
        """For running rows that just computed their prompts: each layer's (keys, values) over
        the first `upto` positions of the row's prompt, as views the prefix cache slices
        blocks from (`_Positions`): the row's shared prefix and its own tokens in the batch,
        nothing copied here."""
        batch, rows = self._batch_rows(uids)
        layers = batch.prompt_cache
        padding = layers[0].left_padding.tolist()
        out = []
        for i, n in zip(rows, upto, strict=True):
            kv = []
            for layer in layers:
                prefix = layer.prefixes[i] if isinstance(layer, SharedPrefixBatchCache) \
                    else None
                start = prefix.length if prefix is not None else 0
                parts_k, parts_v = [], []
                if prefix is not None:
                    parts_k.append((0, prefix.keys[layer.layer]))
                    parts_v.append((0, prefix.values[layer.layer]))
                own = slice(padding[i], padding[i] + max(0, n - start))
                parts_k.append((start, layer.keys[i: i + 1, :, own]))
                parts_v.append((start, layer.values[i: i + 1, :, own]))
                kv.append((_Positions(parts_k), _Positions(parts_v)))
            out.append(kv)
        return out

    def _batch_rows(self, uids: list[int]) -> tuple[Any, list[int]]:
        """The decoding batch, ready to be read (a verification started ahead would have moved
        its rows' caches: undone), and the rows of `uids` in it."""
        batch = self._gen._generation_batch
        cancel = getattr(batch, "_cancel_ahead", None)
        if cancel is not None:
            cancel()
        row_of = {uid: i for i, uid in enumerate(batch.uids)}
        return batch, [row_of[uid] for uid in uids]

    @staticmethod
    def _choice_caches(layers: list, rows: list[int], lengths: list[int]):
        """caches_for(owners) for batch_choice_logprobs: per layer, a batch cache whose entry e
        holds batch row `rows[owners[e]]`'s prompt (of `lengths[owners[e]]` tokens): its shared
        prefix by reference and its own tokens gathered from the batch's, left padded as
        there (a row's tokens end where every row's do, less what it generated since)."""

        def caches_for(owners: list[int]) -> list:
            first = layers[0]
            padding = first.left_padding.tolist()
            shared = getattr(first, "prefixes", None)
            heads = [shared[rows[o]] if shared is not None else None for o in owners]
            pads = [padding[rows[o]] for o in owners]
            owns = [lengths[o] - (h.length if h is not None else 0)
                    for o, h in zip(owners, heads, strict=True)]
            ends = {p + n for p, n in zip(pads, owns, strict=True)}
            index = mx.array([rows[o] for o in owners])
            out = []
            for layer in layers:
                cache = SharedPrefixBatchCache(heads, layer.layer) if shared is not None \
                    else BatchKVCache([0] * len(owners))
                if len(ends) == 1:  # one gather
                    end, lo = next(iter(ends)), min(pads)
                    cache.keys = layer.keys[index, :, lo:end]
                    cache.values = layer.values[index, :, lo:end]
                    cache.left_padding = mx.array([p - lo for p in pads])
                    cache._idx = end - lo
                else:  # each row's tokens copied, as mlx-lm merges rows
                    merged = BatchKVCache.merge([_part(layer, rows[o], p, n) for o, p, n
                                                 in zip(owners, pads, owns, strict=True)])
                    cache.keys, cache.values = merged.keys, merged.values
                    cache.left_padding, cache._idx = merged.left_padding, merged._idx
                cache.offset = mx.array([n + (h.length if h is not None else 0)
                                         for n, h in zip(owns, heads, strict=True)])
                out.append(cache)
            return out

        return caches_for

    def _stops(self, params: SamplingParams) -> StopSequences:
        if not params.stop_token_ids:
            return self._eos_stops
        return StopSequences([(t,) for t in (*self.eos, *params.stop_token_ids)])

    def next(self) -> tuple[bool, list[Step]]:
        prompt_work, responses = self._gen.next()
        if prompt_work and self._speculator is not None:  # a prefill after the step: not its
            self._speculator.discard()
        return bool(prompt_work), [Step(r.uid, r.token, r.finish_reason, r.logprobs)
                                   for r in responses]

    def leave(self, uids: list[int]) -> None:
        self._gen.remove(uids)

    def remove(self, uid: int, in_batch: bool) -> None:
        if in_batch:
            self._gen.remove([uid])
        self._logprob_uids.discard(uid)
        self._choice_blocks.pop(uid, None)

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
            self._gen = None


class PrefixKV(list):
    """compute_prefix's (keys, values) a layer, and a recurrent model's state snapshots (its
    state at a position, at each block's end)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.snapshots: dict[int, list[mx.array]] = {}


class _Positions:
    """A row's keys (or values) over positions, from pieces: (first position, an array of
    (1, heads, length, dim)). Sliced `[:, :, lo:hi, :]` as one array would be (PrefixCache
    .store), copying only the positions asked for."""

    def __init__(self, parts: list[tuple[int, mx.array]]):
        self.parts = parts

    def __getitem__(self, index: tuple) -> mx.array:
        span = index[2]
        lo, hi = span.start, span.stop
        pieces = []
        for start, array in self.parts:
            a, b = max(lo, start), min(hi, start + array.shape[2])
            if a < b:
                pieces.append(array[:, :, a - start: b - start])
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def _part(layer: Any, row: int, start: int, length: int) -> KVCache:
    """`length` tokens of a batch cache's row from `start`, as one row's cache."""
    cache = KVCache()
    cache.keys = layer.keys[row: row + 1, :, start: start + length]
    cache.values = layer.values[row: row + 1, :, start: start + length]
    cache.offset = length
    return cache


def _arrays(cache: Any) -> list:
    """The arrays a layer's cache holds (to evaluate)."""
    if isinstance(cache, ArraysCache):
        return [a for a in cache.cache if a is not None]
    return [cache.keys, cache.values]


def best_tail(peers: list[list[int]], most: int, copy_tokens: int) -> list[int]:
    """The tokens past a prefix worth computing once for `peers` (the prompts' rest after it),
    or none: at most `most` (a block: rows share more only when the cache could not store
    their blocks, and one row's forward over all of it could need more memory than that
    failure), leaving each peer a token of its own. Tried from the first few peers' starts,
    the length n that k peers share which saves most, n * (k - 1) tokens, wins if that is at
    least `copy_tokens`: the tail holds a copy of the prefix, and the rows' own KV shrinks by
    n tokens each. A few rows that leave early do not cut it for the rest."""
    best, saved = [], 0
    for start in peers[:3]:
        head = start[: most + 1]
        shared = sorted((common_length([head, p[: most + 1]]) for p in peers), reverse=True)
        for k, n in enumerate(shared, start=1):  # k peers share at least n tokens
            if n * (k - 1) > saved:
                best, saved = start[:n], n * (k - 1)
    return best if saved >= copy_tokens else []
