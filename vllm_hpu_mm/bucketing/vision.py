"""Patch-count buckets of a dynamic-resolution vision tower, planned from image
sizes and videos.

Qwen2.5-VL / Qwen3-VL resize each image so both sides are multiples of
``patch * merge`` pixels and its area lies in ``[min_pixels, max_pixels]``
(the processor's ``smart_resize``); the tower then runs ``(h / patch) * (w /
patch)`` patches. The runner pads each tower run to a patch bucket
(``worker.vision_buckets``), so buckets fitted to the sizes a workload sends
waste fewer padding patches than the doubling default. A video is one tower
run of ``t * h * w`` patches (``bucketing.video``). Pure functions over ints;
the processor's own resize arithmetic is transformers'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hpu_mm.bucketing.buckets import exponential, smallest_fit
from vllm_hpu_mm.bucketing.planner import plan_axis


@dataclass(frozen=True, slots=True)
class PatchGeometry:
    """What the image processor's settings fix about patch counts."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @property
    def unit(self) -> int:
        """Patches of one merged token: every patch count is a multiple."""
        return self.merge_size * self.merge_size

    @classmethod
    def from_processor_config(cls, config: dict[str, Any]) -> PatchGeometry:
        """From a saved ``processor_config.json`` (or ``preprocessor_config.json``)."""
        image = config.get("image_processor", config)
        size = image.get("size") or {}
        try:
            return cls(
                patch_size=int(image["patch_size"]),
                merge_size=int(image["merge_size"]),
                min_pixels=int(size.get("shortest_edge", image.get("min_pixels"))),
                max_pixels=int(size.get("longest_edge", image.get("max_pixels"))),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(
                "not a dynamic-resolution image processor config (needs "
                f"patch_size, merge_size and a pixel range): missing {exc}"
            ) from exc

    def patches(self, width: int, height: int) -> int:
        """Patches the tower runs for one ``width`` x ``height`` image."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            smart_resize,
        )

        if width <= 0 or height <= 0:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        h, w = smart_resize(
            height,
            width,
            factor=self.patch_size * self.merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        return (h // self.patch_size) * (w // self.patch_size)

    @property
    def max_patches(self) -> int:
        """Most patches one image can have (its area at ``max_pixels``)."""
        per_unit = (self.patch_size * self.merge_size) ** 2
        return (self.max_pixels // per_unit) * self.unit


def padding_patches(counts: Sequence[int], buckets: Sequence[int]) -> tuple[int, int]:
    """(padding patches, runs that fit no bucket) for one image per run."""
    pad = misses = 0
    for n in counts:
        fit = smallest_fit(n, buckets)
        if fit is None:
            misses += 1
        else:
            pad += fit - n
    return pad, misses


def plan_vision_buckets(
    counts: Sequence[int], geometry: PatchGeometry, max_buckets: int
) -> tuple[int, ...]:
    """At most ``max_buckets`` patch buckets with the least padding on
    ``counts`` (one image or video per tower run, as chunked prefill schedules
    them), the largest being the largest image the processor can make or the
    largest sampled item if larger (a video: its frames' patches together),
    so every image and every sampled video fits."""
    unit = geometry.unit
    top = max(geometry.max_patches, max(counts, default=0))
    edges = plan_axis(counts, max_buckets, top=top)
    # Binned samples (many distinct sizes) give edges off the merge grid: round
    # them up to whole merged tokens, as the runner would.
    return tuple(sorted({-(-e // unit) * unit for e in edges}))


def doubling_buckets(geometry: PatchGeometry, min_patches: int) -> tuple[int, ...]:
    """The default's shape for comparison: doubling from ``min_patches`` up to
    the largest image."""
    unit = geometry.unit
    lo = -(-max(min_patches, unit) // unit) * unit
    return exponential(min(lo, geometry.max_patches), geometry.max_patches)
