"""MediaError: a row's image could not be used. Every failure of a reference (missing file, no
network, not an image, truncated, too large) is one, with a code and a message that starts with
the row's field; nothing else escapes.
"""

from __future__ import annotations


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


def read_bounded(read, max_bytes: int) -> bytes:
    """Everything `read(n)` gives (n: bytes still allowed, plus one) until it gives nothing;
    MediaError once past `max_bytes`, never holding more than one byte over it."""
    chunks = []
    size = 0
    while size <= max_bytes:
        chunk = read(max_bytes + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > max_bytes:
        raise _too_large(size, max_bytes)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int, at_least: bool = False) -> MediaError:
    return MediaError("image_too_large", f"the image is {'at least ' * at_least}"
                      f"{size / 1e6:.1f} MB, over the {max_bytes / 1e6:g} MB limit; resize or "
                      "recompress it")
