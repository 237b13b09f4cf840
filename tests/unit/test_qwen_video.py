"""The torchvision-free Qwen video processors against transformers' own
``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor`` classes, run with the CPU
stand-in of the three torchvision functions they call
(``tests/fakes/torchvision_cpu.py``): frame sampling, smart resize, the
per-frame pixel cap, normalization and patchify are transformers' code; the
processor's output (pixel values, grids, sampled frame indices) and the prompt
ids transformers' Qwen processors expand from it must be identical."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from transformers.video_utils import VideoMetadata

from tests.fakes import torchvision_cpu
from tests.qwen_reference import tiny_qwen_dir
from vllm_hpu_mm.models.qwen_processor import QWEN_VIDEO_PROMPT, load_processor
from vllm_hpu_mm.models.qwen_video import (
    VIDEO_PROCESSORS,
    QwenVideoProcessor,
    config_from_dict,
    saved_video_processor_dict,
)

MODELS = {"qwen2": "tiny-qwen2_5-vl", "qwen3": "tiny-qwen3-vl"}
# The keys of a saved processor dict that the transformers classes take.
HF_KEYS = (
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "size",
    "image_mean",
    "image_std",
    "resample",
    "rescale_factor",
)


def clip(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth moving gradient plus noise: [frames, H, W, 3] uint8."""
    rng = np.random.default_rng(seed)
    t, y, x = np.meshgrid(
        np.arange(frames), np.arange(height), np.arange(width), indexing="ij"
    )
    base = np.stack([(x * 5 + t * 9) % 256, (y * 7) % 256, (x + y + t * 3) % 256], -1)
    noise = rng.integers(0, 40, base.shape)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


@pytest.fixture
def hf_classes(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    torchvision_cpu.installed(monkeypatch)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import (
        Qwen2VLVideoProcessor,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
    )

    return {"qwen2": Qwen2VLVideoProcessor, "qwen3": Qwen3VLVideoProcessor}


def _pair(
    hf_classes: dict[str, Any], family: str, tiny: bool, **settings: Any
) -> tuple[Any, QwenVideoProcessor]:
    raw: dict[str, Any] = {}
    if tiny:
        saved = saved_video_processor_dict(tiny_qwen_dir(MODELS[family]))
        raw = {k: saved[k] for k in HF_KEYS if k in saved}
    raw.update(settings)
    ours = VIDEO_PROCESSORS[family](config_from_dict(family, raw))  # type: ignore[arg-type]
    return hf_classes[family](**raw), ours


def _assert_same(hf_out: Any, our_out: Any) -> None:
    assert our_out["video_grid_thw"].tolist() == hf_out["video_grid_thw"].tolist()
    assert our_out["pixel_values_videos"].dtype == torch.float32
    torch.testing.assert_close(
        our_out["pixel_values_videos"], hf_out["pixel_values_videos"], rtol=0, atol=0
    )
    if "video_metadata" in hf_out:
        for ours, theirs in zip(
            our_out["video_metadata"], hf_out["video_metadata"], strict=True
        ):
            assert list(ours.frames_indices) == list(theirs.frames_indices)


CASES = [
    # (family, tiny settings, clips (frames, H, W), call kwargs)
    ("qwen2", True, [(5, 30, 44)], {}),
    ("qwen2", True, [(12, 40, 24), (4, 20, 20)], {"do_sample_frames": True, "fps": 2}),
    ("qwen2", False, [(9, 48, 64)], {"do_sample_frames": True, "num_frames": 4}),
    ("qwen2", False, [(16, 56, 40)], {"cap_pixels_per_frame": True}),
    ("qwen3", True, [(9, 30, 44)], {}),
    ("qwen3", True, [(20, 30, 44)], {}),  # 20 / 6 fps * 2 fps = 6.67 frames
    ("qwen3", True, [(24, 44, 30), (5, 20, 36)], {"num_frames": 6, "fps": None}),
    ("qwen3", False, [(10, 64, 48)], {"cap_pixels_per_frame": True}),
]


@pytest.mark.parametrize(("family", "tiny", "shapes", "kwargs"), CASES)
def test_video_processor_matches_transformers(
    hf_classes: dict[str, Any],
    family: str,
    tiny: bool,
    shapes: list[tuple[int, int, int]],
    kwargs: dict[str, Any],
) -> None:
    hf, ours = _pair(hf_classes, family, tiny)
    videos = [clip(*shape, seed=i) for i, shape in enumerate(shapes)]

    def metadata() -> list[VideoMetadata]:
        return [
            VideoMetadata(
                total_num_frames=len(v), fps=6.0, frames_indices=list(range(len(v)))
            )
            for v in videos
        ]

    common = {"return_tensors": "pt", "return_metadata": True}
    hf_kwargs = {"cap_pixels_per_frame": False, **kwargs}
    want = hf(videos=videos, video_metadata=metadata(), **common, **hf_kwargs)
    got = ours(videos, video_metadata=metadata(), **common, **kwargs)
    _assert_same(want, got)
    patches = [
        ours.get_num_of_video_patches(len(v), *v.shape[1:3], dict(kwargs))
        for v in videos
    ]
    if not ours.config.do_sample_frames and "do_sample_frames" not in kwargs:
        assert sum(patches) == got["pixel_values_videos"].shape[0]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_processor_prompt_ids_match_transformers(
    hf_classes: dict[str, Any], family: str
) -> None:
    """transformers' Qwen processor with its own video processor and with ours:
    the same prompt ids (Qwen3-VL: per-frame timestamps), pixel values and
    Qwen2.5-VL's ``second_per_grid_ts``."""
    model_dir = tiny_qwen_dir(MODELS[family])
    ours = load_processor(model_dir)
    hf_video, _ = _pair(hf_classes, family, tiny=True)
    # transformers' processor __call__ over its own video processor (set as
    # ours is: ProcessorMixin's class check cannot resolve video classes here).
    theirs = copy.copy(ours)
    theirs.video_processor = hf_video
    video = clip(10, 36, 52)
    prompt = f"Look: {QWEN_VIDEO_PROMPT} and {QWEN_VIDEO_PROMPT}?"

    def call(processor: Any) -> Any:
        meta = [
            VideoMetadata(total_num_frames=10, fps=5.0, frames_indices=list(range(10))),
            VideoMetadata(total_num_frames=6, fps=3.0, frames_indices=list(range(6))),
        ]
        return processor(
            text=[prompt],
            videos=[video, video[:6]],
            video_metadata=meta,
            return_tensors="pt",
            videos_kwargs={"cap_pixels_per_frame": False},
        )

    want, got = call(theirs), call(ours)
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    _assert_same(want, got)
    if family == "qwen2":
        assert got["second_per_grid_ts"].tolist() == want["second_per_grid_ts"].tolist()
    else:
        text = ours.tokenizer.decode(got["input_ids"][0])
        assert "seconds>" in text


def test_saved_settings_fall_back_to_the_image_processor() -> None:
    """A checkpoint saved with the image processor only (the tiny models):
    the video settings are the image ones, as transformers falls back to
    ``preprocessor_config.json``."""
    processor = load_processor(tiny_qwen_dir(MODELS["qwen2"]))
    video = processor.video_processor
    assert (video.patch_size, video.merge_size, video.temporal_patch_size) == (
        processor.image_processor.patch_size,
        processor.image_processor.merge_size,
        processor.image_processor.temporal_patch_size,
    )
    assert video.size == dict(processor.image_processor.size)


def test_unsupported_resample_is_refused() -> None:
    with pytest.raises(ValueError, match="resample 1 is not supported"):
        config_from_dict("qwen2", {"resample": 1})


def test_empty_video_is_refused() -> None:
    ours = VIDEO_PROCESSORS["qwen2"](config_from_dict("qwen2", {}))
    with pytest.raises(ValueError, match="with frames"):
        ours([np.zeros((0, 8, 8, 3), np.uint8)])
