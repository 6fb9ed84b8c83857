"""In-memory prefix cache: KV of shared prompt prefixes, in blocks, evicted LRU by bytes.

A block holds the KV of `block_size` consecutive prompt tokens. Its key chains through the
prefix: hash(parent key, the block's tokens, its salt), seeded with the model fingerprint, so a
key names a whole prefix and one model's blocks can never answer another model's lookup. The
salt is what the KV depends on that the tokens do not show: the content digests of the images
whose placeholder tokens start in the block (every image is the same run of placeholders), so
two prompts with the same text and different images never share a block from the first image
on. A hit is confirmed by comparing the block's stored tokens. Lookups take whole blocks and
always leave at least one prompt token to compute, so the engine gets logits for the first
generated token.

Invariant: a block's KV is exactly what the model computes for that prefix (it is copied out of
a sequence's cache after its prefill), so reusing it does not change any output.

A model with recurrent layers (gated delta, Mamba) has a state that cannot be cut back to an
earlier position: a block of such a model holds its attention layers' KV, and the block that
ends a computed prefix also the recurrent layers' state there (`state`, a snapshot). A row starts
only after a block with a snapshot (`match` stops at the last one).
"""

from __future__ import annotations

import array
import hashlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

DEFAULT_BLOCK_SIZE = 64


@dataclass(slots=True)
class Block:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    keys: list[mx.array]  # per layer, (1, kv_heads, block_size, head_dim)
    values: list[mx.array]
    salt: bytes = b""  # the digests of the images starting in this block (block_salts)
    # The recurrent layers' state at the block's end, their arrays in layer order (a snapshot).
    state: list[mx.array] | None = None
    nbytes: int = 0
    from_disk: bool = False  # read from the disk cache (a run before computed it)
    # On disk already, or handed to it; a running row's prompt block is kept in memory only
    # until a later row reuses it (PrefixCache.store's `persist`).
    written: bool = True
    kept: bool = False  # kept from a row's prompt and not reused by another row yet

    def __post_init__(self) -> None:
        self.nbytes = sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values) \
            + sum(a.nbytes for a in self.state or ())


Media = tuple[tuple[int, str], ...]  # (position of an image's first placeholder, its digest)


def block_salts(media: Media, block_size: int, n_blocks: int) -> list[bytes]:
    """Each block's salt: the digests of the images whose placeholders start in it, in order.
    Chaining carries a salt into every later block's key."""
    salts = [b""] * n_blocks
    for position, digest in media:
        if position // block_size < n_blocks:
            salts[position // block_size] += b"image:" + digest.encode() + b";"
    return salts


def block_keys(tokens: list[int], block_size: int, root: bytes, media: Media = ()) -> list[bytes]:
    """The chained key of each whole block of `tokens` (and of the images in `media`)."""
    n = len(tokens) // block_size
    return _chained(_token_bytes(tokens[: n * block_size]), block_size, root, media, n, 0, [])


class KeyMemo:
    """The last prompt's block keys, for the next prompt that starts with the same whole blocks:
    a labeling job's rows share a long instruction, whose ~28 blocks would otherwise be hashed
    again for every row in the job loop. The keys are exactly `block_keys`'."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple = (b"", -1, b"", (), [])  # token bytes, block size, root, media, keys

    def block_keys(self, tokens: list[int], block_size: int, root: bytes,
                   media: Media = ()) -> list[bytes]:
        n = len(tokens) // block_size
        data = _token_bytes(tokens[: n * block_size])
        with self._lock:
            last_data, last_size, last_root, last_media, last_keys = self._last
        same = 0
        if (block_size, root, media) == (last_size, last_root, last_media):
            width = 4 * block_size
            mine, theirs = memoryview(data), memoryview(last_data)
            low, high = 0, min(n, len(last_keys))
            if mine[: high * width] == theirs[: high * width]:
                low = high
            while low < high:  # the most whole blocks the two prompts start with
                mid = (low + high + 1) // 2
                if mine[: mid * width] == theirs[: mid * width]:
                    low = mid
                else:
                    high = mid - 1
            same = low
        keys = last_keys[:same] + _chained(data, block_size, root, media, n, same, last_keys)
        with self._lock:
            self._last = (data, block_size, root, media, keys)
        return keys


def _chained(data: bytes, block_size: int, root: bytes, media: Media, n: int, start: int,
             known: list[bytes]) -> list[bytes]:
    """The keys of blocks `start` to `n` of `data`, after the `start` keys `known`."""
    keys, parent, width = [], known[start - 1] if start else root, 4 * block_size
    salts = block_salts(media, block_size, n)
    for i in range(start, n):
        parent = _chain(parent, data[i * width: (i + 1) * width], salts[i])
        keys.append(parent)
    return keys


def chain(parent: bytes, tokens: list[int] | tuple[int, ...], salt: bytes = b"") -> bytes:
    """The key of a block holding `tokens` (and `salt`) after the block keyed `parent`."""
    return _chain(parent, _token_bytes(tokens), salt)


def _token_bytes(tokens: list[int] | tuple[int, ...]) -> bytes:
    """4 bytes a token, little-endian (array's conversion of a list is 3x NumPy's: these
    keys are computed for every row, in the job loop)."""
    data = array.array("I", tokens)
    if data.itemsize != 4:  # a platform whose C unsigned int is not 4 bytes
        return np.asarray(tokens, dtype="<u4").tobytes()
    if sys.byteorder == "big":
        data.byteswap()
    return data.tobytes()


def _chain(parent: bytes, data: bytes, salt: bytes) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(data)
    if salt:  # text-only blocks keep the keys they always had
        h.update(salt)
    return h.digest()


@dataclass(slots=True)
class CacheStats:
    hits: int = 0  # lookups that reused at least one block
    misses: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0  # computed to be shared (and written to disk)
    kept_blocks: int = 0  # of running rows' prompts, in memory until reused (store's persist)
    kept_reused: int = 0  # kept blocks a later row started from
    evicted_blocks: int = 0
    disk_loaded_blocks: int = 0
    disk_skipped: int = 0  # corrupt, truncated or foreign entries ignored


@dataclass(slots=True)
class PrefixCache:
    """Blocks by chained key, least recently used first; `budget_bytes` caps their KV."""

    root: bytes  # the model fingerprint: the chain's seed
    budget_bytes: int
    block_size: int = DEFAULT_BLOCK_SIZE
    blocks: OrderedDict[bytes, Block] = field(default_factory=OrderedDict)
    nbytes: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    # Called with the keys of a prompt's blocks that are not in memory: their blocks from disk
    # (None where absent), read together.
    prefetch: Callable[[list[bytes]], dict[bytes, Block | None]] | None = None
    # Called with the blocks each store() added: writes them to disk.
    on_store: Callable[[list[Block]], None] | None = None
    disk: object | None = None  # the DiskCache behind prefetch / on_store, if any
    memo: KeyMemo = field(default_factory=KeyMemo, repr=False)
    stateful: bool = False  # a recurrent model's: rows start only after a state snapshot

    def keys_for(self, tokens: list[int], media: Media = ()) -> list[bytes]:
        # Leave at least one token uncached: the engine must compute the last prompt token.
        return self.memo.block_keys(tokens[: max(0, len(tokens) - 1)], self.block_size,
                                    self.root, media)

    def match(self, tokens: list[int], keys: list[bytes] | None = None) -> list[Block]:
        """The longest run of cached blocks that prefixes `tokens` (confirmed token by token)."""
        found = []
        keys = keys if keys is not None else self.keys_for(tokens)
        if self.prefetch is not None:
            self._load(keys)
        for i, key in enumerate(keys):
            block = self._get(key)
            span = tuple(tokens[i * self.block_size: (i + 1) * self.block_size])
            if block is None or block.tokens != span:
                break
            found.append(block)
        if self.stateful:
            while found and found[-1].state is None:
                found.pop()
        for b in found:
            if b.kept:
                b.kept = False
                self.stats.kept_reused += 1
        unwritten = [b for b in found if not b.written]
        if unwritten and self.on_store is not None:  # reused: worth a later run's reading
            for b in unwritten:
                b.written = True
            self.on_store(unwritten)
        return found

    def read_ahead(self, tokens: list[int], media: Media = ()) -> None:
        """Start reading from disk the stored blocks `tokens` would use that are not in memory
        (from any thread); `match` later finds them read."""
        if self.disk is not None:
            keys = self.keys_for(tokens, media)
            self.disk.read_ahead([k for k in keys if k not in self.blocks])

    def count_lookup(self, n_blocks: int) -> None:
        """Record one admitted lookup that reused `n_blocks` blocks."""
        if n_blocks:
            self.stats.hits += 1
            self.stats.hit_tokens += n_blocks * self.block_size
        else:
            self.stats.misses += 1

    def _load(self, keys: list[bytes]) -> None:
        """Bring the stored blocks of a chain of keys into memory, up to the first one that is
        neither in memory nor on disk."""
        missing = [k for k in keys if k not in self.blocks]
        if not missing:
            return
        loaded = self.prefetch(missing)
        for key in keys:
            if key in self.blocks:
                continue
            block = loaded.get(key)
            if block is None:
                return
            self.stats.disk_loaded_blocks += 1
            block.from_disk = True
            self.put(block)

    def flush(self) -> None:
        """Wait until the blocks handed to the disk are written."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Write what is pending, then let go of the disk's threads and folder: the memory
        blocks stay usable, nothing more is read from or written to disk."""
        if self.disk is not None:
            disk, self.disk = self.disk, None
            self.prefetch = self.on_store = None
            disk.close()

    def _get(self, key: bytes) -> Block | None:
        block = self.blocks.get(key)
        if block is not None:
            self.blocks.move_to_end(key)
        return block

    def store(self, tokens: list[int], layer_kv: list[tuple[mx.array, mx.array]],
              upto: int, media: Media = (),
              snapshots: dict[int, list[mx.array]] | None = None,
              persist: bool = True, evaluate: bool = True) -> list[Block]:
        """Store the blocks of tokens[:upto] (with the images in `media`) from one sequence's
        per-layer (keys, values), each (1, kv_heads, >= upto, head_dim) or anything sliced so
        along positions, and a recurrent model's `snapshots` (its state at a position: the
        block ending there keeps it); returns the blocks that were new (or given a snapshot).
        Without `persist`, new blocks go to disk only once a row reuses them (`match`);
        without `evaluate`, the caller evaluates the new blocks' arrays (several stores at
        once)."""
        new = []
        parent = self.root
        snapshots = snapshots or {}
        keys = self.keys_for(tokens[: upto + 1], media)
        salts = block_salts(media, self.block_size, len(keys))
        for i, key in enumerate(keys):
            lo, hi = i * self.block_size, (i + 1) * self.block_size
            state = snapshots.get(hi)
            if state is not None:
                state = [mx.array(a) for a in state]  # its own copy, as the KV below
                mx.eval(state)
            block = self.blocks.get(key)
            if block is None:
                # Copies, so the block does not pin the sequence's whole cache buffer.
                ks = [mx.array(k[:, :, lo:hi, :]) for k, _ in layer_kv]
                vs = [mx.array(v[:, :, lo:hi, :]) for _, v in layer_kv]
                if evaluate:
                    mx.eval(ks, vs)
                block = Block(key, parent, tuple(tokens[lo:hi]), ks, vs, salts[i], state,
                              written=persist, kept=not persist)
                self.put(block)
                new.append(block)
                if persist:
                    self.stats.stored_blocks += 1
                else:
                    self.stats.kept_blocks += 1
            else:
                self.blocks.move_to_end(key)
                if state is not None and block.state is None:
                    block.state = state
                    added = sum(a.nbytes for a in state)
                    block.nbytes += added
                    self.nbytes += added
                    self._evict()
                    new.append(block)  # written again, with its snapshot
            parent = key
        if new and persist and self.on_store is not None:
            self.on_store(new)
        return new

    def put(self, block: Block) -> None:
        if block.key in self.blocks:
            return
        self.blocks[block.key] = block
        self.nbytes += block.nbytes
        self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and len(self.blocks) > 1:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes
            self.stats.evicted_blocks += 1

    def drop_kept(self) -> int:
        """Forget the blocks kept from rows' prompts that no row has reused yet (they are
        not on disk): memory the running batch needs more. Returns the bytes let go."""
        dropped = [key for key, block in self.blocks.items() if block.kept]
        freed = 0
        for key in dropped:
            freed += self.blocks.pop(key).nbytes
        self.nbytes -= freed
        self.stats.evicted_blocks += len(dropped)
        return freed

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0

    @staticmethod
    def to_kv_caches(blocks: list[Block], make: Callable[[], KVCache] = KVCache) -> list:
        """Fresh per-layer KV caches (made by `make`) holding the concatenated blocks' KV."""
        caches = []
        for layer in range(len(blocks[0].keys)):
            c = make()
            k = mx.concatenate([b.keys[layer] for b in blocks], axis=2)
            v = mx.concatenate([b.values[layer] for b in blocks], axis=2)
            c.keys, c.values, c.offset = k, v, k.shape[2]  # mlx-lm's and mlx-vlm's alike
            caches.append(c)
        return caches

    @staticmethod
    def to_row_caches(blocks: list[Block], kinds: tuple, whole: bool = False) -> list:
        """A row's caches starting after `blocks`, a layer of each kind (cache/layout.py's
        `layer_kinds`): a growing layer's hold all of their KV, a sliding layer's the last
        window of it (`window_cache`; with `whole`, all of it in a growing cache: a prefix
        computed further attends its window through the model's mask), a recurrent layer's
        the last block's snapshot."""
        caches, kv, at = [], 0, 0
        state = blocks[-1].state or []
        for kind in kinds:
            if isinstance(kind, tuple):
                c = ArraysCache(size=kind[1])
                c.cache = list(state[at: at + kind[1]])
                at += kind[1]
                caches.append(c)
                continue
            k = mx.concatenate([b.keys[kv] for b in blocks], axis=2)
            v = mx.concatenate([b.values[kv] for b in blocks], axis=2)
            kv += 1
            if kind is None or whole:
                c = KVCache()
                c.keys, c.values, c.offset = k, v, k.shape[2]
            else:
                c = window_cache(k, v, kind)
            caches.append(c)
        return caches


def window_cache(keys: mx.array, values: mx.array, window: int) -> RotatingKVCache:
    """A sliding layer's cache after a prefix whose keys and values are given: the last
    `window` positions, as mlx-lm's RotatingKVCache holds them after a prompt (its batch cache
    keeps no more when it merges rows)."""
    n = keys.shape[2]
    kept = min(n, window)
    c = RotatingKVCache(max_size=window)
    c.keys, c.values = keys[..., n - kept:, :], values[..., n - kept:, :]
    c.offset, c._idx = n, kept
    return c
