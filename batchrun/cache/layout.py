"""The shape every prefix block of a model has: what a block read from disk is checked against.

A block holds, per layer, keys and values of shape (1, kv_heads, block_size, head_dim) in the
model's KV dtype. The layout is measured from the model itself (one-token forward pass), so it
is what the engine's own blocks look like, whatever the model's config calls its fields.

A sliding-window layer (mlx-lm's RotatingKVCache) keeps every position's keys and values in the
blocks too: a prefix may end at any block, and a row starting from it takes the last window of
it (`layer_windows`, cache/prefix.py's `to_row_caches`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

# Dtype names as safetensors writes them; a KV cache in any other dtype is not kept on disk.
DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) < 1 or self.dtype not in DTYPES:
            raise ValueError(f"not a KV block layout: {self}")

    def shape(self, block_size: int) -> tuple[int, int, int, int]:
        """The shape of each layer's keys and values in a block of `block_size` tokens."""
        return (1, self.kv_heads, block_size, self.head_dim)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of a block's tensors, keys and values of every layer."""
        elements = self.kv_heads * block_size * self.head_dim
        return 2 * self.layers * elements * DTYPES[self.dtype].size


def block_layout(model: nn.Module) -> BlockLayout | None:
    """The model's block layout, or None where its layers' caches are not KV caches (growing,
    or sliding windows) of one shape (recurrent layers, per-layer head counts, keys and values
    of different sizes)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    shapes = set()
    for c in cache:
        if _window(c) is False:
            return None
        shapes |= {(c.keys.shape[1], c.keys.shape[3], c.keys.dtype),
                   (c.values.shape[1], c.values.shape[3], c.values.dtype)}
    names = {v: k for k, v in DTYPES.items()}
    if len(shapes) != 1 or not cache:
        return None
    (kv_heads, head_dim, dtype), = shapes
    if dtype not in names:
        return None
    return BlockLayout(len(cache), kv_heads, head_dim, names[dtype])


def _window(cache) -> int | None | bool:
    """A layer cache's window: None for a growing KV cache, the window for a sliding one that
    keeps no first tokens, False for any other kind."""
    if type(cache) is KVCache:
        return None
    if type(cache) is RotatingKVCache and cache.keep == 0 and cache.max_size > 0:
        return cache.max_size
    return False


def layer_windows(model: nn.Module) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (None: it attends every position), or None where a layer's
    cache is of another kind (recurrent, quantized)."""
    windows = tuple(_window(c) for c in make_prompt_cache(model))
    return None if any(w is False for w in windows) else windows
