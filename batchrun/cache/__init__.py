"""Prefix caching: shared prompt prefixes prefilled once, kept in memory and on disk."""

from __future__ import annotations

from pathlib import Path

from batchrun.cache.disk import DEFAULT_CAP_BYTES, DiskCache, default_cache_dir
from batchrun.cache.layout import BlockLayout, block_layout, layer_kinds
from batchrun.cache.prefix import DEFAULT_BLOCK_SIZE, PrefixCache

__all__ = ["PrefixCache", "DiskCache", "BlockLayout", "block_layout", "layer_kinds",
           "make_prefix_cache", "default_cache_dir"]


def make_prefix_cache(model_fingerprint: str, budget_bytes: int, cache_dir: Path | None,
                      block_size: int = DEFAULT_BLOCK_SIZE,
                      disk_cap_bytes: int = DEFAULT_CAP_BYTES,
                      layout: BlockLayout | None = None) -> PrefixCache:
    """An in-memory prefix cache, backed by `cache_dir` on disk unless that is None. Blocks on
    disk are checked against `layout` (see `block_layout`); without one, or where the folder is
    not safe to use, the cache is memory-only (with one warning)."""
    root = bytes.fromhex(model_fingerprint)[:16]
    cache = PrefixCache(root=root, budget_bytes=budget_bytes, block_size=block_size,
                        stateful=layout is not None and bool(layout.states))
    if cache_dir is not None:
        disk = DiskCache.open(cache_dir, model_fingerprint, block_size, layout, disk_cap_bytes)
        if disk is not None:
            cache.prefetch = disk.load_many
            cache.on_store = disk.save_later  # written beside the engine
            cache.disk = disk
    return cache
