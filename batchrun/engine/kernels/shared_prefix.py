"""One copy of a shared prompt prefix's KV, attended by every row that starts with it.

Rows whose prompts start with the same cached prefix (a labeling job's long instruction) do not
each hold a copy of its keys and values: the batch's KV cache (`SharedPrefixBatchCache`, one per
layer) holds only each row's own tokens, and a reference to the one `SharedPrefix` the row
starts with. Attention for such a batch is cascade attention (as in FlashInfer's cascade
inference): all the rows' queries against the shared prefix, with no mask, as one matmul per
distinct prefix; each row's queries against its own tokens, with the usual causal and padding
mask; the two merged by their log-sum-exp. The prefix is read once per step instead of once per
row, and admission budgets a row's own tokens only.

It plugs into mlx-lm's models without forking them: through the cache objects they call
(`update_and_fetch`, `make_mask`, `offset` for RoPE positions, which count the prefix) and the
attention function their modules share (`scaled_dot_product_attention`, wrapped per model
module by `install`). A batch without a shared prefix takes MLX's fused attention as before;
on CUDA, decode steps of these batch caches (shared prefix or not) take each row's key range
instead of a mask (decode_attention.py), for the rows' own part here too, and the prefix part
of a half-precision model is a flash-attention kernel on tensor cores (prefix_attention.py).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from batchrun.engine.kernels import decode_attention, host_attention, prefix_attention
from batchrun.engine.kernels.decode_attention import attend, ranged_attention
from batchrun.engine.kernels.host_attention import softmax_attend

log = logging.getLogger("batchrun")
# Scores of the prefix part are materialized: row chunks keep them under this many elements.
MAX_SCORE_ELEMENTS = 1 << 24
# A prefix part with more scores than this (a prefill's) is evaluated chunk by chunk, in chunks
# of EVAL_CHUNK_ELEMENTS: MLX's lazy graph would otherwise hold every chunk's scores at once
# (measured on the H200: 15.8 GiB peak for 512 rows under a 1,000-token prefix, the weights 2.5;
# 8.6-8.7 GiB in 32M-score chunks; 128M-score chunks were ~0.25 s faster at 0.9 GiB more, 16M
# ones slower at the same memory). Decode steps stay below it.
EVAL_CHUNKS_ABOVE = 1 << 26
EVAL_CHUNK_ELEMENTS = 1 << 25
# Chunks are scheduled with mx.async_eval (no wait for each before building the next), every
# ASYNC_WINDOW-th waited for (None: none), which bounds the chunks in flight. Measured on the
# H200 (512 rows under a 1,000-token prefix, one process): waiting for every chunk 324 / 556
# rows/s (cold / warm) at 5.9-6.0 GiB; a window of 4, 497 / 589 rows/s at 6.0-6.1 GiB; no
# window, +3-4 GiB. LOW_PRECISION_SCORES: a half-precision model's prefix scores stay in its
# dtype for the two matmuls (softmax statistics in float32, the weights cast back as flash
# attention does): faster warm, but its cold run compiles per chunk shape and greedy tokens
# change (benchmarks/history/scripts/profile_labeling.py variants).
ASYNC_CHUNKS = True
ASYNC_WINDOW: int | None = 4
LOW_PRECISION_SCORES = False
# On the CPU, prefix parts with at least this many scores go through NumPy (_attend_prefix_host);
# below it the round trip costs more than MLX's slow exp. With OpenBLAS's threads not spinning
# between calls (blas.py) that is small: 4M scores (the earlier bound) kept the decode steps
# and most suffix prefills in MLX, and the labeling benchmark 1.4-2.2x slower
# (scripts/ab_labeling_cpu.py, variant host4m; benchmarks/history/BENCHMARKS-2026-12.md).
HOST_MIN_SCORES = 1 << 14
# On Metal, the prefix part runs as MLX's fused attention (_attend_prefix_fused), which never
# holds the score matrix. Not on CUDA: there MLX 0.32 materializes these shapes' scores whole
# (measured on the H200: 22 GiB peak against 15.8, and no faster).
FUSED_ON_METAL = True
# The rows' own KV grows in steps of this many tokens up to mlx-lm's step (256), then in its
# steps: a labeling row holds a few tens of its own tokens, and 256 slots a row would be most
# of the batch's memory.
OWN_STEP = 32
# Tails (tokens rows share past their cached blocks) kept with a prefix for rows to come.
TAILS_KEPT = 4
_installed: dict[str, Any] = {}  # model module name -> its original attention function
_refused: set[str] = set()  # model types already logged as unsupported


class SharedPrefix:
    """A prefix's KV for every layer, each (1, kv_heads, length, head_dim): held once. A
    prefix made of cached blocks keeps the longer prefixes computed on top of it: its tails,
    each the blocks' KV followed by the `tail` tokens' (TextBackend._share_tails)."""

    def __init__(self, keys: list[mx.array], values: list[mx.array],
                 tail: tuple[int, ...] = ()):
        self.keys, self.values = keys, values
        self.length = keys[0].shape[2]
        self.tail = tail
        self.tails: list[SharedPrefix] = []  # newest last
        self._host: dict[int, tuple] = {}  # layer -> NumPy (keys transposed, values), CPU only

    def tail_for(self, prompt: list[int], start: int) -> SharedPrefix | None:
        """The longest kept tail that `prompt` continues with at `start` (where this prefix
        ends), leaving the prompt a token of its own."""
        room = len(prompt) - start - 1
        best = None
        for t in self.tails:
            n = len(t.tail)
            if n <= room and (best is None or n > len(best.tail)) \
                    and tuple(prompt[start: start + n]) == t.tail:
                best = t
        return best

    def add_tail(self, tail: SharedPrefix) -> SharedPrefix:
        self.tails.append(tail)
        del self.tails[:-TAILS_KEPT]  # rows running with an older one still hold it
        return tail

    def host(self, layer: int) -> tuple:
        """A layer's keys, transposed for the score matmul, and values as float32 NumPy
        arrays (contiguous, so NumPy's matmul goes to BLAS); made once."""
        import numpy as np

        if layer not in self._host:
            keys = np.asarray(self.keys[layer].astype(mx.float32))[0]
            values = np.asarray(self.values[layer].astype(mx.float32))[0]
            self._host[layer] = (np.ascontiguousarray(keys.transpose(0, 2, 1)),
                                 np.ascontiguousarray(values))
        return self._host[layer]

    @classmethod
    def from_blocks(cls, blocks) -> SharedPrefix:
        layers = range(len(blocks[0].keys))
        keys = [mx.concatenate([b.keys[i] for b in blocks], axis=2) for i in layers]
        values = [mx.concatenate([b.values[i] for b in blocks], axis=2) for i in layers]
        mx.eval(keys, values)
        return cls(keys, values)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def __deepcopy__(self, memo) -> SharedPrefix:
        return self  # held once: a copied batch still shares it (mlx-lm deep-copies on split)


class PrefixedCache(KVCache):
    """One row's cache for one layer as it is inserted: empty, after `prefix` (or none). The
    batch merges these into a SharedPrefixBatchCache."""

    def __init__(self, prefix: SharedPrefix | None, layer: int):
        super().__init__()
        self.prefix, self.layer = prefix, layer

    @classmethod
    def merge(cls, caches: list[PrefixedCache]) -> SharedPrefixBatchCache:
        if any(c.keys is not None for c in caches):
            raise ValueError("a PrefixedCache is merged before any of its own tokens")
        return SharedPrefixBatchCache([c.prefix for c in caches], caches[0].layer)


class CopiedCache(KVCache):
    """One row's cache for one layer as it is inserted, without a shared prefix: empty, or a copy
    of the row's cached blocks (--no-shared-prefix). The batch merges these as mlx-lm merges
    its own, into a SharedPrefixBatchCache without prefixes: decode steps still take row
    ranges (decode_attention.py) instead of a mask."""

    def __init__(self, layer: int = 0):
        super().__init__()
        self.layer = layer

    @classmethod
    def merge(cls, caches: list[CopiedCache]) -> SharedPrefixBatchCache:
        merged = BatchKVCache.merge(caches)  # the copies left-padded to one length
        batch = SharedPrefixBatchCache([None] * len(caches), caches[0].layer)
        batch.keys, batch.values = merged.keys, merged.values
        batch.left_padding, batch.offset, batch._idx = \
            merged.left_padding, merged.offset, merged._idx
        return batch


class SharedPrefixBatchCache(BatchKVCache):
    """mlx-lm's batch cache of the rows' own tokens, plus the prefix each row starts with.
    `offset` (each row's RoPE position) counts the prefix; the stored keys do not hold it."""

    def __init__(self, prefixes: list[SharedPrefix | None], layer: int):
        super().__init__([0] * len(prefixes))
        self.prefixes, self.layer = list(prefixes), layer
        self.offset = self.offset + mx.array([_length(p) for p in prefixes])
        self._groups: list | None = None  # groups(), until the rows change

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.step = OWN_STEP if self._idx + keys.shape[2] < BatchKVCache.step else \
            BatchKVCache.step
        return super().update_and_fetch(keys, values)

    def filter(self, batch_indices) -> None:
        super().filter(batch_indices)
        index = batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
        self.prefixes = [self.prefixes[i] for i in index]
        self._groups = None

    def extend(self, other: BatchKVCache) -> None:
        theirs = getattr(other, "prefixes", None) or [None] * other.offset.shape[0]
        super().extend(other)
        self.prefixes = self.prefixes + list(theirs)
        self._groups = None

    def extract(self, idx: int) -> KVCache:
        """Row `idx`'s whole KV (its prefix, then its own tokens) as a plain KVCache."""
        own = super().extract(idx)
        prefix = self.prefixes[idx]
        if prefix is None:
            return own
        cache = KVCache()
        cache.keys = mx.concatenate([prefix.keys[self.layer], own.keys], axis=2)
        cache.values = mx.concatenate([prefix.values[self.layer], own.values], axis=2)
        cache.offset = cache.keys.shape[2]
        return cache

    def groups(self) -> list[tuple[SharedPrefix, list[int]]]:
        """Each distinct prefix with the rows that start with it (none: a plain batch)."""
        if self._groups is None:
            rows: dict[int, tuple[SharedPrefix, list[int]]] = {}
            for i, prefix in enumerate(self.prefixes):
                if prefix is not None:
                    rows.setdefault(id(prefix), (prefix, []))[1].append(i)
            self._groups = list(rows.values())
        return self._groups


def _first_attention(layers: Any) -> Any:
    """The first layer's attention module that has one (a hybrid model's first layers may be
    recurrent)."""
    return next((a for a in (getattr(layer, "self_attn", None) for layer in layers or ())
                 if a is not None), None)


def attention_shape(model: Any) -> tuple[mx.Dtype, int, int] | None:
    """(activation dtype, head dimension, query heads a KV head) of the model's attention, as
    its first layer declares them (mlx-lm's attention modules keep n_heads, n_kv_heads, a
    scale, and most of them head_dim; without it the scale is taken as head_dim ** -0.5);
    None where it does not."""
    from mlx.utils import tree_flatten

    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None),
                                                         "layers", None)
    attention = _first_attention(layers)
    heads, kv_heads, scale = (getattr(attention, name, None)
                              for name in ("n_heads", "n_kv_heads", "scale"))
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads
            and heads % kv_heads == 0 and isinstance(scale, float) and scale > 0):
        return None
    dtype = next((a.dtype for _, a in tree_flatten(model.parameters())
                  if a.dtype in (mx.bfloat16, mx.float16, mx.float32)), None)
    head_dim = getattr(attention, "head_dim", None)
    if not (isinstance(head_dim, int) and head_dim > 0):  # a custom scale would mislead
        head_dim = round(scale ** -2)
    return None if dtype is None else (dtype, head_dim, heads // kv_heads)


def _length(prefix: SharedPrefix | None) -> int:
    return 0 if prefix is None else prefix.length


def install(model: Any, warn: bool = True) -> bool:
    """Route the model's attention through `attention` (once per model module): the shared
    prefix's, CUDA's decode kernel, the CPU's host attention (host_attention.py). False, logged
    once unless not `warn`, for an architecture whose layers do not call the shared attention
    function."""
    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None),
                                                         "layers", None)
    attention = _first_attention(layers)
    module = sys.modules.get(type(attention).__module__) if attention is not None else None
    original = getattr(module, "scaled_dot_product_attention", None) if module else None
    if original is None:
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
        if warn and kind not in _refused:
            _refused.add(kind)
            log.warning("%s models do not call mlx-lm's shared attention function: rows "
                        "sharing a prefix each hold a copy of it, and decode steps take a "
                        "mask", kind)
        return False
    if module.__name__ not in _installed:
        _installed[module.__name__] = original

        def routed(queries, keys, values, cache, scale, mask, sinks=None):
            if isinstance(cache, SharedPrefixBatchCache) and cache.groups():
                return attention_with_prefix(queries, keys, values, cache, scale, mask, sinks)
            # mlx-lm's own batch cache too: a family with sliding or recurrent layers keeps it
            # for its full-attention layers (the same left padding and length)
            if type(cache) in (SharedPrefixBatchCache, BatchKVCache) and \
                    decode_attention.serves(queries, keys, values):
                out, lse = ranged_attention(queries, cache.keys, cache.values,
                                            cache.left_padding, scale, cache._idx,
                                            with_lse=sinks is not None)
                if sinks is None:
                    return out
                # a sink logit a head joins each row's softmax denominator, no value
                sink = sinks.astype(mx.float32)[None]
                out = out * mx.exp(lse - mx.logaddexp(lse, sink))[..., None, None]
                return out.astype(queries.dtype)
            if host_attention.serves(queries, keys, cache, sinks, mask):
                return host_attention.attention(queries, keys, values, scale, mask)
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

        module.scaled_dot_product_attention = routed
    return True


def attention_with_prefix(queries: mx.array, keys: mx.array, values: mx.array,
                          cache: SharedPrefixBatchCache, scale: float, mask,
                          sinks: mx.array | None = None) -> mx.array:
    """Cascade attention: each row's own tokens (masked), and its shared prefix (unmasked, all
    rows of a prefix at once), merged by log-sum-exp; `sinks` (one logit per query head, as
    gpt-oss has) join the softmax's denominator."""
    B, n_heads, L, D = queries.shape
    groups = cache.groups()
    if sinks is None and len(groups) == 1 and len(groups[0][1]) == B:  # one prefix for all
        prefix = groups[0][0]
        keys_p, values_p = prefix.keys[cache.layer], prefix.values[cache.layer]
        if prefix_attention.serves_cascade(queries, cache.keys, keys_p, values_p):
            # A prefill (or a speculative verification): the whole of it in one kernel. It
            # takes the rows' own keys from their left padding on, causal, in place of `mask`:
            # the mask this batch cache makes (make_mask) is exactly that.
            out = prefix_attention.cascade_attention(
                queries, cache.keys, cache.values, cache.left_padding, cache._idx, keys_p,
                values_p, scale)
            if out is not None:
                if queries.size // D * prefix.length > EVAL_CHUNKS_ABOVE:
                    mx.eval(out)  # as below: one layer's intermediates at a time
                return out
    kv_heads = keys.shape[1]
    G = n_heads // kv_heads  # query heads per KV head
    q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, G * L, D)
    if decode_attention.serves(queries, keys, values):  # a decode step on CUDA: no mask
        out, lse = ranged_attention(queries, cache.keys, cache.values, cache.left_padding,
                                    scale, cache._idx, with_lse=True)
        out, lse = out.reshape(B, kv_heads, G, D), lse.reshape(B, kv_heads, G)
    else:
        scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # (B, kv_heads, G*L, own)
        out, lse = attend(scores, values, _own_mask(mask, B, G, L, keys.shape[2]))
    wide = False  # a prefill the kernel served that is worth evaluating layer by layer
    for prefix, rows in groups:
        whole = len(rows) == B
        index = None if whole else mx.array(rows)
        q_rows = q if whole else q[index]
        on_cpu = mx.default_device() == mx.cpu
        keys_p, values_p = prefix.keys[cache.layer], prefix.values[cache.layer]
        raw = (queries if whole else queries[index]).reshape(len(rows), kv_heads, G * L, D)
        fused = prefix_attention.prefix_attention(raw, keys_p, values_p, scale) \
            if prefix_attention.serves(raw, keys_p, values_p) else None
        if fused is not None:  # CUDA: fused, on tensor cores
            p_out, p_lse = fused
            wide |= L > 1 and raw.size // D * prefix.length > EVAL_CHUNKS_ABOVE
        elif on_cpu and q_rows.size // D * prefix.length >= HOST_MIN_SCORES:
            p_out, p_lse = _attend_prefix_host(q_rows, *prefix.host(cache.layer))
        elif FUSED_ON_METAL and not on_cpu and mx.metal.is_available():
            p_out, p_lse = _attend_prefix_fused(raw, keys_p, values_p, scale)
        else:
            p_out, p_lse = _attend_prefix(q_rows, keys_p, values_p)
        o_rows, l_rows = (out, lse) if whole else (out[index], lse[index])
        merged = mx.logaddexp(l_rows, p_lse)
        o_rows = (o_rows * mx.exp(l_rows - merged)[..., None]
                  + p_out * mx.exp(p_lse - merged)[..., None])
        if whole:
            out, lse = o_rows, merged
        else:
            out[index], lse[index] = o_rows, merged
    if sinks is not None:  # (n_heads,) -> each query row of (kv_heads, G * L)
        sink = mx.repeat(sinks.astype(mx.float32).reshape(kv_heads, G), L, axis=1)[None]
        out = out * mx.exp(lse - mx.logaddexp(lse, sink))[..., None]
    out = out.reshape(B, n_heads, L, D).astype(queries.dtype)
    if wide:
        # A whole prefill's graph, scheduled at once, keeps every layer's intermediates until
        # the GPU is done with it (measured on the H200: 19.2 GiB peak against 7.1 for 512
        # labeling rows); waiting here holds one layer's at a time.
        mx.eval(out)
    return out


def _attend_prefix(q: mx.array, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """Every row's queries against one prefix: rows side by side as one matmul's rows, in
    chunks that bound the score matrix."""
    rows, kv_heads, width, D = q.shape
    length = keys.shape[2]
    per_row = kv_heads * width * length
    bounded = rows * per_row > EVAL_CHUNKS_ABOVE
    chunk = max(1, (EVAL_CHUNK_ELEMENTS if bounded else MAX_SCORE_ELEMENTS) // max(1, per_row))
    low = LOW_PRECISION_SCORES and keys.dtype in (mx.bfloat16, mx.float16)
    keys_t = (keys if low else keys.astype(mx.float32)).swapaxes(-1, -2)
    outs, lses = [], []
    for start in range(0, rows, chunk):
        part = q[start: start + chunk]
        n = part.shape[0]
        flat = part.transpose(1, 0, 2, 3).reshape(1, kv_heads, n * width, D)
        if low:
            o, lse = _attend_low(flat.astype(keys.dtype) @ keys_t, values)
        else:
            o, lse = attend(flat @ keys_t, values, None)
        if bounded:
            waits = not ASYNC_CHUNKS or (ASYNC_WINDOW and len(outs) % ASYNC_WINDOW == 0)
            (mx.eval if waits else mx.async_eval)(o, lse)
        outs.append(o.reshape(kv_heads, n, width, D).transpose(1, 0, 2, 3))
        lses.append(lse.reshape(kv_heads, n, width).transpose(1, 0, 2))
    if len(outs) == 1:
        return outs[0], lses[0]
    return mx.concatenate(outs), mx.concatenate(lses)


def _attend_prefix_fused(q: mx.array, keys: mx.array, values: mx.array, scale: float
                         ) -> tuple[mx.array, mx.array]:
    """_attend_prefix through MLX's fused attention, which returns no log-sum-exp: it is read
    from a reference key added to the prefix. The reference key is the prefix's mean key, so
    its score for each query is that query's mean score `m` (scores are linear in the key), and
    its weight among the prefix's keys, w = e^m / (Z + e^m) with Z the prefix's sum of
    exponentials, lies in (0, 1/(length + 1)]: never near 1, where 1 - w would lose precision.
    Pass 1 (the reference key's value 0) gives o1 = Z / (Z + e^m) times the prefix's output;
    pass 2 (value 1 for the reference key only) gives w. Then the output is o1 / (1 - w) and
    log Z = m + log(1 - w) - log(w)."""
    rows, kv_heads, width, D = q.shape
    Dv = values.shape[-1]
    flat = q.transpose(1, 0, 2, 3).reshape(1, kv_heads, rows * width, D)
    reference = mx.mean(keys.astype(mx.float32), axis=2, keepdims=True).astype(keys.dtype)
    keys_r = mx.concatenate([keys, reference], axis=2)
    zero = mx.zeros((1, kv_heads, 1, Dv), values.dtype)
    o1 = mx.fast.scaled_dot_product_attention(
        flat, keys_r, mx.concatenate([values, zero], axis=2), scale=scale)
    marker = mx.concatenate([mx.zeros(values.shape[:3] + (1,), values.dtype),
                             mx.ones((1, kv_heads, 1, 1), values.dtype)], axis=2)
    w = mx.fast.scaled_dot_product_attention(flat, keys_r, mx.broadcast_to(
        marker, keys_r.shape[:3] + (Dv,)), scale=scale)[..., 0].astype(mx.float32)
    m = (flat.astype(mx.float32) @ reference.astype(mx.float32).swapaxes(-1, -2))[..., 0] * scale
    out = o1.astype(mx.float32) / (1 - w)[..., None]
    lse = m + mx.log1p(-w) - mx.log(w)
    return (out.reshape(kv_heads, rows, width, Dv).transpose(1, 0, 2, 3),
            lse.reshape(kv_heads, rows, width).transpose(1, 0, 2))


def _attend_prefix_host(q: mx.array, keys_t, values) -> tuple[mx.array, mx.array]:
    """_attend_prefix on the CPU through NumPy: MLX's CPU exp is scalar (~16 ns an element
    here), NumPy's is vectorized (~20x faster), and the prefix part is all exps and matmuls.
    The arrays live in host memory already; `keys_t`, `values`: SharedPrefix.host."""
    import numpy as np

    rows, kv_heads, width, D = q.shape
    length = keys_t.shape[-1]
    qh = np.asarray(q.astype(mx.float32))  # (rows, kv_heads, width, D)
    out = np.empty((rows, kv_heads, width, values.shape[-1]), np.float32)
    lse = np.empty((rows, kv_heads, width), np.float32)
    chunk = max(1, MAX_SCORE_ELEMENTS // max(1, kv_heads * width * length))
    for start in range(0, rows, chunk):
        part = qh[start: start + chunk]  # (n, kv_heads, width, D)
        n = part.shape[0]
        flat = part.transpose(1, 0, 2, 3).reshape(kv_heads, n * width, D)
        o, part_lse = softmax_attend(flat @ keys_t, values)  # (kv_heads, n*width, Dv)
        out[start: start + n] = o.reshape(kv_heads, n, width, -1).transpose(1, 0, 2, 3)
        lse[start: start + n] = part_lse.reshape(kv_heads, n, width).transpose(1, 0, 2)
    return mx.array(out), mx.array(lse)


@mx.compile
def _softmax_parts(scores: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Half-precision scores -> (weights in their dtype, float32 peak, float32 sum): one fused
    pass over the scores."""
    s = scores.astype(mx.float32)
    peak = mx.max(s, axis=-1, keepdims=True)
    weights = mx.exp(s - peak)
    return weights.astype(scores.dtype), peak, mx.sum(weights, axis=-1, keepdims=True)


def _attend_low(scores: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """`attend` without a mask for half-precision scores (the prefix part)."""
    weights, peak, total = _softmax_parts(scores)
    out = (weights @ values).astype(mx.float32) / mx.maximum(total, 1e-30)
    return out, (peak + mx.log(total))[..., 0]


def _own_mask(mask, B: int, G: int, L: int, S: int) -> mx.array | None:
    """mlx-lm's mask for the rows' own tokens, repeated for the query heads of a KV head."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": the last L of S keys are the queries' own
        rows = mx.arange(S - L, S)[:, None]
        mask = rows >= mx.arange(S)[None]
    if mask.dtype != mx.bool_:
        mask = mask > -mx.inf  # an additive mask: -inf where masked
    mask = mx.broadcast_to(mask, (B, 1, L, S))
    return mx.broadcast_to(mask[:, :, None], (B, 1, G, L, S)).reshape(B, 1, G * L, S)
