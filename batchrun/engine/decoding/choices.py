"""Choices: log P(choice | prompt) for every choice, from the model, not by sampling.

A choices row's answer is picked from these: the most likely choice (greedy) or a seeded draw
from them. Token-by-token decoding under a grammar would let a weak model spell a choice with an
unusual tokenization and return a label its own probabilities rank last; picking from the
sequence probabilities keeps the label and `choice_probs` in agreement.

log P(c) = sum over c's tokens t_i of log p(t_i | prompt, t_<i). The first factor of every
choice comes from the distribution the batch already computed for the row's first token: when
every choice is one token, that is all. The rest comes from a forward pass over each choice but
its last token, right padded (padding sits after a choice's real tokens, so causal attention
keeps it out of their scores). Choices sharing leading tokens share one such sequence (a
trie's paths: `choice_paths`), and the text backend runs the sequences of every row that
finished its prompt in a step as one batch after the rows' own KV (text.py `score_choices`);
`choice_logprobs` scores one row alone, on copies of its prompt's KV.
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


def choice_paths(choices: list[list[int]]) -> tuple[list[list[int]], list[int | None]]:
    """The token sequences a forward must run to score `choices` past their first token, and
    each choice's sequence (None for a one-token choice). A choice needs its tokens but the last
    as inputs; inputs that begin another choice's inputs are read from that one's positions, so
    only the longest of each branch runs (the leaves of the choices' trie)."""
    inputs = [tuple(tokens[:-1]) for tokens in choices]
    paths: list[tuple[int, ...]] = []
    for seq in sorted({s for s in inputs if s}, key=len, reverse=True):
        if not any(p[: len(seq)] == seq for p in paths):
            paths.append(seq)
    where = [None if not seq else next(i for i, p in enumerate(paths) if p[: len(seq)] == seq)
             for seq in inputs]
    return [list(p) for p in paths], where


def batch_choice_logprobs(model: Any, firsts: list[mx.array], rows: list[list[list[int]]],
                          caches_for: Any, chunk_elements: int = 1 << 27
                          ) -> list[list[list[float]]]:
    """Each row's choices' per-token log-probabilities, every row at once: `firsts[r]` is row r's
    first-token log-probabilities, `rows[r]` its choices' tokens, and `caches_for(owners)` the
    layer caches of a batch whose entry e continues row `owners[e]`'s prompt. One forward over
    every row's choice paths (in chunks of at most `chunk_elements` logits) and one read."""
    picks = [firsts[r].astype(mx.float32)[mx.array([t[0] for t in choices])]
             for r, choices in enumerate(rows)]
    entries: list[tuple[int, list[int]]] = []  # (row, path)
    wanted: list[tuple[int, int, int]] = []  # (entry, position, token): later tokens, in order
    for r, choices in enumerate(rows):
        paths, where = choice_paths(choices)
        base = len(entries)
        entries.extend((r, path) for path in paths)
        for tokens, path in zip(choices, where, strict=True):
            if path is not None:
                wanted.extend((base + path, i - 1, tokens[i]) for i in range(1, len(tokens)))
    later: list[mx.array] = []  # chunk by chunk: `wanted` sorted by entry
    order = sorted(range(len(wanted)), key=lambda w: wanted[w][0])
    if entries:
        width = max(len(path) for _, path in entries)
        size = max(1, chunk_elements // (width * firsts[0].shape[-1]))
        at = 0
        for lo in range(0, len(entries), size):
            part = entries[lo: lo + size]
            here = []
            while at < len(order) and wanted[order[at]][0] < lo + size:
                here.append(wanted[order[at]])
                at += 1
            if not here:
                continue
            inputs = mx.array([path + [0] * (width - len(path)) for _, path in part])
            logits = model(inputs, cache=caches_for([r for r, _ in part]))
            picked = logits[mx.array([e - lo for e, _, _ in here]),
                            mx.array([i for _, i, _ in here])].astype(mx.float32)
            tokens = mx.array([t for _, _, t in here])[:, None]
            later.append(mx.take_along_axis(picked, tokens, axis=-1)[:, 0]
                         - mx.logsumexp(picked, axis=-1))
            if lo + size < len(entries):
                mx.eval(later[-1])  # this chunk's logits are freed before the next one's
    first_values = mx.concatenate(picks).tolist()
    later_values = [0.0] * len(wanted)
    for w, value in zip(order, mx.concatenate(later).tolist() if later else [], strict=True):
        later_values[w] = value
    out, a, b = [], 0, 0
    for choices in rows:
        row = []
        for tokens in choices:
            row.append([first_values[a], *later_values[b: b + len(tokens) - 1]])
            a, b = a + 1, b + len(tokens) - 1
        out.append(row)
    return out


def set_answer(seq: Any, per_token: list[list[float]]) -> None:
    """A choices row's answer from its choices' per-token log-probabilities (engine sequence:
    choice_logprobs, tokens, answer, logprobs)."""
    totals = [sum(lps) for lps in per_token]
    choices = seq.params.constraint.value
    seq.choice_logprobs = dict(zip(choices, totals, strict=True))
    picked = pick(totals, seq.params.temperature, seq.seed)
    seq.tokens = list(seq.choice_tokens[picked])
    seq.answer = choices[picked]
    if seq.logprobs is not None:
        seq.logprobs = per_token[picked]


def score_alone(seq: Any, model: Any, cache: list[KVCache] | None, first: mx.array | None,
                start: int = 0) -> list[list[float]]:
    """One choices row's choices' per-token log-probabilities. `cache`: the prompt's KV (with
    anything after it dropped here) and `first` the first token's log-probabilities; or,
    without `first`, caches holding the prompt's first `start` tokens (a cached prefix) to
    compute the rest from; or None to compute it all."""
    if cache is not None and first is not None:
        for layer in cache:
            layer.offset = len(seq.prompt)
    return choice_logprobs(model, cache, seq.prompt, first if cache is not None else None,
                           seq.choice_tokens, start)


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
