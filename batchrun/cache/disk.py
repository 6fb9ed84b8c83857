"""The prefix cache on disk: one file per block, an index, a size cap, LRU eviction.

Layout: `<cache_dir>/prefix/<model fingerprint>/<block key>.safetensors`, plus `index.json`
(key -> bytes, tokens, last use) and `index.lock` in the same folder. Entries of another model
live in another folder, so a changed model never reads them.

Invariant: a block is used only if it is a regular file inside a model folder that we own and
that no other user can write, and its header matches the loading model (fingerprint, block
tokens, and per layer keys and values of shape (1, kv_heads, block_tokens, head_dim) in the
model's dtype, for every layer), its tokens hash back to its key, and its checksum holds.
Anything else is as if absent: the block is recomputed, outputs do not change.

Why the folder and not the checksum carries the trust: whoever can write a block can also
recompute its checksum (it covers the metadata and tensors, so it catches damage, not forgery).
So the model folder must be private: batchrun creates every cache folder 0700 and refuses (one
warning, no disk cache for the job) a model folder owned by another user or writable by others,
even under an explicit --cache-dir, because any co-writer could silently change every output.
The default folder (~/.cache/batchrun, used when the user names none) is refused the same way;
an explicit --cache-dir / $BATCHRUN_CACHE_DIR root is the user's choice, and is safe even when
shared, since the private model folder inside it is held open by its descriptor (folder.py).

Faults never stop a job: a damaged entry (truncated, altered, wrong layout, a link, FIFO or
folder in its place) is removed, warned about once per job and written again when the block is
recomputed; a malformed index is rebuilt from the files; an I/O error (full disk, read-only or
unreadable folder) is one warning per kind and the job goes on without that entry.
Writes are not fsynced: a file torn by a crash is a damaged entry, found and replaced on load.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from batchrun.cache import blockfile
from batchrun.cache.folder import NotRegularFile, PrivateFolder, sharing_problem
from batchrun.cache.layout import DTYPES, BlockLayout
from batchrun.cache.prefix import Block, chain
from batchrun.paths import default_cache_dir, home_cache_dir  # noqa: F401  (re-exported)

log = logging.getLogger("batchrun.cache")
FORMAT = "batchrun-prefix-2"
DEFAULT_CAP_BYTES = 8 * 2**30
SUFFIX = ".safetensors"
INDEX, LOCK = "index.json", "index.lock"
MAX_INDEX_BYTES = 64 * 2**20
# A load first looks the entry up in a listing of the folder, read again when older than this:
# most lookups miss (a row's own blocks), and a miss that opens a file cost milliseconds on a
# network disk. Blocks another process adds appear within this delay.
LISTING_TTL_S = 5.0
# Threads that read and check the blocks a prompt needs at once (a read took ~27 ms a block on
# the H200 host's disk: one long instruction is dozens of blocks). Writes go to one thread.
READ_THREADS = 8
_ENTRY = re.compile(r"[0-9a-f]{32}\.safetensors")


class DiskCache:
    """Blocks of one model in `folder`; `load` and `save` never raise for a cache fault."""

    def __init__(self, files: PrivateFolder, model_fingerprint: str, block_size: int,
                 layout: BlockLayout, cap_bytes: int = DEFAULT_CAP_BYTES):
        self.files = files
        self.folder = files.path
        self.model = model_fingerprint
        self.root = bytes.fromhex(model_fingerprint)[:16]
        self.block_size = block_size
        self.layout = layout
        self.cap_bytes = cap_bytes
        self.skipped = 0  # damaged entries found (and removed) by this instance
        self.saved = 0
        self._warned: set[str] = set()
        shape = layout.shape(block_size)  # the tensors every entry must hold, nothing else
        self.expected = {name: (shape, layout.dtype) for name in _tensor_names(layout.layers)}
        # ... or those and a recurrent model's state snapshot
        self.with_state = {**self.expected, **{f"s.{j}": (state_shape, dtype) for j, (
            state_shape, dtype) in enumerate(layout.states)}} if layout.states else None
        self._meta = {"format": FORMAT, "model": model_fingerprint,
                      "block_size": str(block_size), "layers": str(layout.layers),
                      "kv_heads": str(layout.kv_heads), "head_dim": str(layout.head_dim),
                      "dtype": layout.dtype}
        if layout.states:
            self._meta["states"] = orjson.dumps(layout.states).decode()
        self._max_file_bytes = layout.block_bytes(block_size) + 2**20  # tensors + any header
        self._listing: set[str] | None = None
        self._listed_at = 0.0
        self._readers: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[Future] = []
        self._lock = threading.Lock()  # the listing and counters, shared with the writer
        self._ahead: dict[bytes, Future] = {}  # reads started by read_ahead, not yet loaded
        self._ahead_lock = threading.Lock()  # _ahead and the readers' pool, any thread
        self._closed = False

    @classmethod
    def open(cls, cache_dir: Path, model_fingerprint: str, block_size: int,
             layout: BlockLayout | None, cap_bytes: int = DEFAULT_CAP_BYTES) -> DiskCache | None:
        """The model's cache under `cache_dir`, or None (after one warning) when it cannot be
        used safely: an unknown layout, a shared default folder, a model folder that is not
        private, or a folder that cannot be created or opened."""
        off = "the job runs without the disk prefix cache"
        if layout is None:
            log.warning("prefix cache: no block layout is known for this model (it needs one "
                        "plain KV cache shape for every layer); %s", off)
            return None
        root = Path(cache_dir).expanduser()
        try:
            if _same_folder(root, home_cache_dir()) and (problem := _root_problem(root)):
                log.warning("prefix cache: %s %s; %s (make it yours with mode 700, or pass "
                            "--cache-dir)", root, problem, off)
                return None
            files = PrivateFolder.open(root, ["prefix", model_fingerprint[:32]])
            problem = files.sharing_problem()
        except OSError as e:
            log.warning("prefix cache: cannot open %s (%s); %s", root, _why(e), off)
            return None
        if problem:
            files.close()
            log.warning("prefix cache: %s %s; %s (make it yours with mode 700, or remove it)",
                        files.path, problem, off)
            return None
        return cls(files, model_fingerprint, block_size, layout, cap_bytes)

    def close(self) -> None:
        with self._ahead_lock:
            self._closed = True
            for future in self._ahead.values():
                future.cancel()
            self._ahead.clear()
        self.flush()
        for pool in (self._readers, self._writer):
            if pool is not None:
                pool.shutdown()
        self.files.close()

    # -- reading -------------------------------------------------------------------------------

    def load(self, key: bytes) -> Block | None:
        """The block stored under `key`, or None if absent or not trustworthy."""
        return self.load_many([key])[key]

    def read_ahead(self, keys: list[bytes]) -> None:
        """Start reading and checking these blocks' files on the reader threads (from any
        thread: a job's feeder, while the engine warms up); `load_many` takes what they
        read. The checks are the same: reading earlier trusts nothing more."""
        listed = [k for k in keys if self._listed(_file_name(k))]
        with self._ahead_lock:
            if self._ahead or self._closed:  # one prompt's blocks at a time
                return
            pool = self._pool()
            for key in listed:
                self._ahead[key] = pool.submit(self._read, key)

    def _pool(self) -> ThreadPoolExecutor:
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READ_THREADS, "batchrun-cache-read")
        return self._readers

    def load_many(self, keys: list[bytes]) -> dict[bytes, Block | None]:
        """Each key's stored block, or None if absent or not trustworthy; the files are read and
        checked on several threads (or were, by read_ahead)."""
        found: dict[bytes, Block | None] = dict.fromkeys(keys)
        with self._ahead_lock:
            ahead = {k: self._ahead.pop(k) for k in keys if k in self._ahead}
            if ahead:  # the rest were past the prompt's first absent block: never asked for
                for future in self._ahead.values():
                    future.cancel()
                self._ahead.clear()
        listed = [k for k in keys if k in ahead or self._listed(_file_name(k))]
        if len(listed) - len(ahead) > 1:
            with self._ahead_lock:
                pool = self._pool()
            reads = {k: pool.submit(self._read, k) for k in listed if k not in ahead}
            checked = [(ahead.get(k) or reads[k]).result() for k in listed]
        else:
            checked = [ahead[k].result() if k in ahead else self._read(k) for k in listed]
        for key, verified in zip(listed, checked, strict=True):
            found[key] = self._block(key, verified)
        return found

    def _read(self, key: bytes) -> blockfile.Verified | Exception | None:
        """A block file's bytes, checked (any thread): None if absent, the error if not good."""
        try:
            data = self.files.read(_file_name(key), self._max_file_bytes)
            return None if data is None else blockfile.verify(
                data, self.expected, *([self.with_state] if self.with_state else []))
        except (ValueError, OSError) as e:
            return e

    def _block(self, key: bytes, verified: blockfile.Verified | Exception | None
               ) -> Block | None:
        name = _file_name(key)
        if verified is None:
            return None
        try:
            if isinstance(verified, Exception):
                raise verified
            block = self._decode(key, verified)
        except ValueError as e:  # not a regular file, or not a valid block of this model
            self._damaged(name, e)
            return None
        except OSError as e:
            self._io_warning("read", e)
            return None
        try:
            self.files.touch(name)
        except OSError as e:  # a read-only cache still serves its blocks
            self._io_warning("mark as used an entry of", e)
        return block

    def _listed(self, name: str) -> bool:
        """Whether `name` may be in the folder (True when it cannot be listed). Any thread:
        two listings of one folder descriptor at once would share its read position."""
        with self._lock:
            now = time.monotonic()
            if self._listing is None or now - self._listed_at > LISTING_TTL_S:
                try:
                    self._listing = self.files.names()
                except OSError as e:
                    self._io_warning("list", e)
                    self._listing = None
                    return True
                self._listed_at = now
            return name in self._listing

    def stored_keys(self) -> list[bytes]:
        """Keys of the stored blocks, least recently used first (unverified: `load` checks)."""
        try:
            files = self._entries()
        except OSError as e:
            self._io_warning("list", e)
            return []
        return [bytes.fromhex(k) for k in sorted(files, key=lambda k: files[k].st_mtime)]

    def _decode(self, key: bytes, verified: blockfile.Verified) -> Block:
        arrays, meta = blockfile.arrays_of(verified)
        if any(meta.get(k) != v for k, v in self._meta.items()):
            raise blockfile.BlockFormatError("written for another model or layout")
        try:
            tokens = orjson.loads(meta.get("tokens", ""))
            parent = bytes.fromhex(meta.get("parent", ""))
            salt = bytes.fromhex(meta.get("salt", ""))
        except (ValueError, TypeError):
            raise blockfile.BlockFormatError("tokens, parent or salt unreadable") from None
        if not (isinstance(tokens, list) and len(tokens) == self.block_size
                and all(type(t) is int and 0 <= t < 2**32 for t in tokens)):
            raise blockfile.BlockFormatError("bad tokens")
        if len(parent) != len(key) or chain(parent, tokens, salt) != key:
            raise blockfile.BlockFormatError("its tokens do not hash to its key")
        layers = range(self.layout.layers)
        state = [arrays[f"s.{j}"] for j in range(len(self.layout.states))] \
            if self.layout.states and "s.0" in arrays else None
        return Block(key, parent, tuple(tokens), [arrays[f"k.{i}"] for i in layers],
                     [arrays[f"v.{i}"] for i in layers], salt, state)

    def _damaged(self, name: str, reason: Exception) -> None:
        self.skipped += 1
        try:
            self.files.remove(name)
        except OSError as e:
            self._io_warning("remove a damaged entry from", e)
        if "damaged" not in self._warned:
            self._warned.add("damaged")
            log.warning("prefix cache: removing damaged entries from %s (first: %s); they are "
                        "recomputed, saved again, and counted as disk_skipped in the cache "
                        "stats", self.folder, reason)

    # -- writing -------------------------------------------------------------------------------

    def save(self, blocks: list[Block]) -> None:
        """Write blocks (replacing any entry of the same key), record them in the index, evict
        past the cap."""
        self._write(self._prepared(blocks))

    def save_later(self, blocks: list[Block]) -> None:
        """`save` on the writer thread (the tensors' bytes are fetched here, the files made and
        written there); `flush` waits for it."""
        prepared = self._prepared(blocks)
        if not prepared:
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, "batchrun-cache-write")
        self._writes = [f for f in self._writes if not f.done()]
        self._writes.append(self._writer.submit(self._write, prepared))

    def _prepared(self, blocks: list[Block]) -> list[tuple[bytes, blockfile.Pending]]:
        kept = [(block, parts) for block in blocks if (parts := self._parts(block)) is not None]
        try:
            pending = blockfile.prepare_many([parts for _, parts in kept])
        except (RuntimeError, MemoryError) as e:  # the device could not hand over the bytes
            if "fetch" not in self._warned:
                self._warned.add("fetch")
                log.warning("prefix cache: blocks not written to %s (%s); they are kept in "
                            "memory only", self.folder, e)
            return []
        return [(block.key, p) for (block, _), p in zip(kept, pending, strict=True)]

    def flush(self) -> None:
        """Wait until every block handed to `save` is written (or failed, with its warning)."""
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()

    def _write(self, prepared: list[tuple[bytes, blockfile.Pending]]) -> None:
        written = {}
        for key, pending in prepared:
            data = blockfile.pack(pending)
            try:
                self.files.write(_file_name(key), data)
            except OSError as e:  # a full or read-only cache never stops a job
                self._io_warning("write to", e)
                continue
            with self._lock:
                if self._listing is not None:
                    self._listing.add(_file_name(key))
                self.saved += 1
            written[key.hex()] = {"bytes": len(data), "tokens": self.block_size,
                                  "used": time.time()}
        if written:
            self._update_index(written)

    def _parts(self, block: Block) -> tuple[dict[str, Any], dict[str, str]] | None:
        """The block's tensors by name and its metadata (None: not this model's layout)."""
        tensors = block.keys + block.values
        shape, dtype = self.layout.shape(self.block_size), DTYPES[self.layout.dtype]
        if len(tensors) != len(self.expected) or len(block.tokens) != self.block_size \
                or any(a.shape != shape or a.dtype != dtype for a in tensors):
            if "layout" not in self._warned:  # the engine's blocks are not what we measured
                self._warned.add("layout")
                log.warning("prefix cache: blocks do not match the model's KV layout %s; they "
                            "are kept in memory only", self.layout)
            return None
        meta = {**self._meta, "parent": block.parent.hex(),
                "tokens": orjson.dumps(list(block.tokens)).decode(), "salt": block.salt.hex()}
        named = dict(zip(self.expected, tensors, strict=True))
        if block.state is not None:
            states = self.layout.states
            if len(block.state) != len(states) or any(
                    tuple(a.shape) != shape or a.dtype != DTYPES[d]
                    for a, (shape, d) in zip(block.state, states, strict=False)):
                return named, meta  # kept without its snapshot: rows start elsewhere
            named.update({f"s.{j}": a for j, a in enumerate(block.state)})
        return named, meta

    def _update_index(self, written: dict[str, dict]) -> None:
        try:
            with self.files.locked(LOCK):
                files = self._entries()
                index = self._read_index(files)
                index.update((k, v) for k, v in written.items() if k in files)
                self._evict(index, files)
                self.files.write(INDEX, orjson.dumps(index))
        except OSError as e:
            self._io_warning("update the index in", e)
        except NotRegularFile as e:
            self._io_warning("lock the index in", e)

    def _evict(self, index: dict[str, dict], files: dict[str, os.stat_result]) -> None:
        total = sum(files[k].st_size for k in index)
        for key in sorted(index, key=lambda k: max(index[k]["used"], files[k].st_mtime)):
            if total <= self.cap_bytes:
                break
            try:
                self.files.remove(key + SUFFIX)
            except OSError as e:
                self._io_warning("evict an entry from", e)
                continue
            total -= files[key].st_size
            del index[key]

    def _entries(self) -> dict[str, os.stat_result]:
        """The regular files named like a block entry, by key (hex)."""
        return {name[: -len(SUFFIX)]: st for name, st in self.files.entries().items()
                if _ENTRY.fullmatch(name)}

    def _read_index(self, files: dict[str, os.stat_result]) -> dict[str, dict]:
        """The index entry of every block file: from index.json where it holds a well-formed
        one, else from the file itself."""
        try:
            index = orjson.loads(self.files.read(INDEX, MAX_INDEX_BYTES) or b"{}")
        except NotRegularFile:  # a link, FIFO or folder: out of the way of the new index
            self.files.remove(INDEX)
            index = None
        except ValueError:  # not JSON
            index = None
        if not isinstance(index, dict):
            index = {}
            self._index_rebuilt()
        out = {}
        for key, st in files.items():
            entry = index.get(key)
            if entry is not None and not _good_entry(entry):
                entry = None
                self._index_rebuilt()
            out[key] = entry or {"bytes": st.st_size, "tokens": self.block_size,
                                 "used": st.st_mtime}
        return out

    def _index_rebuilt(self) -> None:
        if "index" not in self._warned:
            self._warned.add("index")
            log.warning("prefix cache: the index in %s was malformed; rebuilt from its files",
                        self.folder)

    def _io_warning(self, action: str, e: Exception) -> None:
        kind = errno.errorcode.get(getattr(e, "errno", None) or 0, type(e).__name__)
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("prefix cache: could not %s %s (%s); the job goes on without it",
                        action, self.folder, _why(e))


def _good_entry(entry: object) -> bool:
    return isinstance(entry, dict) and all(
        type(entry.get(field)) in types
        for field, types in (("bytes", (int,)), ("tokens", (int,)), ("used", (int, float))))


def _tensor_names(layers: int) -> list[str]:
    return [f"k.{i}" for i in range(layers)] + [f"v.{i}" for i in range(layers)]


def _file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def _same_folder(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _root_problem(root: Path) -> str | None:
    """Why an existing default cache folder is unsafe to use, or None."""
    try:
        return sharing_problem(os.stat(root))
    except FileNotFoundError:
        return None  # created private


def _why(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


# -- the `batchrun cache` commands -------------------------------------------------------------

def cache_summary(cache_dir: Path) -> list[dict]:
    """One entry per model folder under `cache_dir/prefix`: blocks, bytes, last use. Counts
    regular block files only; links, FIFOs and unreadable folders are left out, never followed."""
    out = []
    prefix = Path(cache_dir) / "prefix"
    try:
        if not stat.S_ISDIR(prefix.lstat().st_mode):  # a link or a file: not ours to list
            return []
        with os.scandir(prefix) as it:
            folders = sorted((e for e in it if e.is_dir(follow_symlinks=False)),
                             key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        log.warning("prefix cache: cannot list %s (%s)", prefix, _why(e))
        return []
    for folder in folders:
        files = _regular_entries(Path(folder.path))
        out.append({"model": folder.name, "blocks": len(files),
                    "bytes": sum(st.st_size for st in files),
                    "last_used": max((st.st_mtime for st in files), default=None),
                    "folder": folder.path})
    return out


def _regular_entries(folder: Path) -> list[os.stat_result]:
    found = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                try:
                    if _ENTRY.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                        found.append(e.stat(follow_symlinks=False))
                except OSError:  # removed while we listed: not an entry any more
                    continue
    except OSError as e:
        log.warning("prefix cache: cannot list %s (%s)", folder, _why(e))
    return found
