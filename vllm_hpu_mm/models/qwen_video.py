"""Qwen2.5-VL and Qwen3-VL video processors without torchvision (numpy/torch only).

Why: transformers 5's ``Qwen2VLVideoProcessor`` (which Qwen2.5-VL uses) and
``Qwen3VLVideoProcessor`` are ``BaseVideoProcessor`` subclasses, i.e. torchvision
backends, and torchvision does not load here (``models.qwen_vl``). These classes
do what theirs do, step for step (transformers 5.20,
``models/qwen2_vl/video_processing_qwen2_vl.py`` and
``models/qwen3_vl/video_processing_qwen3_vl.py``):

1. frame sampling (``do_sample_frames``): Qwen2's ``fps``/``num_frames`` rule
   rounded to ``temporal_patch_size``, Qwen3's ``linspace`` rule; the metadata's
   ``frames_indices`` records the frames kept (Qwen3-VL's prompt timestamps and
   Qwen2.5-VL's ``second_per_grid_ts`` read them);
2. resize of each frame to the model's ``smart_resize`` size (the same functions
   transformers uses; Qwen3's counts the frames) with the checkpoint's resample,
   as torchvision's ``resize`` does it on the CPU: ``interpolate`` on the uint8
   frames, antialiased, ``align_corners=False``;
3. rescale and normalize fused as transformers fuses them (mean and std divided
   by the rescale factor, in float32);
4. patchify into ``pixel_values_videos`` [sum(t*h*w), C*T*P*P] and
   ``video_grid_thw`` [videos, 3], last frame repeated up to a multiple of
   ``temporal_patch_size``.

tests/unit/test_qwen_video.py compares them with transformers' own classes run
with a CPU stand-in for the three torchvision functions they call.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from transformers.image_processing_utils import BatchFeature
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as qwen2_smart_resize,
)
from transformers.processing_utils import VideosKwargs
from transformers.video_utils import (
    VideoMetadata,
    make_batched_metadata,
    make_batched_videos,
)

Family = Literal["qwen2", "qwen3"]
# PIL resample codes -> interpolate modes with a native uint8 CPU kernel (the
# ones torchvision calls without a float round trip on the CPU).
_MODES = {2: "bilinear", 3: "bicubic"}
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def qwen3_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """transformers' Qwen3-VL video ``smart_resize`` (its module imports without
    torchvision when imported by path; imported here on first use)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    h, w = smart_resize(
        num_frames,
        height,
        width,
        temporal_factor=temporal_factor,
        factor=factor,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    return int(h), int(w)


@dataclass(frozen=True, slots=True)
class QwenVideoConfig:
    """A checkpoint's video processor settings (transformers' attribute names)."""

    family: Family
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # size["shortest_edge"]: pixels (Qwen3: of all frames)
    max_pixels: int  # size["longest_edge"]
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL code: 3 = bicubic
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.resample not in _MODES:
            raise ValueError(
                f"video resample {self.resample} is not supported without "
                f"torchvision: use one of {sorted(_MODES)} (PIL codes: "
                f"{_MODES})"
            )


FAMILY_DEFAULTS: dict[Family, dict[str, Any]] = {
    # Qwen2VLVideoProcessor's class attributes.
    "qwen2": dict(
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=128 * 28 * 28,
        max_pixels=28 * 28 * 768,
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
        do_sample_frames=False,
        fps=None,
        max_video_tokens=128000,
    ),
    # Qwen3VLVideoProcessor's class attributes.
    "qwen3": dict(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=128 * 32 * 32,
        max_pixels=32 * 32 * 768,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        do_sample_frames=True,
        fps=2,
        max_video_tokens=768,
    ),
}
_FIELDS = set(QwenVideoConfig.__dataclass_fields__) - {"family", "extra"}


def config_from_dict(family: Family, raw: dict[str, Any]) -> QwenVideoConfig:
    """``QwenVideoConfig`` from a saved processor dict (``size`` or the older
    ``min_pixels``/``max_pixels`` keys), the family's defaults elsewhere."""
    values = dict(FAMILY_DEFAULTS[family])
    size = raw.get("size") or {}
    for key, alias in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if size.get(alias) is not None:
            values[key] = int(size[alias])
        if raw.get(key) is not None:
            values[key] = int(raw[key])
    for key in _FIELDS - {"min_pixels", "max_pixels"}:
        if raw.get(key) is not None:
            values[key] = raw[key]
    values["image_mean"] = tuple(float(v) for v in values["image_mean"])
    values["image_std"] = tuple(float(v) for v in values["image_std"])
    return QwenVideoConfig(family=family, **values)


def saved_video_processor_dict(model_dir: str | Path) -> dict[str, Any]:
    """The video processor dict transformers would load from ``model_dir``
    (``processor_config.json``'s ``video_processor``, then
    ``video_preprocessor_config.json``, then ``preprocessor_config.json``),
    and, for a checkpoint saved with an images-only processor, its nested
    ``image_processor`` (the same fallback to the image settings)."""
    root = Path(model_dir)
    nested = root / "processor_config.json"
    nested_dict = json.loads(nested.read_text()) if nested.is_file() else {}
    if "video_processor" in nested_dict:
        return dict(nested_dict["video_processor"])
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (root / name).is_file():
            return dict(json.loads((root / name).read_text()))
    if "image_processor" in nested_dict:
        return dict(nested_dict["image_processor"])
    raise OSError(f"{model_dir}: no video or image processor settings found")


# --- the steps -------------------------------------------------------------


def sample_indices(
    cfg: QwenVideoConfig,
    metadata: VideoMetadata,
    num_frames: int | None = None,
    fps: float | None = None,
) -> np.ndarray:
    """Indices of the frames kept (the family's ``sample_frames``)."""
    if fps is not None and num_frames is not None:
        raise ValueError("`num_frames` and `fps` are mutually exclusive")
    total = int(metadata.total_num_frames)
    if cfg.family == "qwen3":
        if num_frames is None and fps is not None:
            video_fps = metadata.fps if metadata.fps is not None else 24
            num_frames = int(total / video_fps * fps)
            num_frames = min(max(num_frames, cfg.min_frames), cfg.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, cfg.min_frames), cfg.max_frames)
        return np.linspace(0, total - 1, num_frames).round().astype(int)
    tps = cfg.temporal_patch_size
    if num_frames is not None:
        num_frames = round(num_frames / tps) * tps
    elif fps is not None:
        if metadata.fps is None:
            raise ValueError("sampling by fps needs the video's fps (metadata)")
        max_frames = math.floor(min(cfg.max_frames, total) / tps) * tps
        wanted = total / metadata.fps * fps
        wanted = min(max(wanted, cfg.min_frames), max_frames, total)
        num_frames = math.floor(wanted / tps) * tps
    if num_frames is None:
        return np.arange(total)
    if num_frames > total:
        raise ValueError(
            f"cannot sample {num_frames} frames from a video of {total} frames"
        )
    return torch.arange(0, total, total / num_frames).int().numpy()


def resized_size(
    cfg: QwenVideoConfig, num_frames: int, height: int, width: int
) -> tuple[int, int]:
    """(height, width) the frames are resized to (the family's ``resize``)."""
    factor = cfg.patch_size * cfg.merge_size
    if cfg.family == "qwen3":
        max_pixels = cfg.max_pixels
        if cfg.cap_pixels_per_frame:
            frame_cap = cfg.max_video_tokens * factor * factor
            per_frame = max(
                min(frame_cap, cfg.max_pixels // num_frames),
                int(cfg.min_pixels * 1.05),
            )
            max_pixels = per_frame * num_frames
        return qwen3_smart_resize(
            num_frames,
            height,
            width,
            temporal_factor=cfg.temporal_patch_size,
            factor=factor,
            min_pixels=cfg.min_pixels,
            max_pixels=max_pixels,
        )
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        total_pixels = int(cfg.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(
            min(max_pixels, total_pixels * cfg.temporal_patch_size // num_frames),
            int(cfg.min_pixels * 1.05),
        )
    h, w = qwen2_smart_resize(
        height, width, factor=factor, min_pixels=cfg.min_pixels, max_pixels=max_pixels
    )
    return int(h), int(w)


def resize_frames(
    frames: torch.Tensor, size: tuple[int, int], resample: int
) -> torch.Tensor:
    """frames: [T, C, H, W] uint8 -> [T, C, *size] uint8, as torchvision's CPU
    ``resize`` (uint8 kernel, antialias, no corner alignment)."""
    if tuple(frames.shape[-2:]) == size:
        return frames
    return F.interpolate(
        frames,
        size=list(size),
        mode=_MODES[resample],
        align_corners=False,
        antialias=True,
    )


def normalize_frames(cfg: QwenVideoConfig, frames: torch.Tensor) -> torch.Tensor:
    """uint8 [T, C, H, W] -> float32, rescale and normalize fused as transformers'
    ``rescale_and_normalize``."""
    if cfg.do_normalize:
        scale = 1.0 / cfg.rescale_factor if cfg.do_rescale else 1.0
        mean = (torch.tensor(cfg.image_mean) * scale).view(-1, 1, 1)
        std = (torch.tensor(cfg.image_std) * scale).view(-1, 1, 1)
        return frames.to(torch.float32).sub_(mean).div_(std)
    if cfg.do_rescale:
        return frames * cfg.rescale_factor
    return frames.to(torch.float32)


def patchify(
    cfg: QwenVideoConfig, video: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """video [T, C, H, W] -> (patches [t*h*w, C*tps*P*P], [t, h, w]); the last
    frame is repeated up to a multiple of ``temporal_patch_size``."""
    p, m, tps = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if pad := -video.shape[0] % tps:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)), dim=0)
    frames, channels, height, width = video.shape
    t, h, w = frames // tps, height // p, width // p
    patches = video.reshape(t, tps, channels, h // m, m, p, w // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, channels * tps * p * p), [t, h, w]


def as_frames(video: Any) -> torch.Tensor:
    """One video (frames [T, H, W, C] or [T, C, H, W], numpy or torch, or a list
    of frames) as a [T, 3, H, W] uint8 tensor."""
    if isinstance(video, (list, tuple)):
        video = np.stack([np.asarray(frame) for frame in video])
    tensor = torch.as_tensor(np.asarray(video) if not torch.is_tensor(video) else video)
    if tensor.ndim != 4 or tensor.shape[0] == 0:
        raise ValueError(
            f"a video must be [frames, H, W, C] with frames; got {tuple(tensor.shape)}"
        )
    if tensor.shape[-1] in (1, 3) and tensor.shape[1] not in (1, 3):
        tensor = tensor.permute(0, 3, 1, 2)
    if tensor.shape[1] == 1:
        tensor = tensor.expand(-1, 3, -1, -1)
    if tensor.shape[1] != 3:
        raise ValueError(
            f"a video frame must have 1 or 3 channels; got {tuple(tensor.shape)}"
        )
    return tensor.contiguous()


def _edge(size: Any, name: str) -> Any:
    """``size[name]`` of a dict or a transformers ``SizeDict`` (None if unset)."""
    if size is None:
        return None
    return size.get(name) if isinstance(size, dict) else getattr(size, name, None)


# --- the processor ------------------------------------------------------------


class QwenVideosKwargs(VideosKwargs, total=False):
    """The keys the processor call accepts (transformers' Qwen ones)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int


_CALL_ONLY = {
    "video_metadata",
    "return_metadata",
    "return_tensors",
    "fps",
    "num_frames",
}


class QwenVideoProcessor:
    """A Qwen video processor over ``QwenVideoConfig``, called as transformers
    calls its video processor (``processor(videos, video_metadata=...,
    return_metadata=..., **settings)``)."""

    family: ClassVar[Family]
    valid_kwargs = QwenVideosKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, config: QwenVideoConfig) -> None:
        self.config = config

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **_: Any) -> QwenVideoProcessor:
        return cls(config_from_dict(cls.family, saved_video_processor_dict(model_dir)))

    # The attributes vLLM's and transformers' processors read.
    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and name in _FIELDS:
            return getattr(config, name)
        raise AttributeError(name)

    @property
    def size(self) -> dict[str, int]:
        return {
            "shortest_edge": self.config.min_pixels,
            "longest_edge": self.config.max_pixels,
        }

    def _with(self, settings: dict[str, Any]) -> QwenVideoConfig:
        """This call's config: ``settings`` (processor kwargs) over the saved one."""
        raw = {
            k: v
            for k, v in settings.items()
            if v is not None and k in _FIELDS | {"size"}
        }
        if not raw:
            return self.config
        size = raw.pop("size", None)
        for key, alias in (
            ("min_pixels", "shortest_edge"),
            ("max_pixels", "longest_edge"),
        ):
            edge = _edge(size, alias)
            if edge is not None:
                raw.setdefault(key, int(edge))
        return replace(self.config, **raw)

    def __call__(self, videos: Any, **kwargs: Any) -> BatchFeature:
        cfg = self._with({k: v for k, v in kwargs.items() if k not in _CALL_ONLY})
        # One video, a list of videos, or vLLM's per-item [[video]]: a flat
        # list of [T, H, W, C] (or [T, C, H, W]) arrays, as transformers does.
        videos = make_batched_videos(videos) if len(videos) else []
        frames = [as_frames(v) for v in videos]
        metadata = make_batched_metadata(
            [f.permute(0, 2, 3, 1).numpy() for f in frames],
            kwargs.get("video_metadata"),  # type: ignore[arg-type]
        )
        do_sample = kwargs.get("do_sample_frames")
        if do_sample if do_sample is not None else cfg.do_sample_frames:
            for i, (video, meta) in enumerate(zip(frames, metadata, strict=True)):
                # As transformers: an argument not given is the saved one.
                indices = sample_indices(
                    cfg,
                    meta,
                    kwargs.get("num_frames", cfg.num_frames),
                    kwargs.get("fps", cfg.fps),
                )
                meta.frames_indices = indices  # type: ignore[assignment]
                frames[i] = video[torch.as_tensor(indices)]
        pixel_values, grids = [], []
        for video in frames:
            if cfg.do_resize:
                size = resized_size(cfg, video.shape[0], *video.shape[-2:])
                video = resize_frames(video, size, cfg.resample)
            patches, grid = patchify(cfg, normalize_frames(cfg, video))
            pixel_values.append(patches)
            grids.append(grid)
        data: dict[str, Any] = {
            "pixel_values_videos": torch.cat(pixel_values),
            "video_grid_thw": torch.tensor(grids),
        }
        out = BatchFeature(data=data, tensor_type=kwargs.get("return_tensors"))
        if kwargs.get("return_metadata"):
            out["video_metadata"] = metadata
        return out

    def get_num_of_video_patches(
        self,
        num_frames: int,
        height: int,
        width: int,
        videos_kwargs: dict[str, Any] | None = None,
    ) -> int:
        cfg = self._with(dict(videos_kwargs or {}))
        h, w = resized_size(cfg, num_frames, height, width)
        t = (
            num_frames + -num_frames % cfg.temporal_patch_size
        ) // cfg.temporal_patch_size
        return t * (h // cfg.patch_size) * (w // cfg.patch_size)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self.config, k) for k in sorted(_FIELDS)}


class Qwen2VLVideoProcessorNoTV(QwenVideoProcessor):
    """``Qwen2VLVideoProcessor`` (Qwen2-VL, Qwen2.5-VL) without torchvision."""

    family: ClassVar[Family] = "qwen2"


class Qwen3VLVideoProcessorNoTV(QwenVideoProcessor):
    """``Qwen3VLVideoProcessor`` without torchvision."""

    family: ClassVar[Family] = "qwen3"


VIDEO_PROCESSORS: dict[str, type[QwenVideoProcessor]] = {
    "qwen2": Qwen2VLVideoProcessorNoTV,
    "qwen3": Qwen3VLVideoProcessorNoTV,
}
