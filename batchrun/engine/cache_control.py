"""The prefix cache's controls on the engine (the seed's cache API): enable it from the
config, figures, clear, save to and load from a disk folder. The cache itself is
cache/prefix.py; which rows use which blocks is prefix_plan.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from batchrun.cache import block_layout, make_prefix_cache
from batchrun.cache.disk import DiskCache
from batchrun.cache.prefix import PrefixCache
from batchrun.engine.prefix_plan import PrefixPlanner


class CacheControl:
    """Mixed into Engine, which provides config, memory, backend, scheduler and
    model_fingerprint."""

    def enable_prefix_cache(self) -> None:
        """The config's prefix cache (memory share and disk folder), where it can work: only
        growing KV caches can be cut into blocks (not recurrent or rotating ones)."""
        config = self.config
        if not (config.prefix_cache and self.backend.prefix_cache
                and self.memory.footprint.per_sequence == 0):
            return
        share = int(self.memory.budget * config.prefix_cache_fraction)
        self.memory.budget -= share  # the cached blocks live in the same memory
        self.prefix_cache = make_prefix_cache(
            self.model_fingerprint, share, Path(config.cache_dir) if config.cache_dir else None,
            config.prefix_block_size, layout=block_layout(self.backend.kv_model))
        self._owns_prefix_cache = True

    @property
    def prefix_cache(self) -> PrefixCache | None:
        planner = self.scheduler.planner
        return planner.cache if planner is not None else None

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        self.scheduler.planner = PrefixPlanner(cache) if cache is not None else None
        self.scheduler.shares_prefix = self.backend.share_prefixes(
            cache is not None and self.config.shared_prefix)

    def get_cache_stats(self) -> dict | None:
        """Prefix-cache figures: hits, misses, tokens served, blocks and bytes in memory."""
        cache = self.prefix_cache
        if cache is None:
            return None
        disk = cache.disk
        return {**dataclasses.asdict(cache.stats), "blocks": len(cache.blocks),
                "bytes": cache.nbytes, "budget_bytes": cache.budget_bytes,
                "block_size": cache.block_size,
                "disk_folder": str(disk.folder) if disk else None,
                "disk_skipped": disk.skipped if disk else 0}

    def clear_prefix_cache(self) -> None:
        """Drop the in-memory prefix cache (the disk copy stays)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def save_cache_to_disk(self, cache_dir: str | Path) -> int:
        """Write every in-memory block to `cache_dir`; returns how many were written."""
        disk = self._disk(cache_dir)
        if disk is None:
            return 0
        disk.save(list(self.prefix_cache.blocks.values()))
        disk.close()
        return disk.saved

    def load_cache_from_disk(self, cache_dir: str | Path) -> int:
        """Load this model's blocks from `cache_dir` into memory; returns how many loaded."""
        disk = self._disk(cache_dir)
        if disk is None:
            return 0
        loaded = 0
        for key in disk.stored_keys():  # least recently used first: the newest end up most recent
            block = disk.load(key)
            if block is not None:
                self.prefix_cache.put(block)
                loaded += 1
        disk.close()
        return loaded

    def _disk(self, cache_dir: str | Path) -> DiskCache | None:
        if self.prefix_cache is None:
            return None
        return DiskCache.open(Path(cache_dir), self.model_fingerprint,
                              self.prefix_cache.block_size, block_layout(self.backend.kv_model))

