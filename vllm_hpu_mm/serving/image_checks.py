"""Image checks that run in the API server, before and after decoding.

- ``read_header``: opens the bytes lazily (Pillow reads the header only, no
  pixel is decoded) and refuses empty data, formats outside vLLM's allow-list
  (naming what the bytes really are when it can tell: SVG, PDF, PostScript,
  HEIC...), zero-size images and images over vLLM's pixel limit
  (``VLLM_MAX_IMAGE_PIXELS``; 0 or less: no limit, as in vLLM): a decompression
  bomb of a few hundred bytes that claims 100000 x 100000 pixels is refused here.
  vLLM's own ``ImageMediaIO`` checks the same limit, but raises a ``ValueError``
  that becomes a bare "Failed to load image"; this names the size and the limit.
- ``to_rgb``: the RGB image the model sees: the first frame of an animation,
  16-bit and float greyscale scaled to 8 bits (Pillow's own conversion clips
  them to white), transparency composited over a background, CMYK, palette
  and greyscale converted.

Pure Pillow and numpy; the vLLM glue lives in ``media.py``.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image
from vllm.multimodal.image import ALLOWED_IMAGE_FORMATS, convert_image_mode

from vllm_hpu_mm.serving.errors import RequestRejected

LIMIT_KEY = "VLLM_MAX_IMAGE_PIXELS"  # vLLM's own limit (vllm.envs)

# Leading bytes of formats that are not raster images vLLM decodes, so that the
# message can say what was sent instead of "cannot identify image file".
_KNOWN_OTHER = (
    (b"%PDF", "a PDF document"),
    (b"%!PS", "PostScript/EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"<svg", "an SVG (vector) image"),
    (b"<?xml", "an XML document (SVG?)"),
    (b"PK\x03\x04", "a ZIP archive"),
    (b"\x1f\x8b", "gzip data"),
    (b"{", "JSON or text"),
)
_HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"mif1", b"msf1")


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """What an image's header says, read without decoding its pixels."""

    format: str  # Pillow's format name: "PNG", "JPEG", "GIF", ...
    width: int
    height: int
    mode: str  # Pillow's mode: "RGB", "L", "I;16", "CMYK", "P", ...

    @property
    def pixels(self) -> int:
        return self.width * self.height


def describe_bytes(data: bytes) -> str:
    """A guess at what non-image bytes are, for error messages."""
    head = data[:64].lstrip()
    if head.lower().startswith((b"<!doctype html", b"<html")):
        return "an HTML page"
    for magic, name in _KNOWN_OTHER:
        if head.startswith(magic):
            return name
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        return "a HEIC/HEIF image (not supported)"
    return f"{len(data)} bytes starting {data[:8]!r}"


def _zero_size_claim(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG or GIF header that claims a zero size.

    Pillow refuses to open such files and says only "cannot identify image
    file"; this names the real problem."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
        w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    elif data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    else:
        return None
    return (w, h) if w == 0 or h == 0 else None


def read_header(data: bytes, max_pixels: int) -> ImageHeader:
    """The header of ``data``, or ``RequestRejected`` naming what is wrong.

    No pixel is decoded: Pillow's ``Image.open`` is lazy."""
    if not data:
        raise RequestRejected("image is empty (0 bytes)", parameter="image_url")
    zero = _zero_size_claim(data)
    if zero is not None:
        raise RequestRejected(
            f"image has zero size ({zero[0]}x{zero[1]} pixels)", parameter="image_url"
        )
    try:
        with warnings.catch_warnings():
            # Pillow warns above its own limit; ours is checked just below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:  # over Pillow's own hard limit
        raise RequestRejected(
            f"image is too large: {exc} ({LIMIT_KEY} is {max_pixels}).",
            parameter="image_url",
        ) from None
    except (Image.UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise RequestRejected(
            f"image bytes are not a supported image format: {describe_bytes(data)} "
            f"({exc.__class__.__name__}); supported: PNG, JPEG, GIF, WEBP, BMP, "
            "TIFF and the other raster formats vLLM allows",
            parameter="image_url",
        ) from None
    with image:
        header = ImageHeader(image.format or "?", image.width, image.height, image.mode)
    if header.width <= 0 or header.height <= 0:
        raise RequestRejected(
            f"image has zero size ({header.width}x{header.height} pixels)",
            parameter="image_url",
        )
    if 0 < max_pixels < header.pixels:
        raise RequestRejected(
            f"image is too large: its {header.format} header says "
            f"{header.width}x{header.height} = {header.pixels} pixels, over the limit "
            f"of {max_pixels} ({LIMIT_KEY}); nothing was decoded",
            parameter="image_url",
        )
    return header


_HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def _to_8bit_gray(image: Image.Image) -> Image.Image:
    """16-bit, 32-bit integer or float greyscale as 8-bit 'L', by scaling.

    Integer images are read as 16-bit (0..65535, the depth PNG and TIFF carry);
    float images as 0..1 when they fit, else 0..255."""
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        scale = 255.0 if values.size and values.max() <= 1.0 else 1.0
    else:
        scale = 255.0 / 65535.0
    out = np.clip(np.rint(values * scale), 0, 255).astype(np.uint8)
    return Image.fromarray(out)


def to_rgb(
    image: Image.Image, background: tuple[int, int, int] = (255, 255, 255)
) -> Image.Image:
    """The RGB image the model is given (see the module docstring)."""
    if getattr(image, "is_animated", False):
        image.seek(0)
    if image.mode in _HIGH_DEPTH_MODES:
        image = _to_8bit_gray(image)
    return convert_image_mode(image, "RGB", background)
