"""The API-server image checks: header-only limits, named errors, RGB conversion."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from vllm_hpu_mm.serving import sample_images as s
from vllm_hpu_mm.serving.errors import RequestRejected
from vllm_hpu_mm.serving.image_checks import read_header, to_rgb
from vllm_hpu_mm.serving.media import CheckedImageMediaIO

LIMIT = 4096 * 4096


def rejected(data: bytes, limit: int = LIMIT) -> str:
    with pytest.raises(RequestRejected) as info:
        read_header(data, limit)
    assert info.value.parameter == "image_url"
    return str(info.value)


def test_valid_header_is_read_without_decoding() -> None:
    header = read_header(s.png_with_header(300, 200), LIMIT)
    assert (header.format, header.width, header.height) == ("PNG", 300, 200)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "empty"),
        (s.png_with_header(0, 10), "zero size (0x10"),
        (s.gif_with_header(7, 0), "zero size (7x0"),
        (s.SVG, "SVG"),
        (s.PDF, "PDF"),
        (s.EPS, "PostScript"),
        (b"not an image at all", "not a supported image format"),
    ],
    ids=["empty", "zero-png", "zero-gif", "svg", "pdf", "eps", "text"],
)
def test_bad_bytes_are_named(data: bytes, words: str) -> None:
    assert words in rejected(data)


def test_bomb_over_the_limit_is_refused_from_the_header() -> None:
    data = s.png_with_header(12000, 12000)  # 144 M pixels in ~100 bytes
    assert len(data) < 200
    message = rejected(data)
    assert "12000x12000 = 144000000 pixels" in message
    assert "VLLM_MAX_IMAGE_PIXELS" in message


def test_bomb_over_pillows_own_limit_is_refused_not_raised() -> None:
    message = rejected(s.png_with_header(100_000, 100_000))
    assert "too large" in message and "10000000000" in message


def test_limit_is_the_configured_one() -> None:
    data = s.png_with_header(101, 100)
    assert read_header(data, 101 * 100).pixels == 10100
    assert "over the limit of 10099" in rejected(data, 101 * 100 - 1)


def test_zero_limit_means_none_as_in_vllm() -> None:
    assert read_header(s.png_with_header(12000, 12000), 0).pixels == 144_000_000


def test_16_bit_is_scaled_not_clipped() -> None:
    image = Image.open(io.BytesIO(s.gray16_png()))
    assert image.mode == "I;16"
    rgb = np.asarray(to_rgb(image))
    raw = np.asarray(image).astype(np.float64)
    assert rgb.shape == (24, 40, 3)
    np.testing.assert_array_equal(rgb[..., 0], np.rint(raw * 255 / 65535))
    assert (rgb == 255).mean() < 0.01  # Pillow's convert("RGB") gives ~100 %


@pytest.mark.parametrize("name", list(s.unusual_valid()))
def test_unusual_images_become_rgb(name: str) -> None:
    _, data = s.unusual_valid()[name]
    image = to_rgb(Image.open(io.BytesIO(data)))
    assert image.mode == "RGB"
    assert image.size == (40, 24)


def test_palette_transparency_goes_over_the_background() -> None:
    image = Image.open(io.BytesIO(s.palette_alpha_png()))
    transparent = np.asarray(image) == 0
    assert transparent.any()
    rgb = np.asarray(to_rgb(image, (1, 2, 3)))
    assert (rgb[transparent] == (1, 2, 3)).all()


def test_animated_gif_gives_its_first_frame() -> None:
    image = Image.open(io.BytesIO(s.animated_gif()))
    assert image.n_frames == 3
    image.seek(2)
    first = Image.open(io.BytesIO(s.animated_gif())).convert("RGB")
    assert to_rgb(image).tobytes() == first.tobytes()


def test_media_io_checks_before_vllm_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", str(100 * 100))  # vLLM's own limit
    io_ = CheckedImageMediaIO()
    assert io_.load_bytes(s.encode(s.gradient_rgb(10, 10))).media.size == (10, 10)
    with pytest.raises(RequestRejected, match="over the limit of 10000"):
        io_.load_bytes(s.png_with_header(101, 100))


def test_media_io_names_a_truncated_file() -> None:
    io_ = CheckedImageMediaIO()
    with pytest.raises(RequestRejected, match=r"PNG image \(64x48\) cannot be decoded"):
        io_.load_bytes(s.truncated_png())


def test_media_io_applies_exif_orientation_and_16_bit_scaling() -> None:
    io_ = CheckedImageMediaIO()
    assert io_.load_bytes(s.exif_rotated_jpeg()).media.size == (24, 40)
    rgb = np.asarray(io_.load_bytes(s.gray16_png()).media)
    assert (rgb == 255).mean() < 0.01
