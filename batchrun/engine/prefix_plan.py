"""Which prompt blocks a row takes from the prefix cache, and which it computes for others.

A prefix shared by queued or running rows is computed once: the first row admitted that needs
it becomes its leader; rows that need blocks a leader is still computing wait in the queue, then
reuse them once the leader's prefill has stored them. A leader that ends early (a fault, an
abort) gives up its promise, and the next row needing those blocks leads instead.
"""

from __future__ import annotations

from collections import Counter

from batchrun.cache.prefix import Block, PrefixCache
from batchrun.engine.sequence import Sequence


class PrefixPlanner:
    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self._key_counts: Counter[bytes] = Counter()  # block keys of queued + running rows
        self._leading: Counter[bytes] = Counter()  # keys that admitted leaders are computing

    def register(self, seq: Sequence) -> None:
        """A new row: note which blocks it will need."""
        seq.block_keys = self.cache.keys_for(seq.prompt)
        self._key_counts.update(seq.block_keys)

    def plan(self, seq: Sequence) -> list[Block] | None:
        """The cached blocks the row starts from, or None to wait behind a leader. Sets
        `seq.cached` and `seq.store_upto` (the blocks it leads)."""
        if not seq.block_keys:
            return []
        keys = seq.block_keys
        blocks = self.cache.match(seq.prompt, keys)
        n = len(blocks)
        if n < len(keys) and keys[n] in self._leading:
            return None
        shared = n
        while shared < len(keys) and self._key_counts[keys[shared]] >= 2:
            shared += 1
        seq.cached = n * self.cache.block_size
        seq.store_upto = shared * self.cache.block_size
        self._leading.update(keys[n:shared])
        self.cache.count_lookup(n)
        return blocks

    def store(self, seq: Sequence, layer_caches: list) -> None:
        """After a leader's prefill: its shared blocks go into the cache for the others."""
        self.cache.store(seq.prompt, [(c.keys, c.values) for c in layer_caches], seq.store_upto)
        self.drop_leadership(seq)

    def drop_leadership(self, seq: Sequence) -> None:
        """The blocks this row was to compute for others are no longer promised by it."""
        if seq.store_upto:
            size = self.cache.block_size
            self._leading.subtract(seq.block_keys[seq.cached // size: seq.store_upto // size])
            self._leading = +self._leading  # drop zero counts
        seq.store_upto = 0

    def release(self, seq: Sequence) -> None:
        """The row is finished: it needs no blocks any more."""
        self._key_counts.subtract(seq.block_keys)
        self._key_counts = +self._key_counts
        self.drop_leadership(seq)  # a leader that ended before its prefill was stored
