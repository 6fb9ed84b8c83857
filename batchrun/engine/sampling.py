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


def make_sampler(params: SamplingParams, seed: int):
    """A sampler for one request; `seed` is used when the request sets none."""
    if params.greedy:
        return greedy
    filters = []
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    if 0 < params.top_p < 1:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    base = params.seed if params.seed is not None else seed
    keys = mx.random.split(mx.random.key(base & 0xFFFF_FFFF_FFFF_FFFF), params.max_tokens)
    inv_temp = 1.0 / params.temperature
    step = 0

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal step
        for f in filters:
            logprobs = f(logprobs)
        key = keys[min(step, params.max_tokens - 1)]
        step += 1
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return sample
