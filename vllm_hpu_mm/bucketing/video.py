"""Patch counts of video samples for the vision planner (Qwen2.5-VL, Qwen3-VL).

A video reaches the vision tower as one item of grid ``(t, h, w)``, run on the
same patch buckets as images (``worker.vision_buckets``): its ``t * h * w``
patches must fit one bucket. How a served video of ``frames`` frames at
``width`` x ``height`` gets there:

1. vLLM's video loader (OpenCV) keeps every frame of a video of at most
   ``num_frames`` frames (``--media-io-kwargs '{"video": {"num_frames": N}}'``,
   32 by default), else ``num_frames`` of them, evenly spaced; its metadata
   says which (``do_sample_frames``: the whole video);
2. the processor samples a whole video again where its family does
   (Qwen3-VL: vLLM passes the loader's flag, then ``fps`` (2) or
   ``num_frames`` of the saved settings; Qwen2.5-VL: only when its saved
   settings ask for ``do_sample_frames``);
3. every kept frame is resized to one ``smart_resize`` size (Qwen3-VL's
   bounds the pixels of all frames together), and ``temporal_patch_size``
   frames make one temporal patch (the last frame repeated):
   ``t = ceil(kept / temporal_patch_size)``, ``h = height' / patch``,
   ``w = width' / patch``.

Steps 2 and 3 are the torchvision-free processor's own functions
(``models.qwen_video``, checked against transformers' classes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOADER_NUM_FRAMES = 32  # vLLM's VideoMediaIO default
_FAMILIES = {
    "qwen2_vl": "qwen2",
    "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3",
}


@dataclass(frozen=True, slots=True)
class VideoSample:
    """One sampled video as its container header describes it."""

    frames: int  # frames in the file
    width: int
    height: int
    fps: float | None = None  # the file's frame rate (fps sampling reads it)

    def __post_init__(self) -> None:
        if self.frames <= 0 or self.width <= 0 or self.height <= 0:
            raise ValueError(
                "a video needs frames, width and height > 0, got "
                f"{self.frames} frames of {self.width}x{self.height}"
            )
        if self.fps is not None and self.fps <= 0:
            raise ValueError(f"a video's fps must be > 0, got {self.fps}")


def loader_frames(frames: int, num_frames: int = LOADER_NUM_FRAMES) -> tuple[int, bool]:
    """(frames vLLM's OpenCV loader keeps, whether that is the whole video)
    for a video of ``frames`` frames; ``num_frames`` -1 keeps all."""
    kept = frames if num_frames <= 0 else min(num_frames, frames)
    kept = max(1, kept)
    return kept, kept == frames


def video_family(model: Path) -> str:
    """``qwen2`` or ``qwen3``: the video processor family of the checkpoint at
    ``model`` (its ``config.json`` ``model_type``)."""
    file = model / "config.json"
    if not file.is_file():
        raise ValueError(f"{model}: no config.json (videos need the model type)")
    model_type = json.loads(file.read_text()).get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(
            f"{model}: model_type {model_type!r} takes no video here; videos are "
            f"planned for {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[model_type]


def video_config(model: Path) -> Any:
    """The checkpoint's video processor settings (``QwenVideoConfig``), as the
    plugin's processor loads them (the image settings when none for video)."""
    from vllm_hpu_mm.models.qwen_video import (
        config_from_dict,
        saved_video_processor_dict,
    )

    family = video_family(model)
    return config_from_dict(family, saved_video_processor_dict(model))  # type: ignore[arg-type]


def processor_frames(cfg: Any, sample: VideoSample, num_frames: int) -> int:
    """Frames the processor turns into patches (steps 1 and 2)."""
    from transformers.video_utils import VideoMetadata

    from vllm_hpu_mm.models.qwen_video import sample_indices

    kept, whole = loader_frames(sample.frames, num_frames)
    sample_again = whole if cfg.family == "qwen3" else whole and cfg.do_sample_frames
    if not sample_again:
        return kept
    if sample.fps is None and cfg.num_frames is None and cfg.fps is not None:
        raise ValueError(
            f"the processor samples a whole video at {cfg.fps} fps: a video of "
            f"{sample.frames} frames needs its fps"
        )
    metadata = VideoMetadata(total_num_frames=kept, fps=sample.fps)
    return len(sample_indices(cfg, metadata, cfg.num_frames, cfg.fps))


def video_patches(
    cfg: Any, sample: VideoSample, num_frames: int = LOADER_NUM_FRAMES
) -> int:
    """Patches the tower runs for ``sample`` (``t * h * w`` of its grid) under
    the video processor settings ``cfg`` (``QwenVideoConfig``)."""
    from vllm_hpu_mm.models.qwen_video import resized_size

    kept = processor_frames(cfg, sample, num_frames)
    height, width = resized_size(cfg, kept, sample.height, sample.width)
    t = -(-kept // cfg.temporal_patch_size)
    return t * (height // cfg.patch_size) * (width // cfg.patch_size)
