"""Load the images that rows reference; bad media is a MediaError that names the row's field.

A reference is a local path (relative to the input file's folder), a file:// URL, a data: URI,
an http(s) URL, raw bytes, or a {bytes, path} dict as HF datasets writes to Parquet. Every
failure - missing file, no network, not an image, truncated, too large - raises MediaError with
a code and a message that starts with the field; nothing else escapes. A LoadedImage is fully
decoded RGB with its EXIF orientation applied, and its digest depends only on its pixels.

Rows are untrusted (a MediaPolicy says what they may reach): a local path is read only if it
lies under an allowed root (`..` taken by its words, never climbing above the root), is opened
from that root one name at a time without following any symbolic link, and is a regular file
within the byte limit; a data: URI over the limit is refused before it is decoded; an http(s)
URL connects only to the public addresses its host resolved to (checked again on every
redirect) unless private ones are allowed; one deadline bounds all of an image's network work;
and no message quotes a file's or a response's content.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import http.client
import io
import ipaddress
import os
import socket
import ssl
import stat
import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlsplit

from PIL import Image, ImageOps, UnidentifiedImageError

MAX_BYTES = 20 * 1024 * 1024  # encoded size of one image
MAX_PIXELS = 50_000_000  # width * height of one image, checked before decoding
MEDIA_TIMEOUT = 30.0  # seconds one image may take: name lookup, connect, every read, redirects
MAX_REDIRECTS = 5
CACHE_ENTRIES = 256
CACHE_BYTES = 1 << 30  # decoded RGB bytes the cache may hold

# Formats a row may use. Others PIL can open (EPS runs Ghostscript, say) are not worth the risk.
_WANTED = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
Image.init()
FORMATS = tuple(f for f in _WANTED if f in Image.ID)
# Signatures of those formats: data that starts like one but fails to open is corrupt, not
# unsupported.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"),
          (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))
_SCHEMES = "a local path, a file:// URL, a data:image/...;base64 URI or an http(s) URL"


class MediaError(Exception):
    """A row's image could not be used; str() is "<field>: <what went wrong and the fix>"."""

    def __init__(self, code: str, detail: str, field: str = ""):
        super().__init__(f"{field}: {detail}" if field else detail)
        self.code = code
        self.detail = detail
        self.field = field

    def at(self, field: str) -> MediaError:
        """The same error, reported against `field`."""
        return MediaError(self.code, self.detail, field)


@dataclass(frozen=True, slots=True)
class LoadedImage:
    image: Image.Image = field(compare=False, repr=False)  # RGB, fully loaded, upright
    width: int
    height: int
    digest: str  # sha256 of the size and RGB pixels: equal pictures, equal digests

    @property
    def nbytes(self) -> int:
        return self.width * self.height * 3


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """What a row's image references may reach: local files under the input file's folder or
    `roots` (--media-root), http(s) URLs on public addresses unless `allow_private_urls`, and
    `timeout` seconds for each image (--media-timeout)."""

    roots: tuple[Path, ...] = ()
    allow_private_urls: bool = False
    timeout: float = MEDIA_TIMEOUT

    def __post_init__(self):
        if not self.timeout > 0:
            raise ValueError(f"the media timeout must be over 0 seconds, got {self.timeout!r}")


DEFAULT_POLICY = MediaPolicy()


@dataclass(frozen=True, slots=True)
class _Source:
    kind: str  # "bytes", "file" or "url"
    value: Any  # bytes, a _LocalPath, or the URL


class _LocalPath(NamedTuple):
    root: str  # an allowed root, its own links resolved once
    parts: tuple[str, ...]  # the names below it: no "", "." or ".."

    @property
    def path(self) -> Path:
        return Path(self.root, *self.parts)


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


# -- Messages -------------------------------------------------------------------------------

_PART_TYPES = ("text", "image_url", "input_image", "image")


def image_parts(messages: Any, prefix: str = "messages") -> list[tuple[str, object]]:
    """The (field, reference) of every image in the messages, in order. Raises MediaError
    (invalid_content or invalid_image_url) for content that is not a string or a list of known
    parts."""
    if not isinstance(messages, list):
        raise MediaError("invalid_content", "must be a list of {role, content} objects", prefix)
    found: list[tuple[str, object]] = []
    for i, message in enumerate(messages):
        where = f"{prefix}[{i}]"
        if not isinstance(message, dict):
            raise MediaError("invalid_content", "must be a {role, content} object", where)
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise MediaError("invalid_content", "must be a string or a list of "
                             "{type: text|image_url, ...} parts", f"{where}.content")
        for j, part in enumerate(content):
            ref = _part_image(part, f"{where}.content[{j}]")
            if ref is not None:
                found.append(ref)
    return found


def count_images(messages: Any, prefix: str = "messages") -> int:
    return len(image_parts(messages, prefix))


def check_image_count(n: int, limit: int | None, field: str) -> None:
    if limit is not None and n > limit:
        raise MediaError("too_many_images", f"the row has {n} images, more than the limit of "
                         f"{limit} per row; split the row or raise the job's image limit", field)


def _part_image(part: Any, where: str) -> tuple[str, object] | None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _PART_TYPES:
        raise MediaError("invalid_content", f"must be a part with type one of "
                         f"{', '.join(_PART_TYPES)}, got {_describe(part, kind)}", where)
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise MediaError("invalid_content", "a text part needs a string 'text'", where)
        return None
    if kind in ("image_url", "input_image"):
        where = f"{where}.{kind}"  # input_image is the Responses API's image_url part
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url.strip():
            raise MediaError("invalid_image_url", "needs a url: {\"url\": \"<path, file://, "
                             "data: or http(s) URL>\"} or the URL as a string", where)
        return where, url
    for key in ("image", "url", "path"):  # {type: image} as Qwen and HF chat templates write it
        if part.get(key) is not None:
            return f"{where}.{key}", part[key]
    raise MediaError("invalid_image_url", "an image part needs 'image' (a path, URL or bytes), "
                     "'url' or 'path'", where)


def _describe(part: Any, kind: Any) -> str:
    if not isinstance(part, dict):
        return type(part).__name__
    return "no type" if kind is None else repr(kind)


# -- Locating and reading -------------------------------------------------------------------

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


def _allowed_path(path: str, base_dir: Path, policy: MediaPolicy) -> _LocalPath:
    """The allowed root that `path` lies under by its words alone (`..` removed lexically, no
    link below a root resolved), and the names below it; the deepest root wins, so a root that
    is a link inside another is walked from its target. Else one message whatever the path is:
    it must not tell whether the file exists."""
    if "\0" in path:
        raise MediaError("invalid_image_url", "the image path holds a NUL character")
    try:
        target = Path(os.path.normpath(os.path.join(os.path.abspath(base_dir), path)))
        found = max(_roots_holding(target, (base_dir, *policy.roots)), default=None,
                    key=lambda match: len(match[0].parts))
    except OSError as e:  # the current folder is gone, or a root moved while it resolved
        raise MediaError("image_not_found", f"cannot read {path}: {e.strerror or e}") from None
    if found is not None:
        form, real = found
        return _LocalPath(real, target.relative_to(form).parts)
    raise MediaError("image_path_not_allowed", "the image path lies outside the folders images "
                     "may be read from (the input file's folder and each --media-root); pass "
                     "--media-root DIR to allow the folder that holds it")


def _roots_holding(target: Path, roots: tuple[Path, ...]) -> Iterator[tuple[Path, str]]:
    """(the root as written or resolved, its resolved path) for each root that holds `target`.
    A root's own links are the user's, so it may be named either way."""
    for root in roots:
        real = os.path.realpath(root)
        for form in (Path(os.path.normpath(os.path.abspath(root))), Path(real)):
            if target.is_relative_to(form):
                yield form, real


def _pick_from_dict(ref: dict) -> Any:
    """HF datasets' Image feature: bytes when present, else the path; or an image_url object."""
    if ref.get("bytes"):
        return ref["bytes"]
    for key in ("path", "url"):
        if ref.get(key):
            return ref[key]
    raise MediaError("invalid_image_url", "an image object needs 'bytes', 'path' or 'url', "
                     f"got keys {sorted(map(str, ref))}")


def _data_uri(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError("invalid_image_url", "a data URI needs a comma before its data: "
                         "data:image/png;base64,<data>")
    params = [p.strip().lower() for p in header.split(";")]
    mime = params[0]
    if mime and not mime.startswith("image/"):
        raise MediaError("unsupported_image", f"the data URI's type is {mime!r}, not an image; "
                         "use data:image/png;base64,... (or jpeg, webp, gif)")
    data = _data_base64(payload, max_bytes) if "base64" in params[1:] \
        else _data_escaped(payload, max_bytes)
    if not data:
        raise MediaError("invalid_image_url", "the data URI holds no data")
    return data


def _data_escaped(payload: str, max_bytes: int) -> bytes:
    # Every byte takes at most 3 characters (%XX): a longer payload is too large undecoded.
    if len(payload) > 3 * max_bytes:
        raise _too_large(len(payload) // 3, max_bytes, at_least=True)
    data = _unescaped(payload, max_bytes, strip=False)
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, at_least=True)
    return data


def _data_base64(payload: str, max_bytes: int) -> bytes:
    limit = 4 * -(-max_bytes // 3)  # the longest base64 of an image within the limit
    text = _unescaped(payload, limit, strip=True).translate(_URLSAFE)
    size = len(text.rstrip(b"=")) * 3 // 4  # what it decodes to: 3 bytes for 4 characters
    if size > max_bytes:
        raise _too_large(size, max_bytes, at_least=len(text) > limit)
    try:
        return base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError("invalid_image_url", f"the data URI is not valid base64 ({e}); "
                         "re-encode the image with standard base64") from None


def _unescaped(payload: str, limit: int, strip: bool) -> bytes:
    """The payload with its %XX escapes decoded (and whitespace dropped if `strip`), a slice at
    a time, stopping once past `limit` bytes: a huge URI is never decoded whole."""
    out = bytearray()
    start = 0
    while start < len(payload) and len(out) <= limit:
        end = start + _SLICE
        if end < len(payload):  # never split an escape between slices
            cut = payload.find("%", end - 2, end)
            end = end if cut == -1 else cut
        piece = unquote_to_bytes(payload[start:end])
        out += b"".join(piece.split()) if strip else piece
        start = end
    return bytes(out)


_SLICE = 1 << 16  # characters of a data URI decoded at once
_URLSAFE = bytes.maketrans(b"-_", b"+/")


def _file_url_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("invalid_image_url", f"{url!r} names host {parts.netloc!r}; a file URL "
                         "needs an absolute path: file:///abs/path.png")
    return Path(urllib.request.url2pathname(parts.path))


def _read(source: _Source, max_bytes: int, policy: MediaPolicy) -> bytes:
    if source.kind == "file":
        return _read_local(source.value, max_bytes)
    if source.kind == "url":
        return _fetch(source.value, max_bytes, policy)
    if len(source.value) > max_bytes:
        raise _too_large(len(source.value), max_bytes)
    return source.value


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY
# Never blocking: a FIFO swapped in after the check opens at once, and fstat refuses it.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _check_regular(st: os.stat_result, path: Path, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise MediaError("image_not_found", f"{path} is {kind}, not an image file; only "
                         "regular files are read")
    if st.st_size > max_bytes:
        raise _too_large(st.st_size, max_bytes)


def _stat_local(local: _LocalPath, max_bytes: int) -> os.stat_result:
    """The stat of an allowed file; one that is no regular file is refused without opening it
    (opening a FIFO or a device could block or act)."""
    with _file_errors(local):
        parent = _open_parent(local)
        try:
            return _stat_in(parent, local, max_bytes)
        finally:
            os.close(parent)


def _read_local(local: _LocalPath, max_bytes: int) -> bytes:
    with _file_errors(local):
        parent = _open_parent(local)
        try:
            _stat_in(parent, local, max_bytes)
            fd = _open_in(parent, local, len(local.parts) - 1, _FILE_FLAGS)
        finally:
            os.close(parent)
        try:
            _check_regular(os.fstat(fd), local.path, max_bytes)
            return _read_fd(fd, max_bytes)
        finally:
            os.close(fd)


def _open_parent(local: _LocalPath) -> int:
    """The folder that holds the file, opened from the root one name at a time, each relative
    to the last and none through a link: a folder swapped for a link is refused, not followed,
    and one swapped after it was opened no longer matters (its descriptor is held)."""
    fd = os.open(local.root, _DIR_FLAGS)
    try:
        for i in range(len(local.parts) - 1):
            child = _open_in(fd, local, i, _DIR_FLAGS)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_in(parent: int, local: _LocalPath, i: int, flags: int) -> int:
    """Open the path's name `i` in `parent`; a link there is refused, in words that say so."""
    try:
        return os.open(local.parts[i], flags, dir_fd=parent)
    except OSError:  # O_NOFOLLOW on a link: ELOOP, or ENOTDIR or EMLINK on some systems
        if _is_link(parent, local.parts[i]):
            raise _through_link(local, i) from None
        raise


def _stat_in(parent: int, local: _LocalPath, max_bytes: int) -> os.stat_result:
    if not local.parts:  # the root itself, a folder
        st = os.fstat(parent)
    else:
        st = os.stat(local.parts[-1], dir_fd=parent, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise _through_link(local, len(local.parts) - 1)
    _check_regular(st, local.path, max_bytes)
    return st


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _through_link(local: _LocalPath, i: int) -> MediaError:
    link = Path(local.root, *local.parts[:i + 1])
    return MediaError("image_path_not_allowed", f"the image path goes through a symbolic link "
                      f"({link}), and links below the folders images may be read from are not "
                      "followed (one could be swapped to lead elsewhere); give the file's real "
                      "path, or pass the link itself as --media-root DIR")


@contextlib.contextmanager
def _file_errors(local: _LocalPath) -> Iterator[None]:
    """Any OSError while finding or reading a local file is the row's image_not_found."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError):
        raise MediaError("image_not_found", f"file not found: {local.path} (relative paths "
                         "resolve against the input file's folder)") from None
    except OSError as e:
        raise MediaError("image_not_found", f"cannot read {local.path}: "
                         f"{e.strerror or e}") from None


def _read_fd(fd: int, max_bytes: int) -> bytes:
    chunks = []
    size = 0
    while size <= max_bytes:
        chunk = os.read(fd, max_bytes + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > max_bytes:
        raise _too_large(size, max_bytes)
    return b"".join(chunks)


# -- Fetching -------------------------------------------------------------------------------

_FETCH_FIX = "download the image and reference it by local path or data URI"
_REDIRECTS = (301, 302, 303, 307, 308)
# Networks that carry another address inside an IPv6 one: check the address inside.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT


def address_problem(address: str) -> str | None:
    """Why an image URL may not connect to `address` ("a loopback address", ...) unless
    private URLs are allowed; None for a public address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "an address that is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
    checks = (("is_unspecified", "an unspecified"), ("is_loopback", "a loopback"),
              ("is_link_local", "a link-local"), ("is_multicast", "a multicast"),
              ("is_reserved", "a reserved"), ("is_private", "a private"))
    for attribute, kind in checks:
        if getattr(ip, attribute):
            return f"{kind} address"
    if ip.version == 4 and ip in _SHARED:
        return "a shared (carrier-grade NAT) address"
    if not ip.is_global:
        return "an address that is not public"
    return None


def _fetch(url: str, max_bytes: int, policy: MediaPolicy) -> bytes:
    """GET `url`, following at most MAX_REDIRECTS redirects, each hop checked like the first,
    all within the policy's deadline."""
    deadline = time.monotonic() + policy.timeout
    hop_url = url
    for hop in range(MAX_REDIRECTS + 1):
        body, location = _fetch_once(url, hop_url, hop, max_bytes, policy, deadline)
        if location is None:
            return body
        hop_url = location
    raise MediaError("image_unreachable", f"cannot fetch {url}: more than {MAX_REDIRECTS} "
                     f"redirects; {_FETCH_FIX}")


def _fetch_once(url: str, hop_url: str, hop: int, max_bytes: int, policy: MediaPolicy,
                deadline: float) -> tuple[bytes, str | None]:
    """One request: (body, None), or (b"", the absolute URL it redirects to). `url` is the
    row's URL, the only one messages quote (a redirect's target is the server's content)."""
    parts = urlsplit(hop_url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        host, port = None, e
    if parts.scheme not in ("http", "https") or not host or isinstance(port, ValueError):
        if hop:
            raise MediaError("image_url_not_allowed", f"cannot fetch {url}: it redirects to a "
                             "URL that is not http(s); image URLs may only lead to http(s)")
        raise MediaError("invalid_image_url", f"{url!r} is not a valid URL (no host or a bad "
                         "port)")
    port = port or (443 if parts.scheme == "https" else 80)
    where = url if not hop else f"{url} (after {hop} redirect{'s' * (hop > 1)})"
    proxy = _proxy(parts)
    if proxy is None or not policy.allow_private_urls:
        addresses = _resolve(host if not hop else None, host, port, deadline, policy, where)
        if not policy.allow_private_urls:
            _check_addresses(addresses, url, hop)
    if proxy is not None:  # connect to the proxy, not to the address checked above
        addresses = _resolve(proxy[0], proxy[0], proxy[1], deadline, policy, where)
    watch = _Watchdog(deadline)
    connection = _connection(parts, host, port, addresses, proxy, watch)
    try:
        host_header = _host_header(host, port, parts.scheme)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if proxy is not None and parts.scheme == "http":  # a proxy takes the absolute URL
            target = f"http://{host_header}{target}"
        connection.request("GET", target, headers={
            "Host": host_header, "User-Agent": "batchrun",
            "Accept": "image/*", **({"Proxy-Authorization": proxy[2]}
                                    if proxy and proxy[2] and parts.scheme == "http" else {})})
        response = connection.getresponse()
        if response.status in _REDIRECTS and response.getheader("Location"):
            return b"", urljoin(hop_url, response.getheader("Location"))
        if response.status != 200:
            raise MediaError("image_unreachable", f"cannot fetch {where}: HTTP "
                             f"{_status(response.status)}; check the URL or {_FETCH_FIX}")
        length = response.getheader("Content-Length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise _too_large(int(length), max_bytes)
        body = _read_body(response, max_bytes)
        if watch.expired:  # the watchdog's shutdown reads as the end of the body
            raise TimeoutError("the deadline passed")
        if response.length:  # fewer bytes than Content-Length said
            raise http.client.IncompleteRead(b"", response.length)
        return body, None
    except MediaError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise _network_error(e, where, watch, policy) from None
    finally:
        watch.close()
        connection.close()


def _read_body(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    chunks = []
    size = 0
    while size <= max_bytes:
        chunk = response.read1(min(1 << 16, max_bytes + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > max_bytes:
        raise _too_large(size, max_bytes)
    return b"".join(chunks)


def _network_error(e: BaseException, where: str, watch: _Watchdog,
                   policy: MediaPolicy) -> MediaError:
    """A failed request, in words that quote nothing the server sent."""
    if watch.expired or time.monotonic() >= watch.deadline:
        problem = f"no complete answer within the {policy.timeout:g} s deadline " \
                  "(--media-timeout)"
    elif isinstance(e, http.client.InvalidURL):
        problem = "the URL holds characters a request cannot carry"
    elif isinstance(e, http.client.HTTPException):
        problem = "the reply is not valid HTTP or ended early"
    elif isinstance(e, ssl.SSLError):
        problem = f"TLS failed ({e.reason or type(e).__name__})"
    elif isinstance(e, OSError):
        problem = e.strerror or str(e) or type(e).__name__
    else:
        problem = f"the request could not be made ({type(e).__name__})"
    return MediaError("image_unreachable", f"cannot fetch {where}: {problem}; {_FETCH_FIX}")


def _status(code: int) -> str:
    """The code and its standard phrase (never the server's own reason text)."""
    try:
        return f"{code} {HTTPStatus(code).phrase}"
    except ValueError:
        return str(code)


def _host_header(host: str, port: int, scheme: str) -> str:
    name = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return name if port == default else f"{name}:{port}"


def _check_addresses(addresses: list[str], url: str, hop: int) -> None:
    for address in addresses:
        problem = address_problem(address)
        if problem is not None:
            where = "it redirects to a host that resolves" if hop else "its host resolves"
            raise MediaError("image_url_not_allowed", f"cannot fetch {url}: {where} to "
                             f"{problem}; image URLs may only reach public addresses (pass "
                             "--allow-private-urls to allow loopback, private and link-local "
                             "ones)")


def _proxy(parts) -> tuple[str, int, str | None] | None:
    """(host, port, Proxy-Authorization) of the environment's proxy for this URL, if any."""
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname):
        return None
    found = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if not found.hostname:
        return None
    auth = None
    if found.username:
        secret = f"{unquote(found.username)}:{unquote(found.password or '')}".encode()
        auth = "Basic " + base64.b64encode(secret).decode()
    return found.hostname, found.port or 80, auth


def _resolve(named: str | None, host: str, port: int, deadline: float, policy: MediaPolicy,
             where: str) -> list[str]:
    """The addresses `host` resolves to, within the deadline. Name lookups ignore socket
    timeouts and can hang for many seconds offline, so they run on a thread we stop waiting
    for. `named` is the host as messages may name it (None: a redirect's, left unnamed)."""
    done = threading.Event()
    found: list[str] = []
    failure: list[str] = []

    def lookup() -> None:
        try:
            for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
                if sockaddr[0] not in found:
                    found.append(sockaddr[0])
        except Exception as e:  # OSError, UnicodeError; on this thread, nothing may escape
            failure.append(f"{type(e).__name__}" if named is None else f"{e}")
        finally:
            done.set()

    threading.Thread(target=lookup, name="batchrun-resolve", daemon=True).start()
    name = named or "the host it redirects to"
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise MediaError("image_unreachable", f"cannot fetch {where}: resolving {name} did not "
                         f"finish within the {policy.timeout:g} s deadline (is this machine "
                         f"offline?); {_FETCH_FIX}")
    if failure or not found:
        detail = f" ({failure[0]})" if failure else ""
        raise MediaError("image_unreachable", f"cannot fetch {where}: cannot resolve "
                         f"{name}{detail}; {_FETCH_FIX}")
    return found


class _Watchdog:
    """Shuts a request's socket down when the image's deadline passes, so no run of slow reads
    (a server that drips a byte a second, in its headers or its body) outlives the deadline."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.expired = False
        self._fd = -1
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        return left

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._fd = sock.fileno()
            if self.expired:
                sock.shutdown(socket.SHUT_RDWR)

    def _expire(self) -> None:
        with self._lock:  # the descriptor stays open while held: close() waits for the lock
            self.expired = True
            if self._fd < 0:
                return
            try:  # through a duplicate: the TLS layer may own the socket object
                with socket.socket(fileno=os.dup(self._fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Before the socket closes: its descriptor number may then name another file."""
        with self._lock:
            self._fd = -1
        self._timer.cancel()


def _connection(parts, host: str, port: int, addresses: list[str],
                proxy: tuple[str, int, str | None] | None,
                watch: _Watchdog) -> http.client.HTTPConnection:
    """A connection that dials one of `addresses` (checked, or the proxy's), never resolving
    the host again: a second lookup could answer differently (DNS rebinding). TLS still
    verifies the certificate against the URL's host name, which is also the SNI."""
    dial_port = proxy[1] if proxy is not None else port
    if parts.scheme == "https":
        connection = http.client.HTTPSConnection(host if proxy is None else proxy[0], dial_port,
                                                 context=ssl.create_default_context())
        if proxy is not None:
            connection.set_tunnel(host, port, headers={"Proxy-Authorization": proxy[2]}
                                  if proxy[2] else None)
    else:
        connection = http.client.HTTPConnection(host if proxy is None else proxy[0], dial_port)

    def dial(address, timeout=None, source_address=None) -> socket.socket:
        error: OSError | None = None
        for ip in addresses:
            try:
                sock = socket.create_connection((ip, dial_port), timeout=watch.left())
            except OSError as e:
                error = e
                continue
            watch.watch(sock)
            sock.settimeout(watch.left())
            return sock
        raise error or OSError("no address to connect to")

    connection._create_connection = dial  # http.client's hook for opening the socket
    return connection


# -- Decoding -------------------------------------------------------------------------------

def _decode(data: bytes, max_pixels: int) -> LoadedImage:
    try:
        source = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise MediaError("image_too_large", f"{e}; resize the image") from None
    except UnidentifiedImageError:
        raise _unidentified(data) from None
    except Exception:  # a damaged header PIL did not foresee
        raise _corrupt(None) from None
    with source:
        width, height = source.size
        if width * height > max_pixels:
            raise MediaError("image_too_large", f"the image is {width}x{height} = "
                             f"{width * height / 1e6:.1f} Mpx, over the {max_pixels / 1e6:g} Mpx "
                             "limit; resize it")
        try:
            source.load()
            image = _to_rgb(ImageOps.exif_transpose(source))
        except Image.DecompressionBombError as e:
            raise MediaError("image_too_large", f"{e}; resize the image") from None
        except Exception:  # truncated or damaged data: PIL raises many kinds
            raise _corrupt(source.format) from None
    width, height = image.size
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(image.tobytes())
    return LoadedImage(image, width, height, digest.hexdigest())


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent areas become white, as they look on a page, not black."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def _unidentified(data: bytes) -> MediaError:
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return _corrupt(name)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _corrupt("WEBP")
    # Neither its size nor its first bytes: the data may be a secret that is no image.
    return MediaError("unsupported_image", f"the data is not a {', '.join(FORMATS)} image; "
                      "check that it points to an image file")


def _corrupt(kind: str | None) -> MediaError:
    """Without the decoder's own message: it may quote bytes of the data."""
    what = f"the {kind} image" if kind else "the image"
    return MediaError("corrupt_image", f"{what} is damaged or truncated and could not be "
                      "decoded; re-export the image")


def _too_large(size: int, max_bytes: int, at_least: bool = False) -> MediaError:
    return MediaError("image_too_large", f"the image is {'at least ' * at_least}"
                      f"{size / 1e6:.1f} MB, over the {max_bytes / 1e6:g} MB limit; resize or "
                      "recompress it")
