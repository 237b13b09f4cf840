"""Dynamic-resolution vision towers (Qwen2.5-VL) on static shapes.

Qwen's vision tower takes every image at its own resolution: the encoder input
is all items' patches concatenated (``pixel_values`` [N, C*T*P*P]) with one
``(t, h, w)`` grid row per item, and the tower derives its attention segments
(``cu_seqlens``: one per image; ``cu_window_seqlens``: one per attention window),
window order and rotary tables from the grids on the host. So every batch of
images has its own shapes.

Here a batch is padded to a *patch bucket* B (the smallest prepared size >= N):

- the B - N padding patches (zeros) form one more, fake image of grid
  ``(1, merge, (B - N) / merge)``: its own attention segment and windows, so the
  padded patches attend only to each other and no real patch attends to them;
  its output rows are dropped;
- the tower's metadata comes from the model's own ``prepare_encoder_metadata``
  (vLLM's encoder CUDA-graph interface) over the real grids plus the fake one,
  with the segment lists padded to a fixed length (empty segments repeat the
  last offset) and the max-length scalars fixed, so every tensor the tower sees
  has a shape that depends on B alone.

In graph mode the tower's forward over (patches, metadata) is compiled once per
bucket at warmup (the varlen attention is vLLM's opaque custom op, or, under
the plan's static encoder attention, one masked SDPA a layer whose masks are
built from the segment offsets inside the graph: Dynamo never reads the
segment values); any resolution mix that fits a prepared
bucket then compiles nothing. Items whose patches exceed the largest bucket are
split into several runs; a single item larger than it runs unpadded and
eagerly (counted as a fallback).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_hpu_mm import metrics
from vllm_hpu_mm.attention.encoder import (
    attach_step_masks,
    uses_static_attention,
    window_patches,
)
from vllm_hpu_mm.bucketing.buckets import exponential, smallest_fit

logger = logging.getLogger("vllm.hpu_mm.vision")

# (patches, grids) of the two modalities the Qwen towers take.
PIXEL_KEYS = (
    ("pixel_values", "image_grid_thw"),
    ("pixel_values_videos", "video_grid_thw"),
)


def supports_patch_buckets(model: Any) -> bool:
    """The model's vision tower takes precomputed metadata (Qwen2.5-VL's does)."""
    visual = getattr(model, "visual", None)
    return callable(getattr(visual, "prepare_encoder_metadata", None))


def _whole_tokens(patches: int, unit: int) -> int:
    """``patches`` rounded up to whole merged tokens (``unit`` patches each)."""
    return -(-max(patches, unit) // unit) * unit


def patch_buckets(
    max_patches: int,
    unit: int,
    min_patches: int | None = None,
    explicit: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Patch buckets, each a multiple of ``unit`` (the patches of one merged
    token): the ``explicit`` list, or doubling from ``min_patches`` (default 4
    tokens) up to ``max_patches``."""
    if explicit:
        return tuple(sorted({_whole_tokens(p, unit) for p in explicit}))
    hi = _whole_tokens(max_patches, unit)
    lo = _whole_tokens(4 * unit if min_patches is None else min_patches, unit)
    return exponential(min(lo, hi), hi)


def padding_grid(num_patches: int, bucket: int, merge: int) -> list[int] | None:
    """Grid ``[1, merge, w]`` of the fake image that fills ``num_patches`` up to
    ``bucket`` (None when nothing is missing). Both are multiples of merge**2."""
    pad = bucket - num_patches
    unit = merge * merge
    if pad < 0 or pad % unit or num_patches % unit:
        raise ValueError(
            f"cannot pad {num_patches} patches to {bucket}: both must be "
            f"multiples of {unit} (merge {merge} squared) and {num_patches} <= {bucket}"
        )
    return None if pad == 0 else [1, merge, pad // merge]


def group_items(patches: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive item indices in runs of at most ``limit`` patches (an item
    larger than ``limit`` forms a run of its own)."""
    runs: list[list[int]] = []
    total = limit + 1
    for i, n in enumerate(patches):
        if total + n > limit:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += n
    return runs


class PatchBucketEncoder:
    """Runs a Qwen2.5-VL-style vision tower over patch-bucketed image batches."""

    def __init__(
        self,
        model: Any,
        buckets: Sequence[int],
        compile_backend: Callable[..., Any] | None,
    ) -> None:
        self.model = model
        self.visual = model.visual
        self.merge: int = self.visual.spatial_merge_size
        self.buckets = tuple(buckets)  # ``patch_buckets``: multiples of merge**2
        embed = self.visual.patch_embed
        self.patch_dim = (
            embed.proj.in_channels * embed.temporal_patch_size * embed.patch_size**2
        )
        # Static encoder attention (the plan's ``static_encoder_attention``,
        # read by the layers when built): each step's block-diagonal masks
        # are built once, inside the tower's graph, for all layers.
        self.step_masks = uses_static_attention(self.visual)
        self.mask_dtype = next(
            (p.dtype for p in self.visual.parameters()), torch.get_default_dtype()
        )
        self.window = window_patches(self.visual)
        self._tower: Callable[..., torch.Tensor] = self._run_tower
        if compile_backend is not None:
            self._tower = torch.compile(
                self._run_tower, backend=compile_backend, dynamic=False
            )
        logger.info(
            "Vision patch buckets: %s (%s)",
            list(self.buckets),
            "compiled" if compile_backend is not None else "eager",
        )

    def _run_tower(self, x: torch.Tensor, metadata: dict[str, Any]) -> torch.Tensor:
        if self.step_masks:
            metadata = attach_step_masks(
                metadata, x.shape[0], self.mask_dtype, self.window
            )
        return self.visual(x, None, encoder_metadata=metadata)

    def _metadata(self, grids: list[list[int]], bucket: int) -> dict[str, Any]:
        # Every image and every window holds >= merge**2 patches, so
        # bucket / merge**2 segments bound both lists.
        segments = bucket // self.merge**2
        fixed = {
            "max_batch_size": segments,
            "max_window_seqs_per_batch": segments,  # windowed towers (2.5)
            "max_seqlen_override": bucket,
            "max_seqlen_window_override": bucket,  # windowed towers (2.5)
        }
        taken = inspect.signature(self.visual.prepare_encoder_metadata).parameters
        fixed = {k: v for k, v in fixed.items() if k in taken}
        return self.visual.prepare_encoder_metadata(
            grids, device=self.visual.device, **fixed
        )

    def run_bucket(
        self, pixels: torch.Tensor, grids: list[list[int]], bucket: int
    ) -> torch.Tensor:
        """[bucket / merge**2, hidden] tower output of ``pixels`` ([N, patch_dim],
        the items of ``grids``) padded to ``bucket`` patches; real rows first."""
        n = pixels.shape[0]
        fake = padding_grid(n, bucket, self.merge)
        if fake is not None:
            pad = pixels.new_zeros(bucket - n, pixels.shape[1])
            pixels = torch.cat([pixels, pad])
            grids = [*grids, fake]
        return self._tower(pixels, self._metadata(grids, bucket))

    def __call__(self, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """One output [tokens, hidden] per item of a batch of image or video
        kwargs. A video is one item of grid (t, h, w): the tower runs each of
        its t temporal patches as its own attention segment, as it does t
        images, so videos share the image buckets."""
        keys = next((k for k in PIXEL_KEYS if set(k) <= kwargs.keys()), None)
        if keys is None:
            return list(self.model.embed_multimodal(**kwargs))  # e.g. embeddings
        pixels: torch.Tensor = kwargs[keys[0]]
        grids: list[list[int]] = kwargs[keys[1]].tolist()
        patches = [t * h * w for t, h, w in grids]
        starts = [0]
        for p in patches:
            starts.append(starts[-1] + p)
        outputs: list[torch.Tensor] = []
        for run in group_items(patches, self.buckets[-1]):
            lo, hi = starts[run[0]], starts[run[-1] + 1]
            run_grids = [grids[i] for i in run]
            bucket = smallest_fit(hi - lo, self.buckets)
            if bucket is None:  # one item above the largest bucket
                metrics.FALLBACK_BUCKETS.inc()
                out = self.visual(pixels[lo:hi], run_grids)
            else:
                metrics.VISION_PATCHES.inc(hi - lo)
                metrics.VISION_PADDING_PATCHES.inc(bucket - (hi - lo))
                out = self.run_bucket(pixels[lo:hi], run_grids, bucket)
            tokens = [p // self.merge**2 for p in patches[run[0] : run[-1] + 1]]
            outputs.extend(out[: sum(tokens)].split(tokens))
        return outputs

    def warm_up(self, dtype: torch.dtype) -> int:
        """Run every bucket once (all padding); the number of buckets."""
        device = self.visual.device
        for bucket in self.buckets:
            empty = torch.zeros(0, self.patch_dim, dtype=dtype, device=device)
            self.run_bucket(empty, [], bucket)
        return len(self.buckets)
