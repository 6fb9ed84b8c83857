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

The parts: load.py (load_image and the ImageCache: a reference located, read and decoded),
local.py (local paths and the walk that follows no link), data_uri.py, fetch.py (http(s) URLs:
the address guard and the deadline), decode.py (the formats and the decoding), messages.py (the
images in chat messages), policy.py (MediaPolicy) and errors.py (MediaError).
"""

from batchrun.io.media.decode import FORMATS, LoadedImage
from batchrun.io.media.errors import MediaError
from batchrun.io.media.fetch import MAX_REDIRECTS, address_problem
from batchrun.io.media.load import (
    CACHE_BYTES,
    CACHE_ENTRIES,
    MAX_BYTES,
    MAX_PIXELS,
    ImageCache,
    load_image,
)
from batchrun.io.media.messages import check_image_count, count_images, image_parts
from batchrun.io.media.policy import DEFAULT_POLICY, MEDIA_TIMEOUT, MediaPolicy

__all__ = ["CACHE_BYTES", "CACHE_ENTRIES", "DEFAULT_POLICY", "FORMATS", "MAX_BYTES",
           "MAX_PIXELS", "MAX_REDIRECTS", "MEDIA_TIMEOUT", "ImageCache", "LoadedImage",
           "MediaError", "MediaPolicy", "address_problem", "check_image_count", "count_images",
           "image_parts", "load_image"]
