"""The engine's prefix cache as a part it holds (the seed's cache API behind it): turned on from
the config or handed in, set aside while the engine warms up, its figures, clear, save to and
load from a disk folder, flushed and closed. The cache itself is cache/prefix.py; which rows use
which blocks is prefix_plan.py.

Invariant: the scheduler's planner is the one place the cache in use is held (None: no cache,
or set aside), so admission and this part never disagree about it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from batchrun.cache import block_layout, layer_kinds, make_prefix_cache
from batchrun.cache.disk import DiskCache
from batchrun.cache.prefix import PrefixCache
from batchrun.engine.prefix_plan import PrefixPlanner

if TYPE_CHECKING:
    from batchrun.engine.backends.base import Backend
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.memory import MemoryBudget
    from batchrun.engine.scheduler import Scheduler


class PrefixCacheControl:
    """The prefix cache of one engine: its scheduler plans against it, its backend shares
    prefixes from it, and it takes its memory from the engine's KV budget."""

    def __init__(self, scheduler: Scheduler, backend: Backend, memory: MemoryBudget,
                 config: EngineConfig, model_fingerprint: str,
                 cache: PrefixCache | None = None):
        self.scheduler, self.backend, self.memory = scheduler, backend, memory
        self.config, self.model_fingerprint = config, model_fingerprint
        self._owned = False  # enable()'s, not one handed in: close() closes it
        self._aside: PrefixPlanner | None = None  # the planner while set_aside() holds it
        self.cache = cache

    @property
    def cache(self) -> PrefixCache | None:
        planner = self.scheduler.planner
        return planner.cache if planner is not None else None

    @cache.setter
    def cache(self, cache: PrefixCache | None) -> None:
        self.scheduler.planner = PrefixPlanner(cache) if cache is not None else None
        if cache is not None and hasattr(self.backend, "snapshot_every"):
            self.backend.snapshot_every = cache.block_size  # a recurrent state's, per block
        self.scheduler.shares_prefix = self.backend.share_prefixes(
            cache is not None and self.config.shared_prefix)

    def enable(self) -> None:
        """The config's prefix cache (memory share and disk folder), where it can work: KV
        caches, growing or sliding windows, and recurrent states, where the backend builds rows
        from those (cache/layout.py)."""
        config = self.config
        if not (config.prefix_cache and self.backend.prefix_cache):
            return
        kinds = layer_kinds(self.backend.kv_model)
        windowed = kinds is not None and any(isinstance(k, int) for k in kinds)
        stateful = kinds is not None and any(isinstance(k, tuple) for k in kinds)
        layout = block_layout(self.backend.kv_model) if kinds is not None else None
        if layout is None or (windowed and not self.backend.windowed_prefixes) \
                or (stateful and not self.backend.stateful_prefixes):
            return
        share = int(self.memory.budget * config.prefix_cache_fraction)
        self.memory.budget -= share  # the cached blocks live in the same memory
        self.cache = make_prefix_cache(
            self.model_fingerprint, share, Path(config.cache_dir) if config.cache_dir else None,
            config.prefix_block_size, layout=layout)
        self._owned = True

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Meanwhile no row reaches the cache (the scheduler has no planner); read_ahead still
        does."""
        # in this order: read_ahead finds the planner in one place or the other throughout
        self._aside, self.scheduler.planner = self.scheduler.planner, None
        try:
            yield
        finally:
            self.scheduler.planner, self._aside = self._aside, None

    def read_ahead(self, prompt: list[int]) -> None:
        """Start reading the prompt's cached blocks from disk, the cache set aside or not."""
        planner = self.scheduler.planner or self._aside
        if planner is not None:
            planner.cache.read_ahead(prompt)

    def stats(self) -> dict | None:
        """Hits, misses, tokens served, blocks and bytes in memory; None without a cache."""
        cache = self.cache
        if cache is None:
            return None
        disk = cache.disk
        return {**dataclasses.asdict(cache.stats), "blocks": len(cache.blocks),
                "bytes": cache.nbytes, "budget_bytes": cache.budget_bytes,
                "block_size": cache.block_size,
                "disk_folder": str(disk.folder) if disk else None,
                "disk_skipped": disk.skipped if disk else 0}

    def clear(self) -> None:
        """Drop the in-memory blocks (the disk copy stays)."""
        if self.cache is not None:
            self.cache.clear()

    def save(self, cache_dir: str | Path) -> int:
        """Write every in-memory block to `cache_dir`; how many were written."""
        disk = self._disk(cache_dir)
        if disk is None:
            return 0
        disk.save(list(self.cache.blocks.values()))
        disk.close()
        return disk.saved

    def load(self, cache_dir: str | Path) -> int:
        """Load this model's blocks from `cache_dir` into memory; how many loaded."""
        disk = self._disk(cache_dir)
        if disk is None:
            return 0
        loaded = 0
        for key in disk.stored_keys():  # least recently used first: the newest end up most recent
            block = disk.load(key)
            if block is not None:
                self.cache.put(block)
                loaded += 1
        disk.close()
        return loaded

    def flush(self) -> None:
        """The blocks saved on the writer thread are on disk."""
        if self.cache is not None:
            self.cache.flush()

    def close(self) -> None:
        """What the cache has for the disk is written; a cache enable() made lets go of its
        threads and folder too."""
        cache = self.cache
        if cache is not None and self._owned:
            cache.close()
        elif cache is not None:
            cache.flush()

    def _disk(self, cache_dir: str | Path) -> DiskCache | None:
        if self.cache is None:
            return None
        return DiskCache.open(Path(cache_dir), self.model_fingerprint, self.cache.block_size,
                              block_layout(self.backend.kv_model))
