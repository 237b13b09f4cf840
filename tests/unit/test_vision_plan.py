"""Vision patch buckets planned from image sizes (bucketing/vision.py, the CLI)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tools import tiny_model_specs as specs
from vllm_hpu_mm.bucketing.vision import (
    PatchGeometry,
    doubling_buckets,
    padding_patches,
    plan_vision_buckets,
)
from vllm_hpu_mm.cli.main import main

GEOMETRY = PatchGeometry(
    patch_size=specs.QWEN_PATCH_SIZE,
    merge_size=specs.QWEN_MERGE_SIZE,
    min_pixels=specs.QWEN_MIN_PIXELS,
    max_pixels=specs.QWEN_MAX_PIXELS,
)


@pytest.mark.parametrize(
    "size", [(40, 24), (24, 56), (100, 30), (16, 16), (300, 7), (90, 90)]
)
def test_patches_equal_the_processors_grid(size: tuple[int, int]) -> None:
    # The oracle: transformers' own PIL image processor at the tiny model's settings.
    processor = specs.qwen_image_processor()
    image = Image.new("RGB", size, (120, 30, 200))
    grid = processor(images=[image], return_tensors="np")["image_grid_thw"][0]
    assert GEOMETRY.patches(*size) == int(np.prod(grid))


def test_geometry_from_the_saved_config() -> None:
    config = {
        "image_processor": {
            "patch_size": 14,
            "merge_size": 2,
            "size": {"shortest_edge": 3136, "longest_edge": 12845056},
        }
    }
    g = PatchGeometry.from_processor_config(config)
    assert (g.patch_size, g.merge_size, g.unit) == (14, 2, 4)
    assert g.max_patches == 12845056 // 28**2 * 4
    with pytest.raises(ValueError, match="patch_size"):
        PatchGeometry.from_processor_config({"image_processor": {"merge_size": 2}})


def test_plan_beats_doubling_and_fits_everything() -> None:
    rng = random.Random(0)
    sizes = [(rng.randint(8, 120), rng.randint(8, 120)) for _ in range(200)]
    counts = [GEOMETRY.patches(w, h) for w, h in sizes]
    for k in (1, 2, 4, 6):
        planned = plan_vision_buckets(counts, GEOMETRY, k)
        assert len(planned) <= k
        assert planned[-1] == GEOMETRY.max_patches  # every image fits
        assert all(b % GEOMETRY.unit == 0 for b in planned)
        pad, misses = padding_patches(counts, planned)
        assert misses == 0
        default = doubling_buckets(GEOMETRY, 16)
        if k >= len(default):
            assert pad <= padding_patches(counts, default)[0]
    # Buckets at every distinct size pad nothing.
    distinct = sorted(set(counts) | {GEOMETRY.max_patches})
    assert padding_patches(counts, distinct) == (0, 0)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A checkpoint folder holding only the image processor settings."""
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "patch_size": GEOMETRY.patch_size,
        "merge_size": GEOMETRY.merge_size,
        "size": {
            "shortest_edge": GEOMETRY.min_pixels,
            "longest_edge": GEOMETRY.max_pixels,
        },
    }
    (model / "processor_config.json").write_text(
        json.dumps({"image_processor": config})
    )
    return model


def test_cli_writes_the_bucket_line(tmp_path: Path, model_dir: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    sizes = [(40, 24), (64, 48), (16, 16)]
    for i, size in enumerate(sizes):
        Image.new("RGB", size).save(images / f"{i}.png")
    out = tmp_path / "vision.yaml"
    argv = [
        "buckets",
        "plan-vision",
        "--model",
        str(model_dir),
        "--images",
        str(images),
    ]
    assert main([*argv, "--max-buckets", "4", "--out", str(out)]) == 0
    line = [x for x in out.read_text().splitlines() if x.startswith("vision_patches")]
    counts = sorted(GEOMETRY.patches(w, h) for w, h in sizes)
    assert line == [f"vision_patches: [{', '.join(map(str, counts))}, 256]"]


def test_cli_bad_input(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps(["40x24", "forty"]))
    out = ["--out", str(tmp_path / "o.yaml")]
    argv = ["buckets", "plan-vision", "--images", str(sizes), *out]
    assert main([*argv, "--model", str(model_dir)]) == 1
    assert (
        "item 1: 'forty' is not an image ([width, height], 'WxH'"
        in capsys.readouterr().err
    )
    assert main([*argv, "--model", str(tmp_path)]) == 1
    assert "no processor_config.json" in capsys.readouterr().err
