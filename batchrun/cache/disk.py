"""The prefix cache on disk: one safetensors file per block, an index, a size cap, LRU eviction.

Layout: `<cache_dir>/prefix/<model fingerprint>/<block key>.safetensors`, plus `index.json`
(key -> bytes, tokens, last use) in the same folder. Entries of another model live in another
folder, so a changed model never reads them.

Safety: a block file is written to a temporary name and renamed, so readers see whole files
only. Its metadata carries the model fingerprint, the parent key, the tokens and a checksum of
the tensors; a loaded block must hash back to its own key and match its checksum, or it is
skipped with a warning and never used. The index is rewritten under an exclusive lock
(`index.lock`), so several jobs and processes can share one cache folder; a missing or corrupt
index is rebuilt from the files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from pathlib import Path

import mlx.core as mx
import orjson

from batchrun.cache.prefix import Block, block_keys
from batchrun.io.files import write_atomic

log = logging.getLogger("batchrun.cache")
FORMAT = "batchrun-prefix-1"
DEFAULT_CAP_BYTES = 8 * 2**30


def default_cache_dir() -> Path:
    return Path(os.environ.get("BATCHRUN_CACHE_DIR") or Path.home() / ".cache" / "batchrun")


def _checksum(arrays: dict[str, mx.array]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(memoryview(mx.view(arrays[name], mx.uint8)).tobytes())
    return h.hexdigest()


class DiskCache:
    def __init__(self, cache_dir: Path, model_fingerprint: str, block_size: int,
                 cap_bytes: int = DEFAULT_CAP_BYTES):
        self.model = model_fingerprint
        self.root = bytes.fromhex(model_fingerprint)[:16]
        self.block_size = block_size
        self.cap_bytes = cap_bytes
        self.folder = Path(cache_dir) / "prefix" / model_fingerprint[:32]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.skipped = 0
        self.saved = 0

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.safetensors"

    # -- reading ---------------------------------------------------------------------------

    def load(self, key: bytes) -> Block | None:
        """The block stored under `key`, or None if absent or not trustworthy."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            block = self._validate(key, arrays, meta)
        except Exception as e:  # a truncated or foreign file: never use it
            block, reason = None, f"{type(e).__name__}: {e}"
        else:
            reason = "" if block else "its content does not match its key"
        if block is None:
            self.skipped += 1
            log.warning("prefix cache: skipped %s (%s)", path.name, reason)
            return None
        _touch(path)
        return block

    def _validate(self, key: bytes, arrays: dict, meta: dict) -> Block | None:
        if meta.get("format") != FORMAT or meta.get("model") != self.model:
            return None
        tokens = tuple(orjson.loads(meta["tokens"]))
        parent = bytes.fromhex(meta["parent"])
        if len(tokens) != self.block_size or int(meta["block_size"]) != self.block_size:
            return None
        if _chain(parent, tokens) != key or meta.get("checksum") != _checksum(arrays):
            return None
        layers = int(meta["layers"])
        keys = [arrays[f"k.{i}"] for i in range(layers)]
        values = [arrays[f"v.{i}"] for i in range(layers)]
        if any(a.shape[2] != self.block_size for a in keys + values):
            return None
        return Block(key, parent, tokens, keys, values)

    # -- writing ---------------------------------------------------------------------------

    def save(self, blocks: list[Block]) -> None:
        """Write new blocks (atomically), record them in the index, evict past the cap."""
        written = {}
        for block in blocks:
            path = self.path(block.key)
            if path.exists():
                continue
            arrays = {f"k.{i}": k for i, k in enumerate(block.keys)}
            arrays |= {f"v.{i}": v for i, v in enumerate(block.values)}
            meta = {"format": FORMAT, "model": self.model, "parent": block.parent.hex(),
                    "tokens": orjson.dumps(list(block.tokens)).decode(),
                    "block_size": str(self.block_size), "layers": str(len(block.keys)),
                    "checksum": _checksum(arrays)}
            # mx.save_safetensors insists on the suffix; the leading dot hides it from globs.
            tmp = path.with_name(f".{block.key.hex()}.{os.getpid()}.tmp.safetensors")
            try:
                mx.save_safetensors(str(tmp), arrays, metadata=meta)
                os.replace(tmp, path)
            except OSError as e:  # a full or read-only cache never stops a job
                tmp.unlink(missing_ok=True)
                log.warning("prefix cache: could not write %s: %s", path.name, e)
                return
            written[block.key.hex()] = {"bytes": path.stat().st_size,
                                        "tokens": self.block_size, "used": time.time()}
            self.saved += 1
        if written:
            try:
                with self._locked_index() as index:
                    index.update(written)
                    self._evict(index)
            except OSError as e:
                log.warning("prefix cache: could not update the index: %s", e)

    def _evict(self, index: dict) -> None:
        total = sum(e["bytes"] for e in index.values())
        for key in sorted(index, key=lambda k: self._last_use(k, index[k])):
            if total <= self.cap_bytes:
                break
            total -= index.pop(key)["bytes"]
            self.path(bytes.fromhex(key)).unlink(missing_ok=True)

    def _last_use(self, key: str, entry: dict) -> float:
        try:  # loads touch the file; the index keeps the time of the write
            return max(entry["used"], self.path(bytes.fromhex(key)).stat().st_mtime)
        except OSError:
            return 0.0

    @contextlib.contextmanager
    def _locked_index(self):
        with open(self.folder / "index.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            index = self._read_index()
            yield index
            write_atomic(self.folder / "index.json", orjson.dumps(index))

    def _read_index(self) -> dict:
        try:
            index = orjson.loads((self.folder / "index.json").read_bytes())
            if isinstance(index, dict):
                return {k: v for k, v in index.items() if self.path(bytes.fromhex(k)).exists()}
        except (OSError, ValueError):
            pass
        return self._rebuild_index()

    def _rebuild_index(self) -> dict:
        return {p.stem: {"bytes": p.stat().st_size, "tokens": self.block_size,
                         "used": p.stat().st_mtime}
                for p in entry_files(self.folder)}


def entry_files(folder: Path) -> list[Path]:
    """The block files of a model folder (not temporary files of writes in progress)."""
    return [p for p in folder.glob("*.safetensors") if not p.name.startswith(".")]


def _chain(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    # The same chaining as block_keys, for one block after `parent`.
    return block_keys(list(tokens), len(tokens), parent)[0]


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):  # another process may have evicted it meanwhile
        os.utime(path)


def cache_summary(cache_dir: Path) -> list[dict]:
    """One entry per model folder under `cache_dir/prefix`: blocks, bytes, last use."""
    out = []
    for folder in sorted((Path(cache_dir) / "prefix").glob("*")):
        files = entry_files(folder)
        out.append({"model": folder.name, "blocks": len(files),
                    "bytes": sum(f.stat().st_size for f in files),
                    "last_used": max((f.stat().st_mtime for f in files), default=None),
                    "folder": str(folder)})
    return out
