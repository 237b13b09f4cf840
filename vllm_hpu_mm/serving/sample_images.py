"""Encoded image bytes for reliability tests and the soak script.

Unusual but valid images (grayscale, CMYK, 16-bit, palette with alpha,
animated GIF, EXIF orientation) and malformed ones (truncated, zero-size,
decompression bombs whose header claims huge dimensions, formats that are not
raster images). Everything is made in memory with Pillow; nothing is read
from disk or the network.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def gradient_rgb(width: int = 40, height: int = 24, variant: int = 0) -> Image.Image:
    """A deterministic RGB gradient of ``width`` x ``height``."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)
    rgb = np.stack([(x + 37 * variant) % 256, y, 255 - (x + y) / 2], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), mode="RGB")


def encode(image: Image.Image, fmt: str = "PNG", **save_kwargs: object) -> bytes:
    """``image`` saved in format ``fmt``."""
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    """``data:<media_type>;base64,...`` for an OpenAI ``image_url`` part."""
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


# --- unusual but valid ------------------------------------------------------------


def grayscale_png() -> bytes:
    return encode(gradient_rgb(40, 24).convert("L"))


def cmyk_jpeg() -> bytes:
    return encode(gradient_rgb(40, 24).convert("CMYK"), "JPEG", quality=95)


def gray16_png() -> bytes:
    """A 16-bit grayscale PNG (mode ``I;16``) using the full 0..65535 range."""
    ramp = np.linspace(0, 65535, 40 * 24, dtype=np.uint16).reshape(24, 40)
    return encode(Image.fromarray(ramp))  # uint16 -> mode I;16


def palette_alpha_png() -> bytes:
    """A palette PNG whose palette index 0 is transparent (a tRNS chunk)."""
    image = gradient_rgb(40, 24).quantize(colors=16)
    return encode(image, transparency=0)


def animated_gif(frames: int = 3) -> bytes:
    images = [
        gradient_rgb(40, 24, variant=v).quantize(colors=32) for v in range(frames)
    ]
    return encode(images[0], "GIF", save_all=True, append_images=images[1:], loop=0)


def exif_rotated_jpeg(orientation: int = 6) -> bytes:
    """A 40x24 JPEG with an EXIF orientation tag (6: display rotated 90 degrees)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(gradient_rgb(40, 24), "JPEG", quality=95, exif=exif.tobytes())


def unusual_valid() -> dict[str, tuple[str, bytes]]:
    """Every unusual-but-valid sample: name -> (media type, bytes)."""
    return {
        "grayscale": ("image/png", grayscale_png()),
        "cmyk-jpeg": ("image/jpeg", cmyk_jpeg()),
        "16-bit": ("image/png", gray16_png()),
        "palette-alpha": ("image/png", palette_alpha_png()),
        "animated-gif": ("image/gif", animated_gif()),
        "exif-rotated": ("image/jpeg", exif_rotated_jpeg()),
    }


# --- malformed ----------------------------------------------------------------------


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(kind + body) & 0xFFFFFFFF
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def png_with_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` (8-bit RGB) followed by a
    tiny compressed IDAT: a few hundred bytes that would decode to
    ``3 * width * height`` bytes (a decompression bomb when both are large).
    Width or height 0 makes a zero-size image."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def gif_with_header(width: int, height: int) -> bytes:
    """A GIF whose logical screen and single frame claim ``width`` x ``height``."""
    screen = struct.pack("<HHBBB", width, height, 0x80, 0, 0)
    palette = b"\x00\x00\x00\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
    data = b"\x02\x02\x44\x01\x00"  # LZW min code size 2, one tiny block
    return b"GIF89a" + screen + palette + frame + data + b"\x3b"


def truncated_png() -> bytes:
    data = encode(gradient_rgb(64, 48))
    return data[: len(data) // 2]


SVG = (
    b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" '
    b'width="10" height="10"><rect width="10" height="10"/></svg>'
)
PDF = b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF\n"
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
