"""Loading an image reference: where it points (bytes, a local file, a data: URI or an http(s)
URL, as the policy allows), reading it within the byte limit and decoding it; and ImageCache,
which does the same through an LRU of decoded images keyed by content.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun.io.media.data_uri import _data_uri
from batchrun.io.media.decode import LoadedImage, _decode
from batchrun.io.media.errors import MediaError, _too_large
from batchrun.io.media.fetch import _fetch
from batchrun.io.media.local import _allowed_path, _file_url_path, _read_local, _stat_local
from batchrun.io.media.policy import DEFAULT_POLICY, MediaPolicy

MAX_BYTES = 20 * 1024 * 1024  # encoded size of one image
MAX_PIXELS = 50_000_000  # width * height of one image, checked before decoding
CACHE_ENTRIES = 256
CACHE_BYTES = 1 << 30  # decoded RGB bytes the cache may hold
_SCHEMES = "a local path, a file:// URL, a data:image/...;base64 URI or an http(s) URL"


@dataclass(frozen=True, slots=True)
class _Source:
    kind: str  # "bytes", "file" or "url"
    value: Any  # bytes, a _LocalPath, or the URL


def load_image(ref: str | bytes | dict, base_dir: Path, field: str,
               policy: MediaPolicy = DEFAULT_POLICY, *, max_bytes: int = MAX_BYTES,
               max_pixels: int = MAX_PIXELS) -> LoadedImage:
    """Load and decode one image reference; raises MediaError naming `field`."""
    try:
        source = _locate(ref, Path(base_dir), policy, max_bytes)
        return _decode(_read(source, max_bytes, policy), max_pixels)
    except MediaError as e:
        raise e.at(field) from None


class ImageCache:
    """load_image with an LRU of decoded images keyed by content, so a picture that many rows
    share is read and decoded once. Failures keyed the same way are remembered, so a repeated
    bad image (or an unreachable URL) fails at once."""

    def __init__(self, max_entries: int = CACHE_ENTRIES, max_cached_bytes: int = CACHE_BYTES, *,
                 max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS):
        self.max_entries = max_entries
        self.max_cached_bytes = max_cached_bytes
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        self.hits = 0  # lookups answered from the cache, image or remembered failure
        self.misses = 0  # lookups that had to read and decode
        self.cached_bytes = 0
        self._images: OrderedDict[tuple, LoadedImage] = OrderedDict()
        self._failures: OrderedDict[tuple, MediaError] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._images)

    def load(self, ref: str | bytes | dict, base_dir: Path, field: str,
             policy: MediaPolicy = DEFAULT_POLICY) -> LoadedImage:
        """As load_image, through the cache (the policy is checked before any lookup)."""
        try:
            source = _locate(ref, Path(base_dir), policy, self.max_bytes)
            key = self._key(source, policy)
            found = self._lookup(key)
            if found is not None:
                return found
            try:
                loaded = _decode(_read(source, self.max_bytes, policy), self.max_pixels)
            except MediaError as e:
                self._remember(self._failures, key, e)
                raise
            self._store(key, loaded)
            return loaded
        except MediaError as e:
            raise e.at(field) from None

    def _key(self, source: _Source, policy: MediaPolicy) -> tuple:
        if source.kind == "file":
            st = _stat_local(source.value, self.max_bytes)
            return ("file", str(source.value.path), st.st_mtime_ns, st.st_size)
        if source.kind == "url":  # what a URL gave depends on what it was allowed to reach
            return ("url", source.value, policy.allow_private_urls)
        return ("bytes", hashlib.sha256(source.value).hexdigest())

    def _lookup(self, key: tuple) -> LoadedImage | None:
        with self._lock:
            failure = self._failures.get(key)
            loaded = self._images.get(key)
            if loaded is not None:
                self._images.move_to_end(key)
            if failure is None and loaded is None:
                self.misses += 1
                return None
            self.hits += 1
        if failure is not None:
            raise failure
        return loaded

    def _store(self, key: tuple, loaded: LoadedImage) -> None:
        if loaded.nbytes > self.max_cached_bytes:
            return
        with self._lock:
            if key in self._images:
                return
            self._images[key] = loaded
            self.cached_bytes += loaded.nbytes
            while len(self._images) > self.max_entries or self.cached_bytes > self.max_cached_bytes:
                _, old = self._images.popitem(last=False)
                self.cached_bytes -= old.nbytes

    def _remember(self, table: OrderedDict, key: tuple, value: Any) -> None:
        with self._lock:
            table[key] = value
            while len(table) > self.max_entries:
                table.popitem(last=False)


def _locate(ref: Any, base_dir: Path, policy: MediaPolicy, max_bytes: int) -> _Source:
    if isinstance(ref, dict):
        ref = _pick_from_dict(ref)
    if isinstance(ref, bytes | bytearray | memoryview):
        return _Source("bytes", bytes(ref))
    if not isinstance(ref, str):
        raise MediaError("invalid_image_url", f"an image must be {_SCHEMES}, bytes, or "
                         f"{{bytes, path}}; got {type(ref).__name__}")
    url = ref.strip()
    if not url:
        raise MediaError("invalid_image_url", f"the image URL is empty; give {_SCHEMES}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _Source("bytes", _data_uri(url, max_bytes))
    if scheme in ("http", "https"):
        return _Source("url", url)
    if scheme == "file":
        return _Source("file", _allowed_path(str(_file_url_path(url)), base_dir, policy))
    if "://" in url:
        raise MediaError("invalid_image_url", f"unsupported URL scheme {scheme + '://'!r}; "
                         f"give {_SCHEMES}")
    return _Source("file", _allowed_path(url, base_dir, policy))


def _pick_from_dict(ref: dict) -> Any:
    """HF datasets' Image feature: bytes when present, else the path; or an image_url object."""
    if ref.get("bytes"):
        return ref["bytes"]
    for key in ("path", "url"):
        if ref.get(key):
            return ref[key]
    raise MediaError("invalid_image_url", "an image object needs 'bytes', 'path' or 'url', "
                     f"got keys {sorted(map(str, ref))}")


def _read(source: _Source, max_bytes: int, policy: MediaPolicy) -> bytes:
    if source.kind == "file":
        return _read_local(source.value, max_bytes)
    if source.kind == "url":
        return _fetch(source.value, max_bytes, policy)
    if len(source.value) > max_bytes:
        raise _too_large(len(source.value), max_bytes)
    return source.value
