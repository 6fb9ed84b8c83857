"""The continuous-batching engine: mlx-lm's BatchGenerator plus scheduling, stops and stats.

Invariants:
- every request added ends as exactly one Output (stop / length / abort / error);
- a request is inserted into the BatchGenerator only when the running batch's KV cache, with it,
  fits the memory budget, and the running batch never exceeds `max_concurrency`;
- sampling randomness belongs to the request (see sampling.py), so a row's text does not depend
  on which other rows share its batch;
- with a prefix cache, a prompt prefix shared by queued or running rows is computed by one of
  them (the leader) while the others wait for its blocks, then reuse them;
- an exception while stepping loses no row: the running rows restart in two halves, each run
  on its own, halving again on failure; a row fails only when it fails alone. An out-of-memory
  error halves the concurrency instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from batchrun.cache import block_layout, make_prefix_cache
from batchrun.cache.disk import DiskCache
from batchrun.cache.prefix import Block, PrefixCache
from batchrun.engine.batch import LeanGenerationBatch
from batchrun.engine.choices import choice_logprobs, pick
from batchrun.engine.constrain import (
    ConstraintError,
    GrammarProcessor,
    Grammars,
    choice_token_ids,
)
from batchrun.engine.memory import MemoryBudget, kv_budget, measure_kv
from batchrun.engine.prompt import PromptBuilder
from batchrun.engine.request import (
    EngineConfig,
    EngineStats,
    FinishReason,
    Output,
    SamplingParams,
)
from batchrun.engine.sampling import make_sampler

MAX_AUTO_CONCURRENCY = 256
LEAN_STEP = True  # False: mlx-lm's own GenerationBatch (kept for the side-by-side benchmark)
TIMELINE_INTERVAL_S = 0.5


@dataclass(slots=True)
class Sequence:
    """One request's state from admission to its Output."""

    id: int
    prompt: list[int]
    params: SamplingParams
    stop_sequences: StopSequences
    detokenizer: Any  # incremental, only for rows with stop strings (None otherwise)
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    uid: int | None = None  # BatchGenerator's id once admitted
    admitted_at: float = 0.0
    ttft: float | None = None
    stop_scan_from: int = 0  # text offset before which no stop string can start
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the prompt
    cached: int = 0  # prompt tokens served from the prefix cache
    store_upto: int = 0  # prompt tokens whose blocks this sequence computes and stores
    processor: GrammarProcessor | None = None  # constrained rows, from admission on
    choice_tokens: list[list[int]] | None = None  # rows with choices: each choice's tokens
    choice_logprobs: dict[str, float] | None = None
    answer: str | None = None  # a choices row's picked choice

    @property
    def length(self) -> int:
        return len(self.prompt) + self.max_tokens


class StepLoop:
    """What both engines (this one and vision.py's) share: running to the end, and the
    timeline. The engine provides has_work, step, stats, generated_tokens, _running,
    _started and _last_sample."""

    def run(self) -> list[Output]:
        """Step until every queued request has finished; outputs ordered by request id."""
        outputs = []
        while self.has_work():
            outputs.extend(self.step())
        return sorted(outputs, key=lambda o: o.request_id)

    def add_request(self, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                    enable_thinking: bool | None = None) -> int:
        """Queue a request (token ids, a raw prompt, or chat messages); returns its id."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt (text or token ids) and messages")
        if messages is not None:
            ids = self.prompts.encode_chat(messages, tools=tools, enable_thinking=enable_thinking,
                                           chat_template_kwargs=chat_template_kwargs)
        elif isinstance(prompt, str):
            ids = self.prompts.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        return self.add_tokens(ids, params or SamplingParams())

    def generate(self, prompts: list[str | list[int] | list[dict]],
                 params: SamplingParams | None = None, **sampling) -> list[Output]:
        """Run prompts to the end: each a text, token ids, or a chat (a list of messages).
        Sampling comes from `params` or keyword arguments (max_tokens=8, temperature=0.7...).
        Returns one Output per prompt, in order."""
        if params is None:
            params = SamplingParams(**sampling)
        elif sampling:
            raise ValueError("give sampling as params or as keyword arguments, not both")
        ids = [self.add_request(messages=p, params=params) if _is_chat(p)
               else self.add_request(p, params) for p in prompts]
        done = {o.request_id: o for o in self.run()}
        return [done[i] for i in ids]

    def sample_timeline(self, force: bool = False) -> None:
        """Record (time, prompt tokens, generated tokens, running) every interval, or now."""
        t = time.perf_counter() - self._started
        if force or t - self._last_sample >= TIMELINE_INTERVAL_S:
            self._last_sample = t
            self.stats.timeline.append((round(t, 3), self.stats.prompt_tokens,
                                        self.generated_tokens, len(self._running)))


class Engine(StepLoop):
    """Add requests, call `step()` until `has_work()` is false; each step returns finished ones."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None,
                 context_length: int | None = None, model_path: str = "",
                 prefix_cache: PrefixCache | None = None, model_fingerprint: str = ""):
        self.model = model
        self.model_fingerprint = model_fingerprint
        self.prefix_cache = prefix_cache
        self._key_counts: Counter[bytes] = Counter()  # prefix keys of queued + running rows
        self._leading: Counter[bytes] = Counter()  # keys that admitted leaders are computing
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.prompts = PromptBuilder(tokenizer)
        self.context_length = context_length
        self._eos = tuple(sorted(tokenizer.eos_token_ids))
        self._default_stops = StopSequences([(t,) for t in self._eos])
        budget = self.config.kv_budget_bytes
        if budget is None:
            budget = kv_budget(model, self.config.memory_utilization)
        self.memory = MemoryBudget(measure_kv(model), budget)
        self.max_concurrency = self.config.max_concurrency or MAX_AUTO_CONCURRENCY
        self._logprob_uids: set[int] = set()  # running rows that asked for logprobs
        self._grammars: Grammars | None = None
        self._gen = self._new_generator()
        self._retry_groups: deque[list[Sequence]] = deque()  # rows to rerun after a fault
        self._isolated: set[int] = set()  # ids of the retry group now running on its own
        self.faults = 0
        self._ids = itertools.count()
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # by BatchGenerator uid
        self._finished: list[Output] = []
        self._seed_base = 0
        self.stats = EngineStats()
        self._started = time.perf_counter()
        self._last_sample = -TIMELINE_INTERVAL_S

    def _new_generator(self) -> BatchGenerator:
        gen = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in self._eos],
            completion_batch_size=self.max_concurrency,
            prefill_batch_size=min(self.config.prefill_batch_size, self.max_concurrency),
            prefill_step_size=self.config.prefill_step_size,
        )
        if LEAN_STEP:
            gen._generation_batch = LeanGenerationBatch.empty(self.model, gen.sampler,
                                                              self._logprob_uids)
        return gen

    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None,
             **engine_options) -> Engine:
        """Load a text model (None: the demo model); options as EngineConfig's fields."""
        from batchrun.models import load_model

        loaded = load_model(model)
        config = config or EngineConfig(**engine_options)
        engine = cls(loaded.model, loaded.tokenizer, config, loaded.context_length, loaded.path,
                     model_fingerprint=loaded.fingerprint)
        if config.prefix_cache and engine.memory.footprint.per_sequence == 0:
            # Only growing KV caches can be cut into blocks (not recurrent or rotating ones).
            share = int(engine.memory.budget * config.prefix_cache_fraction)
            engine.memory.budget -= share  # the cached blocks live in the same memory
            engine.prefix_cache = make_prefix_cache(
                loaded.fingerprint, share, Path(config.cache_dir) if config.cache_dir else None,
                config.prefix_block_size, layout=block_layout(engine.model))
        return engine

    # -- the seed's cache API ------------------------------------------------------------------

    def get_cache_stats(self) -> dict | None:
        """Prefix-cache figures: hits, misses, tokens served, blocks and bytes in memory."""
        cache = self.prefix_cache
        if cache is None:
            return None
        disk = cache.disk
        return {**dataclasses.asdict(cache.stats), "blocks": len(cache.blocks),
                "bytes": cache.nbytes, "budget_bytes": cache.budget_bytes,
                "block_size": cache.block_size,
                "disk_folder": str(disk.folder) if disk else None,
                "disk_skipped": disk.skipped if disk else 0}

    def clear_prefix_cache(self) -> None:
        """Drop the in-memory prefix cache (the disk copy stays)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def save_cache_to_disk(self, cache_dir: str | Path) -> int:
        """Write every in-memory block to `cache_dir`; returns how many were written."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        disk = DiskCache.open(Path(cache_dir), self.model_fingerprint, cache.block_size,
                              block_layout(self.model))
        if disk is None:
            return 0
        disk.save(list(cache.blocks.values()))
        disk.close()
        return disk.saved

    def load_cache_from_disk(self, cache_dir: str | Path) -> int:
        """Load this model's blocks from `cache_dir` into memory; returns how many loaded."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        disk = DiskCache.open(Path(cache_dir), self.model_fingerprint, cache.block_size,
                              block_layout(self.model))
        if disk is None:
            return 0
        loaded = 0
        for key in disk.stored_keys():  # least recently used first: the newest end up most recent
            block = disk.load(key)
            if block is not None:
                cache.put(block)
                loaded += 1
        disk.close()
        return loaded

    # -- adding work ---------------------------------------------------------------------------

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler for this model's tokenizer (built on first use)."""
        if self._grammars is None:
            vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
            self._grammars = Grammars(self.tokenizer, vocab or len(self.tokenizer._tokenizer))
        return self._grammars

    def check_constraint(self, constraint) -> None:
        """Raise ConstraintError unless the constraint compiles for this model."""
        self.grammars.check(constraint)

    def add_tokens(self, prompt: list[int], params: SamplingParams) -> int:
        request_id = next(self._ids)
        max_tokens = params.max_tokens
        constraint = params.constraint
        choice_tokens = None
        if constraint is not None and constraint.kind == "choices":
            # Picked from the choices' probabilities right after the prompt (choices.py); a
            # second step keeps the row in the batch until its prompt cache is read.
            max_tokens = 2
            choice_tokens = choice_token_ids(self.tokenizer, constraint.value)
        if self.context_length:
            max_tokens = min(max_tokens, self.context_length - len(prompt))
        stops = self._default_stops
        if params.stop_token_ids:
            stops = StopSequences([(t,) for t in (*self._eos, *params.stop_token_ids)])
        seq = Sequence(
            id=request_id, prompt=prompt, params=params, stop_sequences=stops,
            detokenizer=self.tokenizer.detokenizer if params.stop else None,
            max_tokens=max_tokens,
            logprobs=[] if params.logprobs else None,
            top_logprobs=[] if params.top_logprobs else None,
            choice_tokens=choice_tokens,
        )
        error = self._reject_reason(seq)
        if error is None and constraint is not None:
            try:
                self.grammars.check(constraint)
            except ConstraintError as e:
                error = str(e)
        if error:
            self._finished.append(self._output(seq, FinishReason.ERROR, error=error))
            return request_id
        if self.prefix_cache is not None:
            seq.block_keys = self.prefix_cache.keys_for(prompt)
            self._key_counts.update(seq.block_keys)
        self._waiting.append(seq)
        return request_id

    def _reject_reason(self, seq: Sequence) -> str | None:
        if not seq.prompt:
            return "the prompt is empty"
        if self.context_length and len(seq.prompt) >= self.context_length:
            return (f"the prompt has {len(seq.prompt)} tokens; the model's context is "
                    f"{self.context_length}: shorten the prompt")
        if not self.memory.fits_alone(seq.length):
            return (f"prompt + max_tokens = {seq.length} tokens need "
                    f"{self.memory.cost([seq.length]):,} bytes of KV cache; the budget is "
                    f"{self.memory.budget:,}: lower max_tokens or raise the memory limit")
        return None

    def abort(self, request_id: int) -> bool:
        """Stop a queued or running request; it finishes with reason `abort`."""
        for uid, seq in self._running.items():
            if seq.id == request_id:
                self._finish(uid, FinishReason.ABORT)
                return True
        for queue in (self._waiting, *self._retry_groups):  # not admitted yet
            for seq in queue:
                if seq.id == request_id:
                    queue.remove(seq)
                    self._release_prefix(seq)
                    self._finished.append(self._output(seq, FinishReason.ABORT))
                    return True
        return False

    # -- running -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._finished or self._retry_groups)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far, by finished and running requests."""
        return self.stats.completion_tokens + self._live_tokens()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> list[Output]:
        """Admit what fits, run one decode step (and a prefill chunk); return finished outputs."""
        self._admit()
        if self._running:
            try:
                _, responses = self._gen.next()
            except Exception as e:  # a fault in the model or in mlx: rerun, never lose rows
                self._recover(e)
            else:
                self._collect(responses)
                self._account(len(responses))
        finished, self._finished = self._finished, []
        self.stats.requests_finished += len(finished)
        return finished


    def _recover(self, error: Exception) -> None:
        """Restart the running rows on a fresh generator: in halves, or at lower concurrency."""
        self.faults += 1
        rows = sorted(self._running.values(), key=lambda seq: seq.id)
        self._running.clear()
        self._isolated.clear()
        self._logprob_uids.clear()
        self._gen.close()
        for seq in rows:
            self.memory.remove(seq.id)
            self._restart(seq)
        lower = _out_of_memory(error) and len(rows) > 1
        if lower:
            self.max_concurrency = max(1, len(rows) // 2)
        self._gen = self._new_generator()  # sized by the (possibly lowered) concurrency
        if lower:
            self._waiting.extendleft(reversed(rows))
        elif len(rows) == 1:
            seq = rows[0]
            self._release_prefix(seq)
            self._finished.append(self._output(
                seq, FinishReason.ERROR,
                error=f"the engine failed on this row alone: {type(error).__name__}: {error}"))
        else:
            half = len(rows) // 2
            self._retry_groups.extendleft([rows[half:], rows[:half]])

    def _restart(self, seq: Sequence) -> None:
        """Forget what a sequence generated; it will be run again from its prompt."""
        self._drop_leadership(seq)
        seq.tokens, seq.uid, seq.ttft = [], None, None
        seq.stop_scan_from = seq.cached = seq.store_upto = 0
        seq.detokenizer = self.tokenizer.detokenizer if seq.params.stop else None
        seq.logprobs = [] if seq.params.logprobs else None
        seq.top_logprobs = [] if seq.params.top_logprobs else None
        seq.processor, seq.choice_logprobs, seq.answer = None, None, None

    def _admit(self) -> None:
        if self._isolated:
            return  # a retry group runs on its own until it is done
        if self._retry_groups:
            group = self._retry_groups.popleft()
            self._isolated = {seq.id for seq in group}
            for seq in group:
                self.memory.add(seq.id, seq.length)
            self._insert([(seq, self._cached_blocks(seq) or []) for seq in group])
            return
        batch: list[tuple[Sequence, list[Block]]] = []
        deferred: list[Sequence] = []
        while (self._waiting and len(self._running) + len(batch) < self.max_concurrency
               and self.memory.fits(self._waiting[0].length)):
            seq = self._waiting.popleft()
            blocks = self._cached_blocks(seq)
            if blocks is None:  # a leader is computing this row's prefix: wait for it
                deferred.append(seq)
                continue
            self.memory.add(seq.id, seq.length)
            batch.append((seq, blocks))
        self._waiting.extendleft(reversed(deferred))
        if batch:
            self._insert(batch)

    def _insert(self, batch: list[tuple[Sequence, list[Block]]]) -> None:
        # mlx-lm prefills queued prompts in insertion order, prefill_batch_size at a time, each
        # group right-padded to its longest prompt: inserting by length wastes less on padding.
        batch.sort(key=lambda item: len(item[0].prompt) - item[0].cached)
        seqs = [seq for seq, _ in batch]
        for seq in seqs:  # a fresh grammar state (also for a row rerun after a fault)
            constraint = seq.params.constraint
            if constraint is not None and seq.choice_tokens is None:
                seq.processor = self.grammars.processor(constraint)
        uids = self._gen.insert(
            [s.prompt[s.cached:] for s in seqs],
            max_tokens=[s.max_tokens for s in seqs],
            caches=[PrefixCache.to_kv_caches(b) if b else None for _, b in batch],
            all_tokens=[s.prompt[: s.cached] for s in seqs],
            samplers=[make_sampler(s.params, self._seed_base + s.id) for s in seqs],
            logits_processors=[[s.processor] if s.processor else [] for s in seqs],
            stop_sequences=[s.stop_sequences for s in seqs],
        )
        now = time.perf_counter()
        for uid, seq in zip(uids, seqs, strict=True):
            seq.uid, seq.admitted_at = uid, now
            self._running[uid] = seq
            if seq.params.logprobs or seq.params.top_logprobs or seq.choice_tokens:
                self._logprob_uids.add(uid)
            self.stats.prompt_tokens += len(seq.prompt)
            self.stats.cached_tokens += seq.cached

    def _cached_blocks(self, seq: Sequence) -> list[Block] | None:
        """The prefix blocks this row can reuse, or None to defer it behind a leader.

        A row becomes the leader of the shared blocks it will compute (those another queued
        or running row also needs); rows needing blocks a leader is computing wait for them.
        """
        cache = self.prefix_cache
        if cache is None or not seq.block_keys:
            return []
        blocks = cache.match(seq.prompt, seq.block_keys)
        keys = seq.block_keys
        n = len(blocks)
        if n < len(keys) and keys[n] in self._leading:
            return None
        shared = n
        while shared < len(keys) and self._key_counts[keys[shared]] >= 2:
            shared += 1
        seq.cached = n * cache.block_size
        seq.store_upto = shared * cache.block_size
        self._leading.update(keys[n:shared])
        cache.count_lookup(n)
        return blocks

    def _store_prefix(self, uid: int, seq: Sequence) -> None:
        """After a leader's prefill: copy its shared blocks into the prefix cache."""
        layer_caches, _ = self._gen.extract_cache([uid])[uid]
        self.prefix_cache.store(seq.prompt, [(c.keys, c.values) for c in layer_caches],
                                seq.store_upto)
        self._drop_leadership(seq)

    def _drop_leadership(self, seq: Sequence) -> None:
        """The blocks this row was to compute for others are no longer promised by it."""
        if seq.store_upto and self.prefix_cache is not None:
            size = self.prefix_cache.block_size
            self._leading.subtract(seq.block_keys[seq.cached // size: seq.store_upto // size])
            self._leading = +self._leading  # drop zero counts
        seq.store_upto = 0

    def _release_prefix(self, seq: Sequence) -> None:
        if self.prefix_cache is None:
            return
        self._key_counts.subtract(seq.block_keys)
        self._key_counts = +self._key_counts
        self._drop_leadership(seq)  # a leader that ended before its prefill was stored

    def _collect(self, responses: list) -> None:
        now = time.perf_counter()
        for r in responses:
            seq = self._running.get(r.uid)
            if seq is None:
                continue
            if seq.ttft is None:
                seq.ttft = now - seq.admitted_at
                if seq.store_upto > seq.cached:
                    self._store_prefix(r.uid, seq)
                if seq.choice_tokens is not None:
                    self._answer_choice(r, seq)
                    continue
            if r.finish_reason == "stop" and r.token in self._stop_ids(seq):
                self._finish(r.uid, FinishReason.STOP, removed=True)
                continue
            seq.tokens.append(r.token)
            self._record_logprobs(seq, r)
            if seq.detokenizer is not None and self._stop_string_seen(seq, r.token):
                self._finish(r.uid, FinishReason.STOP, removed=r.finish_reason is not None)
            elif r.finish_reason is not None:
                reason = FinishReason.STOP if r.finish_reason == "stop" else FinishReason.LENGTH
                self._finish(r.uid, reason, removed=True)

    def _answer_choice(self, r: Any, seq: Sequence) -> None:
        """Right after a choices row's prompt: score every choice, answer one, finish."""
        cache = None
        if r.finish_reason is None:  # still in the batch: reuse its prompt's KV cache
            cache, _ = self._gen.extract_cache([r.uid])[r.uid]
            for layer in cache:  # it already holds the first generated token: drop it
                layer.offset = len(seq.prompt)
        per_token = choice_logprobs(self.model, cache, seq.prompt,
                                    r.logprobs if cache is not None else None,
                                    seq.choice_tokens)
        totals = [sum(lps) for lps in per_token]
        choices = seq.params.constraint.value
        seq.choice_logprobs = dict(zip(choices, totals, strict=True))
        seed = seq.params.seed if seq.params.seed is not None else self._seed_base + seq.id
        picked = pick(totals, seq.params.temperature, seed)
        seq.tokens = list(seq.choice_tokens[picked])
        seq.answer = choices[picked]
        if seq.logprobs is not None:
            seq.logprobs = per_token[picked]
        self._finish(r.uid, FinishReason.STOP, removed=r.finish_reason is not None)

    def _stop_ids(self, seq: Sequence) -> tuple[int, ...]:
        return (*self._eos, *seq.params.stop_token_ids)

    def _record_logprobs(self, seq: Sequence, r: Any) -> None:
        if seq.logprobs is not None:
            seq.logprobs.append(r.logprobs[r.token].item())
        if seq.top_logprobs is not None:
            k = seq.params.top_logprobs
            top = mx.argpartition(-r.logprobs, kth=k - 1)[:k]
            values = r.logprobs[top]
            pairs = sorted(zip(top.tolist(), values.tolist(), strict=True), key=lambda p: -p[1])
            seq.top_logprobs.append(pairs)

    def _stop_string_seen(self, seq: Sequence, token: int) -> bool:
        """Detokenize incrementally and look for a stop string in the new text only."""
        seq.detokenizer.add_token(token)
        text = seq.detokenizer.text
        hit = _find_stop(text, seq.params.stop, seq.stop_scan_from)
        longest = max(len(s) for s in seq.params.stop)
        seq.stop_scan_from = max(0, len(text) - longest + 1)
        return hit is not None

    def _finish(self, uid: int, reason: FinishReason, removed: bool = False) -> None:
        seq = self._running.pop(uid)
        if seq.processor is not None and len(seq.tokens) > seq.processor.consumed:
            seq.processor.advance(seq.tokens[-1])  # the last token: no step consumed it yet
        self._logprob_uids.discard(uid)
        if not removed:
            self._gen.remove([uid])
        self.memory.remove(seq.id)
        self._isolated.discard(seq.id)
        self._release_prefix(seq)
        self._finished.append(self._output(seq, reason))

    def _output(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> Output:
        # One decode of the whole output (as mlx-lm's batch_generate does): far cheaper than
        # detokenizing every token of every row on the step loop.
        text = self.tokenizer.decode(seq.tokens) if seq.tokens else ""
        if seq.answer is not None:
            text = seq.answer
        hit = _find_stop(text, seq.params.stop, 0)
        if hit is not None:  # also one that only the last, held-back tokens completed
            text, reason = text[:hit], FinishReason.STOP
        if seq.ttft is not None:
            self.stats.ttfts.append(seq.ttft)
        self.stats.completion_tokens += len(seq.tokens)
        return Output(
            request_id=seq.id, text=text, token_ids=seq.tokens, finish_reason=reason,
            prompt_tokens=len(seq.prompt), cached_tokens=seq.cached, logprobs=seq.logprobs,
            top_logprobs=seq.top_logprobs, ttft_s=seq.ttft, error=error,
            constraint_complete=(seq.processor.complete if seq.processor
                                 else True if seq.answer is not None else None),
            choice_logprobs=seq.choice_logprobs,
        )

    def _account(self, decoded: int) -> None:
        counters = self._gen._counters  # mlx-lm's running totals (pinned version)
        s = self.stats
        s.prefill_time, s.decode_time = counters.prompt_time, counters.decode_time
        if decoded:
            s.decode_steps += 1
            s.batch_size_sum += decoded
        s.peak_memory_bytes = max(s.peak_memory_bytes, mx.get_peak_memory())
        self.sample_timeline()


    def _live_tokens(self) -> int:
        return sum(len(seq.tokens) for seq in self._running.values())

    def close(self) -> None:
        self._gen.close()


def _is_chat(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def _out_of_memory(error: Exception) -> bool:
    return isinstance(error, MemoryError) or "out of memory" in str(error).lower() \
        or "bad_alloc" in str(error)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    if not stops:
        return None
    hits = [i for s in stops if (i := text.find(s, max(0, start))) >= 0]
    return min(hits) if hits else None
