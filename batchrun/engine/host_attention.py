"""Attention of several queries a row on the CPU, through NumPy.

MLX 0.32's CPU backend computes `exp` one element at a time (~12-16 ns an element on the 2-core
CPU here), and its attention on the CPU is unfused (scores, mask, softmax, values as separate
ops), so with a few queries a row the softmax is most of a layer's attention: at 8 rows x 300
keys x 7 queries, 1.2 of its 1.75 ms. NumPy's `exp` is vectorized, and its matmuls go to
OpenBLAS too. So on the CPU every attention call with more than one query a row (a prompt's
prefill, a speculative step's verification) goes through `attention` here; a decode step (one
query a row) stays in MLX, whose graph a NumPy round trip would cut in two (measured: plain
decoding 1.3x slower so).

Inputs as mlx-lm's attention function takes them: queries (B, H, L, D), keys and values
(B, KV, S, D / Dv) with H a multiple of KV, and mlx-lm's mask: None, "causal" (the last L keys
are the queries' own), a boolean array (True: attend) or an additive one, broadcastable to
(B, 1, L, S). A query with nothing to attend gets zeros (MLX gives a boolean-masked one the
mean of the values, and an additive one NaN: neither is read, as such queries are padding).
Greedy tokens are the same as MLX's attention gives (float32 rounding apart; tests).

The scores are materialized, as MLX's unfused attention does, a chunk of rows (and, for a long
prompt, of queries) at a time: at most MAX_SCORE_ELEMENTS floats at once.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

# False (or BATCHRUN_HOST_ATTENTION=0): the CPU's attention stays MLX's.
ENABLED = os.environ.get("BATCHRUN_HOST_ATTENTION", "1") != "0"
MAX_SCORE_ELEMENTS = 1 << 24


def wanted() -> bool:
    return ENABLED and mx.default_device() == mx.cpu


def serves(queries: mx.array, keys, cache, sinks, mask) -> bool:
    """Whether `attention` takes this call: the CPU, several queries a row of a model running
    with a KV cache (inference: a forward without one may be traced, by `mx.compile` or a
    gradient, and a traced array has no values for NumPy), plain float keys (not a quantized
    cache's tuples), no attention sinks, and one of mlx-lm's masks (a mask of its own for each
    head is left to MLX)."""
    if not (ENABLED and queries.ndim == 4 and queries.shape[2] > 1 and sinks is None
            and isinstance(cache, (KVCache, BatchKVCache)) and not hasattr(cache, "bits")
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
    kv_heads, S = keys.shape[1], keys.shape[2]
    G = H // kv_heads
    q = _host(queries).reshape(B, kv_heads, G * L, D) * np.float32(scale)
    keys_t = _host(keys).transpose(0, 1, 3, 2)
    vals = _host(values)
    allowed, added = _mask(mask, B, L, S)
    out = np.empty((B, kv_heads, G, L, vals.shape[-1]), np.float32)
    rows = max(1, MAX_SCORE_ELEMENTS // (H * L * S))
    span = L if H * L * S <= MAX_SCORE_ELEMENTS else max(1, MAX_SCORE_ELEMENTS // (H * S))
    qg = q.reshape(B, kv_heads, G, L, D)
    for r in range(0, B, rows):
        for a in range(0, L, span):
            b = min(L, a + span)
            part = qg[r: r + rows, :, :, a:b]
            n = part.shape[0]
            scores = part.reshape(n, kv_heads, G * (b - a), D) @ keys_t[r: r + rows]
            scores = scores.reshape(n, kv_heads, G, b - a, S)
            if added is not None:
                scores += added[r: r + rows, :, :, a:b]
            if allowed is not None:
                scores = np.where(allowed[r: r + rows, :, :, a:b], scores, -np.inf)
            o, _ = softmax_attend(scores, vals[r: r + rows, :, None])
            out[r: r + rows, :, :, a:b] = o
    return mx.array(out.reshape(B, H, L, -1)).astype(queries.dtype)


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


def _mask(mask, B: int, L: int, S: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(boolean mask, additive mask), each None or (B, 1, 1, L, S) to match the scores'
    (rows, KV heads, query heads a KV head, L, S)."""
    if mask is None:
        return None, None
    if isinstance(mask, str):  # "causal"
        allowed = np.arange(S)[None, :] <= np.arange(S - L, S)[:, None]
        return np.broadcast_to(allowed, (B, 1, 1, L, S)), None
    m = np.asarray(mask if mask.dtype in (mx.bool_, mx.float32) else mask.astype(mx.float32))
    m = np.broadcast_to(m, (B, 1, L, S))[:, :, None]
    return (m, None) if m.dtype == np.bool_ else (None, m)
