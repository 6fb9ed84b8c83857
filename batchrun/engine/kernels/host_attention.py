"""Attention of several queries a row on the CPU, through NumPy, in the engine's forwards.

MLX 0.32's CPU backend computes `exp` one element at a time (~12-16 ns an element on the 2-core
CPU here), and its attention on the CPU is unfused (scores, mask, softmax, values as separate
ops), so with a few queries a row the softmax is most of a layer's attention: at 8 rows x 300
keys x 7 queries, 1.2 of its 1.75 ms. NumPy's `exp` is vectorized, and its matmuls go to
OpenBLAS too. So on the CPU every attention call of the engine's own forwards (`forwards()`,
around `Engine.step`: the batch's prefills and steps, a shared prefix's computation, a choices
row's scoring) with more than one query a row (a prompt's prefill, a speculative step's
verification) goes through `attention` here; a decode
step (one query a row) stays in MLX, whose graph a NumPy round trip would cut in two
(measured: plain decoding 1.3x slower so). The routing is per model module (shared_prefix's
`install`), so it would reach any forward of that architecture in the process: outside
`forwards()` (a user's own mlx-lm calls, a forward under a gradient or `mx.compile`, where the
arrays have no values yet or NumPy would cut the gradient) MLX's attention runs as before.

Inputs as mlx-lm's attention function takes them: queries (B, H, L, D), keys and values
(B, KV, S, D / Dv) with H a multiple of KV, and mlx-lm's mask: None, "causal" (the last L keys
are the queries' own), a boolean array (True: attend) or an additive one, broadcastable to
(B, 1, L, S). A query with nothing to attend gets zeros (MLX gives a boolean-masked one the
mean of the values, and an additive one NaN: neither is read, as such queries are padding).
Greedy tokens are the same as MLX's attention gives (float32 rounding apart; tests).

It works a chunk of rows (and, for a long prompt, of queries) at a time: a chunk's scores and
its rows' keys and values in float32 stay near MAX_SCORE_ELEMENTS floats (a half-precision
cache is converted a chunk at a time; a float32 one is read in place). MLX's own attention
holds every row's scores at once.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

# False (or BATCHRUN_HOST_ATTENTION=0): the CPU's attention stays MLX's.
ENABLED = os.environ.get("BATCHRUN_HOST_ATTENTION", "1") != "0"
MAX_SCORE_ELEMENTS = 1 << 24
_in_forwards = contextvars.ContextVar("batchrun_host_attention", default=False)


def in_forwards() -> bool:
    """Whether this call is inside one of the engine's own forwards."""
    return _in_forwards.get()


@contextmanager
def forwards() -> Iterator[None]:
    """The engine's own forwards run inside: only these take `attention`."""
    token = _in_forwards.set(True)
    try:
        yield
    finally:
        _in_forwards.reset(token)


def wanted() -> bool:
    return ENABLED and mx.default_device() == mx.cpu


# Caches whose keys a prefill's queries attend in the order of their positions, with one of
# mlx-lm's masks (a sliding window's included).
_CACHES = (KVCache, BatchKVCache, RotatingKVCache, BatchRotatingKVCache)


def serves(queries: mx.array, keys, cache, sinks, mask) -> bool:
    """Whether `attention` takes this call: one of the engine's forwards (`forwards()`) on the
    CPU, several queries a row of a model running with a KV cache, float32 queries and keys
    (not a quantized cache's tuples), no attention sinks, and one of mlx-lm's masks (a mask of
    its own for each head is left to MLX). A half-precision model's attention stays MLX's:
    MLX's CPU rounds it to the model's dtype at each step, and float32 rounded once changed the
    greedy tokens of a random bf16 model (mlx-lm's on 12 of 12 rows with MLX's attention, 9 of
    12 with this one; rounded where MLX rounds, 99.93% of the elements agreed and still 17 of
    24 rows). On the CPU the weight plan holds models in float32 anyway (models/weights.py)."""
    if not (ENABLED and _in_forwards.get() and queries.ndim == 4 and queries.shape[2] > 1
            and sinks is None and queries.dtype == mx.float32
            and isinstance(cache, _CACHES) and not hasattr(cache, "bits")
            and isinstance(keys, mx.array) and keys.ndim == 4
            and mx.default_device() == mx.cpu):
        return False
    if mask is None or isinstance(mask, str):
        return mask in (None, "causal")
    B, _, L, _ = queries.shape
    shape = (B, 1, L, keys.shape[2])
    try:
        return isinstance(mask, mx.array) and np.broadcast_shapes(mask.shape, shape) == shape
    except ValueError:
        return False


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask) -> mx.array:
    """mlx-lm's scaled_dot_product_attention, computed in NumPy (float32), in queries' dtype."""
    B, H, L, D = queries.shape
    kv_heads, S, Dv = keys.shape[1], keys.shape[2], values.shape[-1]
    G = H // kv_heads
    q = (_host(queries) * np.float32(scale)).reshape(B, kv_heads, G, L, D)
    masked = _masks(mask, B, L, S)
    out = np.empty((B, kv_heads, G, L, Dv), np.float32)
    rows = max(1, MAX_SCORE_ELEMENTS // max(H * L * S, kv_heads * S * (D + Dv)))
    span = L if H * L * S <= MAX_SCORE_ELEMENTS else max(1, MAX_SCORE_ELEMENTS // (H * S))
    for r in range(0, B, rows):
        keys_t = _host(keys[r: r + rows]).transpose(0, 1, 3, 2)
        vals = _host(values[r: r + rows])[:, :, None]
        n = keys_t.shape[0]
        for a in range(0, L, span):
            b = min(L, a + span)
            scores = q[r: r + n, :, :, a:b].reshape(n, kv_heads, G * (b - a), D) @ keys_t
            scores = scores.reshape(n, kv_heads, G, b - a, S)
            allowed, added = masked(r, r + n, a, b)
            if added is not None:
                scores += added
            if allowed is not None:
                scores = np.where(allowed, scores, np.float32(-np.inf))
            out[r: r + n, :, :, a:b], _ = softmax_attend(scores, vals)
    return mx.array(out.reshape(B, H, L, Dv)).astype(queries.dtype)


def softmax_attend(scores: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Softmax of float32 `scores` (changed in place) over their last axis, times `values`:
    (output, log-sum-exp of the scores); a query with nothing to attend (all -inf) gives
    zeros and -inf. `values` broadcast against the scores' leading axes."""
    peak = scores.max(axis=-1, keepdims=True)
    peak[~np.isfinite(peak)] = 0.0
    np.subtract(scores, peak, out=scores)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    out = (scores @ values) / np.maximum(total, np.float32(1e-30))
    with np.errstate(divide="ignore"):
        return out, (peak + np.log(total))[..., 0]


def _host(x: mx.array) -> np.ndarray:
    return np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))


def _masks(mask, B: int, L: int, S: int):
    """The mask's part for rows r0:r1 and queries a:b, as (boolean, additive), each None or
    shaped to broadcast against those scores (rows, KV heads, query heads a KV head, b - a, S)."""
    if mask is None:
        return lambda r0, r1, a, b: (None, None)
    if isinstance(mask, str):  # "causal": query i (of L) sees keys up to S - L + i
        return lambda r0, r1, a, b: (np.arange(S) <= np.arange(S - L + a, S - L + b)[:, None],
                                     None)
    m = np.asarray(mask if mask.dtype in (mx.bool_, mx.float32) else mask.astype(mx.float32))
    m = np.broadcast_to(m, (B, 1, L, S))[:, :, None]
    boolean = m.dtype == np.bool_
    return lambda r0, r1, a, b: ((m[r0:r1, :, :, a:b], None) if boolean
                                 else (None, m[r0:r1, :, :, a:b]))
