"""data: URIs. A URI over the byte limit is refused before it is decoded: its length alone, or
its percent escapes decoded a slice at a time, shows it too large; a huge URI is never decoded
whole.
"""

from __future__ import annotations

import base64
import binascii
from urllib.parse import unquote_to_bytes

from batchrun.io.media.errors import MediaError, _too_large


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
