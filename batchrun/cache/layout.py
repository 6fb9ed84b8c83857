"""The shape every prefix block of a model has: what a block read from disk is checked against.

A block holds, per layer, keys and values of shape (1, kv_heads, block_size, head_dim) in the
model's KV dtype. The layout is measured from the model itself (one-token forward pass), so it
is what the engine's own blocks look like, whatever the model's config calls its fields.

A sliding-window layer (mlx-lm's RotatingKVCache) keeps every position's keys and values in the
blocks too: a prefix may end at any block, and a row starting from it takes the last window of
it (`layer_kinds`, cache/prefix.py's `to_row_caches`). A recurrent layer (mlx-lm's ArraysCache:
gated delta, Mamba) has no keys or values: a block may carry its state at the block's end (a
snapshot), whose arrays' shapes are the layout's `states`; rows start only where one is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

# Dtype names as safetensors writes them; a KV cache in any other dtype is not kept on disk.
DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layers: int  # the layers with keys and values
    kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES
    # A state snapshot's arrays, the recurrent layers' in order: (shape, a key of DTYPES) each.
    states: tuple[tuple[tuple[int, ...], str], ...] = ()

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) < 1 or self.dtype not in DTYPES:
            raise ValueError(f"not a KV block layout: {self}")

    def shape(self, block_size: int) -> tuple[int, int, int, int]:
        """The shape of each layer's keys and values in a block of `block_size` tokens."""
        return (1, self.kv_heads, block_size, self.head_dim)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of a block's tensors, keys and values of every layer (and a snapshot)."""
        elements = self.kv_heads * block_size * self.head_dim
        state = sum(math.prod(shape) * DTYPES[dtype].size for shape, dtype in self.states)
        return 2 * self.layers * elements * DTYPES[self.dtype].size + state


def block_layout(model: nn.Module) -> BlockLayout | None:
    """The model's block layout, or None where its layers' caches are not KV caches (growing,
    or sliding windows) of one shape and recurrent states (per-layer head counts, keys and
    values of different sizes, quantized caches)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    shapes, states = set(), []
    names = {v: k for k, v in DTYPES.items()}
    for c in cache:
        kind = _kind(c)
        if kind is False:
            return None
        if isinstance(kind, tuple):
            if any(a is None or a.dtype not in names for a in c.cache):
                return None
            states += [(tuple(a.shape), names[a.dtype]) for a in c.cache]
            continue
        shapes |= {(c.keys.shape[1], c.keys.shape[3], c.keys.dtype),
                   (c.values.shape[1], c.values.shape[3], c.values.dtype)}
    if len(shapes) != 1:
        return None
    (kv_heads, head_dim, dtype), = shapes
    if dtype not in names:
        return None
    layers = sum(not isinstance(_kind(c), tuple) for c in cache)
    return BlockLayout(layers, kv_heads, head_dim, names[dtype], tuple(states))


# A layer's kind (`layer_kinds`): None, a growing KV cache; an int, a sliding window of that many
# positions; ("state", n), a recurrent layer whose state is n arrays.
LayerKind = int | tuple[str, int] | None


def _kind(cache) -> LayerKind | bool:
    """A layer cache's kind, or False for one the prefix cache cannot hold (a quantized KV
    cache, a sliding window that keeps its first tokens, ...)."""
    if type(cache) is KVCache:
        return None
    if type(cache) is RotatingKVCache and cache.keep == 0 and cache.max_size > 0:
        return cache.max_size
    if type(cache) is ArraysCache:
        return ("state", len(cache.cache))
    return False


def layer_kinds(model: nn.Module) -> tuple[LayerKind, ...] | None:
    """Each layer's kind: None (attends every position), its sliding window, or ("state", n)
    for a recurrent layer; None where a layer's cache is of another kind."""
    kinds = tuple(_kind(c) for c in make_prompt_cache(model))
    return None if any(k is False for k in kinds) else kinds
