"""A CPU stand-in for the three ``torchvision.transforms.v2.functional`` calls
transformers' Qwen video processors make, so that their own classes run here
(torchvision does not load in this environment) as references for
``vllm_hpu_mm.models.qwen_video``.

Each does what torchvision 0.2x does on a CPU tensor
(``torchvision/transforms/v2/functional/_geometry.py``, ``resize_image``:
bicubic and (with AVX2) bilinear take the native uint8 ``interpolate`` kernel,
``align_corners=False``, ``antialias`` as given; ``_misc.py``, ``normalize_image``:
``(x - mean) / std`` per channel, float tensors only; ``_color.py``,
``grayscale_to_rgb``: one channel repeated to three). Like torchvision,
``normalize`` refuses integer tensors and ``resize`` refuses modes it does not
know.

``installed(monkeypatch)`` puts the stand-in in ``sys.modules`` (and in the
transformers modules that bound ``tvF`` at import) for one test's duration.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def resize(
    image: torch.Tensor,
    size: Sequence[int],
    interpolation: InterpolationMode = InterpolationMode.BILINEAR,
    antialias: bool = True,
) -> torch.Tensor:
    if interpolation not in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
        raise NotImplementedError(f"stand-in has no {interpolation}")
    shape = image.shape
    if tuple(shape[-2:]) == tuple(size):
        return image
    flat = image.reshape(-1, *shape[-3:])
    out = F.interpolate(
        flat,
        size=list(size),
        mode=interpolation.value,
        align_corners=False,
        antialias=antialias,
    )
    return out.reshape(*shape[:-2], *size)


def normalize(
    image: torch.Tensor,
    mean: Sequence[float] | torch.Tensor,
    std: Sequence[float] | torch.Tensor,
    inplace: bool = False,
) -> torch.Tensor:
    if not image.is_floating_point():
        raise TypeError(f"Input tensor should be a float tensor. Got {image.dtype}.")
    m = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    out = image if inplace else image.clone()
    return out.sub_(m).div_(s)


def grayscale_to_rgb(image: torch.Tensor) -> torch.Tensor:
    if image.shape[-3] >= 3:
        return image
    return image.repeat_interleave(3, dim=-3)


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


QWEN2_VIDEO_MODULE = "transformers.models.qwen2_vl.video_processing_qwen2_vl"


def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make transformers' Qwen video processor classes run with the stand-in."""
    # transformers' own modules first, so that its availability checks ran
    # before a ``torchvision`` entry exists.
    import transformers.image_processing_backends as backends
    import transformers.models.qwen3_vl.video_processing_qwen3_vl as qwen3
    import transformers.video_processing_utils as video_utils
    from transformers.image_utils import PILImageResampling

    functional = _module("torchvision.transforms.v2.functional")
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    functional.resize = resize  # type: ignore[attr-defined]
    functional.normalize = normalize  # type: ignore[attr-defined]
    functional.grayscale_to_rgb = grayscale_to_rgb  # type: ignore[attr-defined]
    v2 = _module("torchvision.transforms.v2")
    v2.functional = functional  # type: ignore[attr-defined]
    for name, module in (
        ("torchvision", _module("torchvision")),
        ("torchvision.transforms", _module("torchvision.transforms")),
        ("torchvision.transforms.v2", v2),
        ("torchvision.transforms.v2.functional", functional),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    for module in (backends, video_utils, qwen3):
        monkeypatch.setattr(module, "tvF", functional, raising=False)
    monkeypatch.setattr(
        backends,
        "pil_torch_interpolation_mapping",
        {
            PILImageResampling.BILINEAR: InterpolationMode.BILINEAR,
            PILImageResampling.BICUBIC: InterpolationMode.BICUBIC,
        },
    )
    # Qwen2-VL's module imports torchvision at its top: import it now, and
    # drop it again afterwards (setitem records the entry's state before).
    monkeypatch.setitem(sys.modules, QWEN2_VIDEO_MODULE, _module(QWEN2_VIDEO_MODULE))
    del sys.modules[QWEN2_VIDEO_MODULE]
    importlib.import_module(QWEN2_VIDEO_MODULE)
