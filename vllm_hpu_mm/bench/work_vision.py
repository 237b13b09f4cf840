"""A vision step counted by ``bench.work``: the plugin's Mllama vision encoder
(``models.mllama.vision.MllamaVisionEncoder``, as the runner calls it per
images batch) on images of mixed tile counts.

The minimum a Mllama image needs: its real rows (used tiles x (patches + CLS))
against each other, in every local and global layer. The encoder runs every
image at ``max_num_tiles`` tiles of rows padded to a multiple of 8, with an
additive bias. (Transformers' mask hides a pair of rows only when both are
invalid, so a real row attends the padding tiles' rows too: the plugin keeps
that for parity, which the minimum does not count.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hpu_mm.bench.work import WorkCounter, WorkCounts, needed_weight_bytes


@dataclass(frozen=True, slots=True)
class VisionShape:
    """Llama-3.2-Vision's geometry (560 px tiles of 14 px patches, 4 tiles)
    with a narrow, shallow tower: the attention ratios do not depend on width."""

    hidden: int = 32
    heads: int = 2
    intermediate: int = 64
    image_size: int = 560
    patch: int = 14
    tiles: int = 4
    layers: int = 2
    global_layers: int = 1


@dataclass(frozen=True, slots=True)
class VisionCount:
    counts: WorkCounts
    min_attention_flops: int
    min_weight_bytes: int  # each weight read once (embedding tables: rows gathered)
    rows_per_tile: int  # padded rows the encoder runs per tile


def minimum_vision_attention_flops(
    tiles_used: list[int], rows_per_tile: int, hidden: int, layers: int
) -> int:
    """Each image's real rows against each other (QK and PV: 4 FLOPs a pair
    and channel), in each of ``layers`` layers."""
    return layers * sum(4 * (t * rows_per_tile) ** 2 * hidden for t in tiles_used)


def count_mllama_vision(
    tiles_used: list[int], s: VisionShape = VisionShape(), seed: int = 0
) -> VisionCount:
    """Counts one encoder call over images using ``tiles_used`` tiles each."""
    from transformers import MllamaVisionConfig

    from vllm_hpu_mm.models.mllama.vision import MllamaVisionEncoder, VisionAttention

    ratios = [
        [w, h]
        for w in range(1, s.tiles + 1)
        for h in range(1, s.tiles + 1)
        if w * h <= s.tiles
    ]
    config = MllamaVisionConfig(
        hidden_size=s.hidden,
        attention_heads=s.heads,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_global_layers=s.global_layers,
        image_size=s.image_size,
        patch_size=s.patch,
        max_num_tiles=s.tiles,
        supported_aspect_ratios=ratios,
        intermediate_layers_indices=[0],
        vision_output_dim=2 * s.hidden,
        norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = MllamaVisionEncoder(config).requires_grad_(False).eval()
    n = len(tiles_used)
    # aspect ratio id (1-based) of a 1 x t grid; tiles past t are padding
    ids = torch.tensor([ratios.index([1, t]) + 1 for t in tiles_used])
    mask = torch.tensor([[int(i < t) for i in range(s.tiles)] for t in tiles_used])
    pixels = torch.randn(n, s.tiles, 3, s.image_size, s.image_size)
    counter = WorkCounter()
    counter.tag_module(model, "weight")
    handles = counter.scope_modules(model, VisionAttention, "attention")
    try:
        with torch.no_grad(), counter:
            model(pixels, ids, mask)
    finally:
        for h in handles:
            h.remove()
    return VisionCount(
        counts=counter.counts,
        min_attention_flops=minimum_vision_attention_flops(
            tiles_used,
            model.num_patches,
            s.hidden,
            s.layers + s.global_layers,
        ),
        min_weight_bytes=needed_weight_bytes(counter.counts, model),
        rows_per_tile=model.padded,
    )
