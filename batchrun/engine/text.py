"""The text backend: mlx-lm's BatchGenerator, with the lean decoding batch (batch.py).

Each row brings its own sampler (sampling.py: its randomness is its own), its logits processors
(a grammar) and its stop tokens; a row that starts from cached prefix blocks is inserted with
those blocks as its KV cache and only the rest of its prompt to prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from batchrun.cache.prefix import Block, PrefixCache
from batchrun.engine.batch import LeanGenerationBatch
from batchrun.engine.postprocess import Step
from batchrun.engine.prompt import PromptBuilder
from batchrun.engine.request import EngineConfig, SamplingParams
from batchrun.engine.sampling import LogitAdjustments, make_sampler
from batchrun.engine.sequence import Sequence
from batchrun.engine.shared_prefix import PrefixedCache, SharedPrefix, install

SHARED_PREFIXES_KEPT = 8  # distinct shared prefixes kept for rows still to come

LEAN_STEP = True  # False: mlx-lm's own GenerationBatch (kept for the side-by-side benchmark)


class TextBackend:
    scores_choices = True
    prefix_cache = True
    accepts_images = False

    def __init__(self, model: Any, tokenizer: Any):
        self.model = self.kv_model = model
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.eos = tuple(sorted(tokenizer.eos_token_ids))
        self.vocab_size = (getattr(getattr(model, "args", None), "vocab_size", None)
                           or len(tokenizer._tokenizer))
        self._eos_stops = StopSequences([(t,) for t in self.eos])
        self._logprob_uids: set[int] = set()  # running rows whose steps carry logprobs
        self._gen: BatchGenerator | None = None
        self.shares_prefix = False  # rows attend one shared copy of a cached prefix
        self._shared: OrderedDict[tuple[bytes, int], SharedPrefix] = OrderedDict()
        self._layers = len(make_prompt_cache(model))

    def share_prefixes(self, on: bool) -> bool:
        """Rows starting from cached blocks attend one shared copy of them (shared_prefix.py)
        where the model's architecture allows; returns whether they do."""
        self.shares_prefix = on and install(self.model)
        return self.shares_prefix

    def start(self, max_concurrency: int, config: EngineConfig) -> None:
        self.close()
        self._prefill_step = config.prefill_step_size
        self._logprob_uids.clear()
        self._gen = BatchGenerator(
            self.model, stop_tokens=[[t] for t in self.eos],
            completion_batch_size=max_concurrency,
            prefill_batch_size=min(config.prefill_batch_size or max_concurrency,
                                   max_concurrency),
            prefill_step_size=config.prefill_step_size)
        if LEAN_STEP:
            self._gen._generation_batch = LeanGenerationBatch.empty(
                self.model, self._gen.sampler, self._logprob_uids)

    def detokenizer(self) -> Any:
        return self.tokenizer.detokenizer

    def reject(self, params: SamplingParams) -> str | None:
        return None

    def prepare(self, seq: Sequence) -> str | None:
        return None

    def insert(self, seqs: list[Sequence], blocks: list[list[Block]]) -> list[int]:
        uids = self._gen.insert(
            [s.prompt[s.cached:] for s in seqs],
            max_tokens=[s.max_tokens for s in seqs],
            caches=[self._row_cache(b) for b in blocks],
            all_tokens=[s.prompt[: s.cached] for s in seqs],
            samplers=[make_sampler(s.params, s.seed) for s in seqs],
            logits_processors=[self._processors(s) for s in seqs],
            stop_sequences=[self._stops(s.params) for s in seqs],
        )
        for uid, s in zip(uids, seqs, strict=True):
            if s.params.logprobs or s.params.top_logprobs or s.choice_tokens:
                self._logprob_uids.add(uid)
        return uids

    def _processors(self, seq: Sequence) -> list:
        """The row's logits processors: penalties and bias first, then its grammar."""
        processors = [LogitAdjustments(seq.params, self.eos)] if seq.params.adjusts_logits \
            else []
        if seq.thinking_budget is not None:
            processors.append(seq.thinking_budget)
        return processors + ([seq.processor] if seq.processor else [])

    def _row_cache(self, blocks: list[Block]) -> list | None:
        """A row's starting cache: a copy of its cached blocks, or (sharing) a reference to
        the one shared copy of them."""
        if not self.shares_prefix:
            return PrefixCache.to_kv_caches(blocks) if blocks else None
        prefix = self._shared_prefix(blocks) if blocks else None
        return [PrefixedCache(prefix, layer) for layer in range(self._layers)]

    def _shared_prefix(self, blocks: list[Block]) -> SharedPrefix:
        key = (blocks[-1].key, len(blocks))
        prefix = self._shared.get(key)
        if prefix is None:
            prefix = self._shared[key] = SharedPrefix.from_blocks(blocks)
            if len(self._shared) > SHARED_PREFIXES_KEPT:
                self._shared.popitem(last=False)  # rows running with it still hold it
        self._shared.move_to_end(key)
        return prefix

    def compute_prefix(self, seq: Sequence, upto: int, blocks: list[Block]) -> list[tuple]:
        """Prefill the row's first `upto` tokens on its own (after `blocks`, their first part
        already cached); each layer's (keys, values) over all of them."""
        tokens = seq.prompt[:upto]
        caches = PrefixCache.to_kv_caches(blocks) if blocks else make_prompt_cache(self.model)
        done = caches[0].offset
        while done < len(tokens):
            chunk = tokens[done: done + self._prefill_step]
            self.model(mx.array(chunk)[None], cache=caches)
            mx.eval([c.state for c in caches])
            done += len(chunk)
        return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]

    def choice_state(self, seq: Sequence, step: Step) -> tuple:
        """(model, the prompt's KV or None, the first token's log-probabilities) for scoring a
        choices row's choices (choices.py): the row's own cache while it is in the batch."""
        if step.finish_reason is not None:
            return self.model, None, None
        layer_caches, _ = self._gen.extract_cache([step.uid])[step.uid]
        return self.model, layer_caches, step.logprobs

    def _stops(self, params: SamplingParams) -> StopSequences:
        if not params.stop_token_ids:
            return self._eos_stops
        return StopSequences([(t,) for t in (*self.eos, *params.stop_token_ids)])

    def next(self) -> tuple[bool, list[Step]]:
        prompt_work, responses = self._gen.next()
        return bool(prompt_work), [Step(r.uid, r.token, r.finish_reason, r.logprobs)
                                   for r in responses]

    def remove(self, uid: int, in_batch: bool) -> None:
        if in_batch:
            self._gen.remove([uid])
        self._logprob_uids.discard(uid)

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
            self._gen = None
