"""One image's bytes checked before any model sees them (issue 43): an image the decoder takes, its
dimensions within bounds, read from its header before a pixel is decoded, and whole.

Pillow reads the format and dimensions from the header alone, so a decompression bomb (a 50 kB PNG
that declares 100000x100000 pixels: 40 GB once decoded) is refused unopened. What passes is then
decoded once here, in the request's worker thread: a truncated or damaged file is the client's
400 naming its field, not a failure inside the engine worker in the middle of a batch.

The engine decodes with llama.cpp's mtmd helper (stb_image), which reads PNG, JPEG, GIF and BMP
but not WebP, which browsers paste: a WebP is re-encoded as PNG here, so every format we accept is
one the engine reads.
"""

from __future__ import annotations

import hashlib
import io

from PIL import Image, UnidentifiedImageError

from ..errors import InvalidRequestError
from ..protocol.media import ImageInput

# Pillow's format name -> ours; the formats stb_image (the engine's decoder) reads, and WebP.
FORMATS = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif", "BMP": "bmp", "WEBP": "webp"}
ENGINE_READS = ("png", "jpeg", "gif", "bmp")
TAKEN = "PNG, JPEG, GIF, BMP or WebP"


def refused(param: str, problem: str) -> InvalidRequestError:
    """The 400 of every image check: `'<param>' <problem>`, naming the field."""
    return InvalidRequestError(f"'{param}' {problem}", param=param)


def _too_many_pixels(param: str, size: str, max_pixels: int) -> InvalidRequestError:
    return refused(param, f"declares {size} pixels, more than the {max_pixels} one image may have "
                           "(setting max_image_pixels)")


def _opened(data: bytes, param: str, max_pixels: int) -> Image.Image:
    """The image with its header read (no pixels decoded); a file no decoder knows is refused."""
    try:
        return Image.open(io.BytesIO(data), formats=list(FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own bounds (a warning past ~89M pixels, an error past ~179M), met in the header;
        # the warning is an exception only where warnings are errors (the tests).
        raise _too_many_pixels(param, "more", max_pixels) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise refused(param, f"is not an image this server reads ({TAKEN})") from None


def check_image(data: bytes, param: str, *, max_pixels: int) -> ImageInput:
    """`data` as an ImageInput, or a 400 naming `param`: empty, not an image, a format refused,
    more than `max_pixels` pixels (from the header, before decoding), or damaged/truncated."""
    if not data:
        raise refused(param, "is empty")
    image = _opened(data, param, max_pixels)
    kind = FORMATS.get(image.format or "")
    if kind is None:
        raise refused(param, f"is a {image.format} image; this server reads {TAKEN}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise refused(param, f"declares an empty image ({width}x{height})")
    if width * height > max_pixels:
        raise _too_many_pixels(param, f"{width}x{height}", max_pixels)
    try:
        image.verify()  # chunk checksums and the end of the file where the format has them (PNG)
        image = _opened(data, param, max_pixels)  # verify() leaves the image unusable: open it again to decode
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        # "image file is truncated", "broken PNG file", a bad Huffman table...: the decoder's words.
        raise refused(param, f"is a damaged or truncated {kind.upper()} file ({str(e)[:80]})") from None
    if kind not in ENGINE_READS:
        data, kind = _as_png(image), "png"
    return ImageInput(data=data, sha256=hashlib.sha256(data).hexdigest(), width=width, height=height, format=kind)


def _as_png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
