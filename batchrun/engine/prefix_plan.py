"""Which prompt blocks a row takes from the prefix cache, and which prefix to compute first.

A prefix that queued or running rows share is computed once, before any of them runs: when the
first of them reaches admission, the engine prefills just the shared blocks into the cache
(`PrefixNeeded`), then every row sharing them, that first one included, starts from the cache.
No row carries the shared prefix in its own KV, whatever order the rows arrive in. A row's own
prompt is kept once computed (Engine._keep_prompts), for rows further down the input.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from batchrun.cache.prefix import Block, PrefixCache
from batchrun.engine.sequence import Sequence


@dataclass(slots=True)
class PrefixNeeded:
    """Compute `seq.prompt[:upto]` into the cache (from `blocks`, the part already there)."""

    seq: Sequence
    blocks: list[Block]
    upto: int


class PrefixPlanner:
    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self._key_counts: Counter[bytes] = Counter()  # block keys of queued + running rows

    def register(self, seq: Sequence) -> None:
        """A new row: note which blocks it will need."""
        seq.block_keys = self.cache.keys_for(seq.prompt, seq.media)
        self._key_counts.update(seq.block_keys)

    def plan(self, seq: Sequence, compute: bool = True) -> list[Block] | PrefixNeeded:
        """The cached blocks the row starts from (setting `seq.cached`), or, when blocks that
        other rows also need are not cached yet and `compute`, the prefix to compute first."""
        keys = seq.block_keys
        if not keys:
            return []
        blocks = self.cache.match(seq.prompt, keys)
        n = len(blocks)
        shared = n
        while shared < len(keys) and self._key_counts[keys[shared]] >= 2:
            shared += 1
        if compute and shared > n and not seq.prefix_computed:
            return PrefixNeeded(seq, blocks, shared * self.cache.block_size)
        seq.cached = n * self.cache.block_size
        seq.cached_disk = sum(b.from_disk for b in blocks) * self.cache.block_size
        return blocks

    def admitted(self, seq: Sequence) -> None:
        """The row starts from its planned blocks (a lookup for the cache's figures)."""
        self.cache.count_lookup(seq.cached // self.cache.block_size)

    def release(self, seq: Sequence) -> None:
        """The row is finished: it needs no blocks any more."""
        counts = self._key_counts
        for key in seq.block_keys:  # per key: rebuilding the counter cost O(all keys) a row
            left = counts.get(key, 0) - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)
