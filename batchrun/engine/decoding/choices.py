"""Choices: log P(choice | prompt) for every choice, from the model, not by sampling.

A choices row's answer is picked from these: the most likely choice (greedy) or a seeded draw
from them. Token-by-token decoding under a grammar would let a weak model spell a choice with an
unusual tokenization and return a label its own probabilities rank last; picking from the
sequence probabilities keeps the label and `choice_probs` in agreement.

log P(c) = sum over c's tokens t_i of log p(t_i | prompt, t_<i). The first factor of every
choice comes from the distribution the batch already computed for the row's first token; the
rest from one extra forward pass of all choices side by side (each but its last token, right
padded) on copies of the row's prompt KV cache. Padding sits after a choice's real tokens, so
causal attention keeps it out of their scores.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache


def choice_logprobs(model: Any, prompt_cache: list[KVCache] | None, prompt: list[int],
                    first: mx.array | None, choices: list[list[int]],
                    start: int = 0) -> list[list[float]]:
    """Each choice's per-token log-probabilities after `prompt` (their sum: the choice's).

    `prompt_cache` holds the prompt's keys and values (one cache per layer) and `first` the
    log-probabilities of the token after the prompt; without `first` both are computed here,
    from `prompt_cache` holding the prompt's first `start` tokens when `start` is given (a
    cached prefix), else from nothing.
    """
    if first is None:
        if prompt_cache is None or not start:
            prompt_cache, start = make_prompt_cache(model), 0
        logits = model(mx.array(prompt[start:])[None], cache=prompt_cache)[0, -1]
        first = log_softmax(logits)
    first = first.astype(mx.float32)
    per_token = [[first[tokens[0]]] for tokens in choices]
    width = max(len(tokens) for tokens in choices) - 1
    if width > 0:
        k = len(choices)
        inputs = mx.array([tokens[:-1] + [0] * (width + 1 - len(tokens)) for tokens in choices])
        caches = [_repeated(layer, k) for layer in prompt_cache]
        logprobs = log_softmax(model(inputs, cache=caches))
        for j, tokens in enumerate(choices):
            per_token[j].extend(logprobs[j, i - 1, tokens[i]] for i in range(1, len(tokens)))
    flat = mx.stack([lp for row in per_token for lp in row]).tolist()
    out, at = [], 0
    for tokens in choices:
        out.append(flat[at: at + len(tokens)])
        at += len(tokens)
    return out


def answer_choice(seq: Any, model: Any, cache: list[KVCache] | None,
                  first: mx.array | None, start: int = 0) -> None:
    """Score a choices row's choices after its prompt and set its answer (engine sequence:
    choice_logprobs, tokens, answer, logprobs). `cache`: the prompt's KV as the batch holds it
    (with the first generated token, dropped here); or, without `first`, caches holding the
    prompt's first `start` tokens (a cached prefix) to compute the rest from; or None to
    compute it all."""
    if cache is not None and first is not None:
        for layer in cache:
            layer.offset = len(seq.prompt)
    per_token = choice_logprobs(model, cache, seq.prompt, first if cache is not None else None,
                                seq.choice_tokens, start)
    totals = [sum(lps) for lps in per_token]
    choices = seq.params.constraint.value
    seq.choice_logprobs = dict(zip(choices, totals, strict=True))
    picked = pick(totals, seq.params.temperature, seq.seed)
    seq.tokens = list(seq.choice_tokens[picked])
    seq.answer = choices[picked]
    if seq.logprobs is not None:
        seq.logprobs = per_token[picked]


def pick(logprobs: list[float], temperature: float, seed: int) -> int:
    """The greedy choice, or a seeded draw from the choices' probabilities at `temperature`."""
    if temperature == 0:
        return max(range(len(logprobs)), key=logprobs.__getitem__)
    scaled = mx.array(logprobs, dtype=mx.float32) / temperature
    key = mx.random.key(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return int(mx.random.categorical(scaled, key=key).item())


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def normalized(logprobs: dict[str, float]) -> dict[str, float]:
    """Probabilities over the choices (summing to 1) from their log-probabilities."""
    values = mx.softmax(mx.array(list(logprobs.values()), dtype=mx.float32)).tolist()
    return dict(zip(logprobs, values, strict=True))


def _repeated(layer: Any, k: int) -> Any:
    """`k` copies of one layer's prompt cache as one batch: a growing layer's keys and values
    up to its offset, a sliding window's in the order of their positions (its window and
    offset kept, so the choices attend what the answer's tokens would); a recurrent layer's
    state arrays."""
    if isinstance(layer, ArraysCache):
        cache = ArraysCache(size=len(layer.cache))
        cache.cache = [None if a is None else mx.repeat(a, k, axis=0) for a in layer.cache]
        return cache
    if isinstance(layer, RotatingKVCache):
        cache = RotatingKVCache(max_size=layer.max_size, keep=layer.keep)
        keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
        cache._idx = keys.shape[2]
    else:
        cache = KVCache()
        keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
    cache.keys = mx.repeat(keys, k, axis=0)
    cache.values = mx.repeat(values, k, axis=0)
    cache.offset = layer.offset
    return cache
