"""Decoding: the bytes of an image become a LoadedImage, fully decoded RGB with its EXIF
orientation applied, whose digest depends only on its pixels. Only the formats in FORMATS are
opened, the pixel count is checked before decoding, and no message quotes the data (it may be
a secret that is no image).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field

from PIL import Image, ImageOps, UnidentifiedImageError

from batchrun.io.media.errors import MediaError

# Formats a row may use. Others PIL can open (EPS runs Ghostscript, say) are not worth the risk.
_WANTED = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
Image.init()
FORMATS = tuple(f for f in _WANTED if f in Image.ID)
# Signatures of those formats: data that starts like one but fails to open is corrupt, not
# unsupported.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"),
          (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))


@dataclass(frozen=True, slots=True)
class LoadedImage:
    image: Image.Image = field(compare=False, repr=False)  # RGB, fully loaded, upright
    width: int
    height: int
    digest: str  # sha256 of the size and RGB pixels: equal pictures, equal digests

    @property
    def nbytes(self) -> int:
        return self.width * self.height * 3


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
