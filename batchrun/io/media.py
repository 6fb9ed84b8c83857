"""Load the images that rows reference; bad media is a MediaError that names the row's field.

A reference is a local path (relative to the input file's folder), a file:// URL, a data: URI,
an http(s) URL, raw bytes, or a {bytes, path} dict as HF datasets writes to Parquet. Every
failure - missing file, no network, not an image, truncated, too large - raises MediaError with
a code and a message that starts with the field; nothing else escapes. A LoadedImage is fully
decoded RGB with its EXIF orientation applied, and its digest depends only on its pixels.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import socket
import stat
import threading
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from PIL import Image, ImageOps, UnidentifiedImageError

MAX_BYTES = 20 * 1024 * 1024  # encoded size of one image
MAX_PIXELS = 50_000_000  # width * height of one image, checked before decoding
FETCH_TIMEOUT = 2.0  # seconds for each network step: an offline machine must fail rows fast
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
class _Source:
    kind: str  # "bytes", "file" or "url"
    value: Any  # bytes, a resolved Path, or the URL


def load_image(ref: str | bytes | dict, base_dir: Path, field: str, *,
               max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS,
               timeout: float = FETCH_TIMEOUT) -> LoadedImage:
    """Load and decode one image reference; raises MediaError naming `field`."""
    try:
        source = _locate(ref, Path(base_dir), max_bytes)
        return _decode(_read(source, max_bytes, timeout), max_pixels)
    except MediaError as e:
        raise e.at(field) from None


class ImageCache:
    """load_image with an LRU of decoded images keyed by content, so a picture that many rows
    share is read and decoded once. Failures keyed the same way are remembered, so a repeated
    bad image (or an unreachable URL) fails at once."""

    def __init__(self, max_entries: int = CACHE_ENTRIES, max_cached_bytes: int = CACHE_BYTES, *,
                 max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS,
                 timeout: float = FETCH_TIMEOUT):
        self.max_entries = max_entries
        self.max_cached_bytes = max_cached_bytes
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        self.timeout = timeout
        self.hits = 0  # lookups answered from the cache, image or remembered failure
        self.misses = 0  # lookups that had to read and decode
        self.cached_bytes = 0
        self._images: OrderedDict[tuple, LoadedImage] = OrderedDict()
        self._failures: OrderedDict[tuple, MediaError] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._images)

    def load(self, ref: str | bytes | dict, base_dir: Path, field: str) -> LoadedImage:
        """As load_image, through the cache."""
        try:
            source = _locate(ref, Path(base_dir), self.max_bytes)
            key = self._key(source)
            found = self._lookup(key)
            if found is not None:
                return found
            try:
                loaded = _decode(_read(source, self.max_bytes, self.timeout), self.max_pixels)
            except MediaError as e:
                self._remember(self._failures, key, e)
                raise
            self._store(key, loaded)
            return loaded
        except MediaError as e:
            raise e.at(field) from None

    def _key(self, source: _Source) -> tuple:
        if source.kind == "file":
            st = _stat_file(source.value, self.max_bytes)
            return ("file", str(source.value), st.st_mtime_ns, st.st_size)
        if source.kind == "url":
            return ("url", source.value)
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

def _locate(ref: Any, base_dir: Path, max_bytes: int) -> _Source:
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
        return _Source("file", _file_url_path(url))
    if "://" in url:
        raise MediaError("invalid_image_url", f"unsupported URL scheme {scheme + '://'!r}; "
                         f"give {_SCHEMES}")
    path = Path(url)
    return _Source("file", (path if path.is_absolute() else base_dir / path).resolve())


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
    if "base64" not in params[1:]:
        data = unquote_to_bytes(payload)
    else:
        payload = "".join(unquote(payload).split()).translate(_URLSAFE)
        if len(payload) * 3 // 4 > max_bytes:
            raise _too_large(len(payload) * 3 // 4, max_bytes)
        try:
            data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError("invalid_image_url", f"the data URI is not valid base64 ({e}); "
                             "re-encode the image with standard base64") from None
    if not data:
        raise MediaError("invalid_image_url", "the data URI holds no data")
    return data


_URLSAFE = str.maketrans("-_", "+/")


def _file_url_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("invalid_image_url", f"{url!r} names host {parts.netloc!r}; a file URL "
                         "needs an absolute path: file:///abs/path.png")
    return Path(urllib.request.url2pathname(parts.path)).resolve()


def _read(source: _Source, max_bytes: int, timeout: float) -> bytes:
    if source.kind == "file":
        return _read_file(source.value, max_bytes)
    if source.kind == "url":
        return _fetch(source.value, max_bytes, timeout)
    if len(source.value) > max_bytes:
        raise _too_large(len(source.value), max_bytes)
    return source.value


def _stat_file(path: Path, max_bytes: int) -> os.stat_result:
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise MediaError("image_not_found", f"file not found: {path} (relative paths resolve "
                         "against the input file's folder)") from None
    except OSError as e:
        raise MediaError("image_not_found", f"cannot read {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise MediaError("image_not_found", f"{path} is a folder, not an image file")
    if st.st_size > max_bytes:
        raise _too_large(st.st_size, max_bytes)
    return st


def _read_file(path: Path, max_bytes: int) -> bytes:
    _stat_file(path, max_bytes)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise MediaError("image_not_found", f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes)
    return data


def _fetch(url: str, max_bytes: int, timeout: float) -> bytes:
    fix = "download the image and reference it by local path or data URI"
    try:
        host, port = _connect_host(url)
    except ValueError as e:
        raise MediaError("invalid_image_url", f"{url!r} is not a valid URL ({e})") from None
    problem = _resolve(host, port, timeout)
    if problem:
        raise MediaError("image_unreachable", f"cannot fetch {url}: {problem}; {fix}")
    request = urllib.request.Request(url, headers={"User-Agent": "batchrun"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise _too_large(int(length), max_bytes)
            data = response.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise MediaError("image_unreachable", f"cannot fetch {url}: HTTP {e.code} {e.reason}; "
                         f"check the URL or {fix}") from None
    except urllib.error.URLError as e:
        raise MediaError("image_unreachable", f"cannot fetch {url}: {e.reason}; {fix}") from None
    except (OSError, HTTPException, ValueError) as e:  # timeouts, resets, TLS, bad replies
        raise MediaError("image_unreachable", f"cannot fetch {url}: {e or type(e).__name__}; "
                         f"{fix}") from None
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes)
    return data


def _connect_host(url: str) -> tuple[str, int]:
    """The host urllib will connect to: the URL's, or its proxy's."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError("no host")
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    default = 443 if parts.scheme == "https" else 80
    return parts.hostname or "", parts.port or default


def _resolve(host: str, port: int, timeout: float) -> str | None:
    """Why `host` does not resolve within `timeout`, or None. Name lookups ignore socket
    timeouts and can hang for many seconds offline, so they run on a thread we stop waiting for.
    """
    done = threading.Event()
    failure: list[str] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            failure.append(f"cannot resolve {host} ({e})")
        finally:
            done.set()

    threading.Thread(target=lookup, name="batchrun-resolve", daemon=True).start()
    if not done.wait(timeout):
        return f"resolving {host} took over {timeout:g} s (is this machine offline?)"
    return failure[0] if failure else None


# -- Decoding -------------------------------------------------------------------------------

def _decode(data: bytes, max_pixels: int) -> LoadedImage:
    try:
        source = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise MediaError("image_too_large", f"{e}; resize the image") from None
    except UnidentifiedImageError:
        raise _unidentified(data) from None
    except Exception as e:  # a damaged header PIL did not foresee
        raise _corrupt(None, e) from None
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
        except Exception as e:  # truncated or damaged data: PIL raises many kinds
            raise _corrupt(source.format, e) from None
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
            return _corrupt(name, "its header could not be read")
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _corrupt("WEBP", "its header could not be read")
    return MediaError("unsupported_image", f"the data ({len(data)} bytes, starting "
                      f"{data[:8]!r}) is not a {', '.join(FORMATS)} image; check that it "
                      "points to an image file")


def _corrupt(kind: str | None, error: Any) -> MediaError:
    what = f"the {kind} image" if kind else "the image"
    return MediaError("corrupt_image", f"{what} is damaged or truncated and could not be "
                      f"decoded ({error}); re-export the image")


def _too_large(size: int, max_bytes: int) -> MediaError:
    return MediaError("image_too_large", f"the image is {size / 1e6:.1f} MB, over the "
                      f"{max_bytes / 1e6:g} MB limit; resize or recompress it")
