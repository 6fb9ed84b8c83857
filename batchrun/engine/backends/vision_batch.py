"""mlx-vlm's BatchGenerator, with rows that start from a cached prompt prefix.

mlx-vlm prefills a row from its input embeddings (image features merged into the text's). A row
inserted with a warm start, `warm[uid] = (n, caches)`, starts from `caches` (the KV of its first
n prompt tokens) and prefills only the rest: its tokens and prompt inputs are cut at n (`cut`),
the embeddings and every input aligned to positions (M-RoPE position ids, masks) alike. The rows
of one prefill group are right-padded to the longest rest, so each row's positions continue its
own prefix; mlx-vlm's batch caches roll that padding to the left when the prefill ends (the
layout its own automatic prefix cache uses, which batchrun does not turn on).

Only inputs whose meaning is known are cut; a row with any other (a model family whose prompt
inputs are not per position) gets None from `cut` and runs from its whole prompt.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.apc import make_warm_batch_exact_cache_multi
from mlx_vlm.generate import ar
from mlx_vlm.generate.ar import BatchGenerator, PromptProcessingBatch
from mlx_vlm.models.cache import make_prompt_cache

# Prompt inputs with one entry per prompt position: cut with the embeddings.
PER_POSITION = {"position_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}
# Prompt inputs that hold for the whole row wherever its prefill starts: M-RoPE's offset of the
# positions after the prompt.
PER_ROW = {"rope_deltas"}
# Read only to derive position ids: dropped where the position ids are given.
DERIVED = {"image_grid_thw"}


def cut(kwargs: dict, start: int, stop: int | None = None) -> dict | None:
    """A row's prompt inputs for positions [start, stop), or None if one cannot be cut."""
    embeds = kwargs["inputs_embeds"]
    out = {"inputs_embeds": embeds[:, start:stop]}
    for key, value in kwargs.items():
        if key == "inputs_embeds" or (key in DERIVED and "position_ids" in kwargs):
            continue
        if key in PER_POSITION and isinstance(value, mx.array) and \
                ar._is_sequence_aligned_prompt_kwarg(key, value, embeds.shape[1]):
            out[key] = ar._slice_sequence_aligned_prompt_kwarg(key, value, start, stop)
        elif key in PER_ROW:
            out[key] = value
        else:
            return None
    return out


def _pad_right(kwargs: dict, length: int) -> dict:
    """A row's prompt inputs padded at the end to `length` positions."""
    out = {}
    for key, value in kwargs.items():
        if key == "inputs_embeds":
            pad = length - value.shape[1]
            value = mx.concatenate(
                [value, mx.zeros((value.shape[0], pad, value.shape[2]), value.dtype)], axis=1) \
                if pad else value
        elif key in PER_POSITION:
            value = ar._pad_sequence_aligned_prompt_kwarg(key, value, length, left=False)
        out[key] = value
    return out


class WarmStartBatchGenerator(BatchGenerator):
    """mlx-vlm's BatchGenerator; `warm[uid] = (cached tokens, per-layer caches)` before the
    row's prefill makes it start from those caches (its prompt and inputs given past them)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.warm: dict[int, tuple[int, list]] = {}

    def remove(self, uid: int) -> bool:
        self.warm.pop(uid, None)
        return super().remove(uid)

    def _build_mixed_prompt_batch(self, sequences: list[tuple]) -> PromptProcessingBatch | None:
        """The prefill of a group of queued rows, when any of them starts warm (mlx-vlm's seam
        for its own prefix cache; otherwise its cold prefill runs)."""
        warm = [self.warm.pop(s[0], None) for s in sequences]
        if not any(warm):
            return super()._build_mixed_prompt_batch(sequences)
        uids, prompts, max_tokens, kwargs, processors, criteria = map(list, zip(*sequences,
                                                                                strict=True))
        kwargs = [kw if w is not None else cut(kw, 0) for kw, w in zip(kwargs, warm, strict=True)]
        if any(kw is None for kw in kwargs):  # the backend stops warm starts on such rows
            raise RuntimeError("a row's prompt inputs cannot be batched with cached prefixes")
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        embeds, merged = ar._merge_prefill_prompt_kwargs(
            [_pad_right(kw, longest) for kw in kwargs], [[0] * longest] * len(prompts))
        caches = [w[1] if w is not None else make_prompt_cache(self.model) for w in warm]
        cache, _ = make_warm_batch_exact_cache_multi(caches, [w[0] if w else 0 for w in warm])
        if cache is None:  # not plain KV caches: the engine's fault recovery reruns the rows
            raise RuntimeError("cached prefixes could not be merged into the batch's cache")
        return PromptProcessingBatch(
            model=self.model, uids=uids, input_ids=prompts, max_tokens=max_tokens,
            inputs_embeds=embeds, prompt_kwargs=merged, logits_processors=processors,
            thinking_budget_criteria=criteria, prefill_step_size=self.prefill_step_size,
            warm_cache=cache, right_pad_per_row=[longest - n for n in lengths],
            suffix_lens=lengths, greedy_sampling=self.greedy_sampling)
