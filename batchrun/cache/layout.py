"""The shape every prefix block of a model has: what a block read from disk is checked against.

A block holds, per layer, keys and values of shape (1, kv_heads, block_size, head_dim) in the
model's KV dtype. The layout is measured from the model itself (one-token forward pass), so it
is what the engine's own blocks look like, whatever the model's config calls its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

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
    """The model's block layout, or None where its layers' caches are not plain KV caches of
    one shape (rotating, recurrent, per-layer head counts, keys and values of different sizes)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    shapes = set()
    for c in cache:
        if type(c) is not KVCache:
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
