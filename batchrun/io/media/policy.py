"""What a row's image references may reach (rows are untrusted): the folders local files may be
read from, whether URLs may reach private addresses, and the deadline for each image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MEDIA_TIMEOUT = 30.0  # seconds one image may take: name lookup, connect, every read, redirects


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
