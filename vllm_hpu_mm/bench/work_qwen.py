"""A Qwen2.5-VL vision step counted by ``bench.work``: vLLM's own
``Qwen2_5_VisionTransformer`` (what the plugin serves) over images of mixed
sizes, its attention in either form of ``MMEncoderAttention``: vLLM's (the
dynamic plan off Gaudi: the ``vllm.torch_sdpa_wrapper`` custom op, counted
from the inside, one SDPA per segment) or the static plan's
(``vllm_hpu_mm.attention.encoder``: one masked SDPA a layer over all patches,
the step's masks built once as the patch-bucket encoder builds them).

The tower is built from ``models/tiny-qwen2_5-vl``'s config with the released
window geometry (112 px windows of 14 px patches merged 2x2: 8x8 patches a
window; here ``window_size`` 32 of 4 px patches), random weights. Building it
needs a vLLM config and a one-process model-parallel group (gloo): about 30 s.

The minimum: in a full-attention layer each image's patches against each
other, in a window layer each window's patches against each other
(``qwen_segments``, from the image grids alone).
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hpu_mm.bench.work import WorkCounter, WorkCounts, needed_weight_bytes

WINDOW_PATCHES = 8
"""Patches along a window's side in released Qwen2.5-VL (112 px / 14 px)."""


@dataclass(frozen=True, slots=True)
class QwenVisionCount:
    counts: WorkCounts
    min_attention_flops: int
    min_weight_bytes: int
    layers: int
    segments: int  # attention segments of the step, all layers


def qwen_segments(
    grid: list[int], merge: int, window_units: int
) -> tuple[list[int], list[int]]:
    """(full-attention segments, window segments) of one image, in patches:
    ``grid`` is (t, h, w) patches; a window is ``window_units`` merged units
    (``merge x merge`` patches each) a side, clipped at the image's edge."""
    t, h, w = grid
    uh, uw = h // merge, w // merge
    windows = []
    for i in range(math.ceil(uh / window_units)):
        for j in range(math.ceil(uw / window_units)):
            rows = min(window_units, uh - i * window_units)
            cols = min(window_units, uw - j * window_units)
            windows.append(rows * cols * merge * merge)
    return [h * w] * t, windows * t


RELEASED_DEPTH = 32
RELEASED_FULL_LAYERS = [7, 15, 23, 31]
"""Released Qwen2.5-VL's tower: 32 layers, four of them full attention."""


def build_tower(
    model_dir: str,
    dtype: torch.dtype = torch.bfloat16,
    static: bool = False,
    released_depth: bool = False,
) -> Any:
    """vLLM's Qwen2.5-VL vision tower for ``model_dir``'s config, windows of
    ``WINDOW_PATCHES`` patches, seeded random weights (the process gets a
    one-rank gloo group if it has none); ``static``: built under the static
    plan with the plugin's encoder attention registered (as the worker
    does), else under the dynamic plan (vLLM's form); ``released_depth``:
    the released tower's layers (``RELEASED_DEPTH``, full attention at
    ``RELEASED_FULL_LAYERS``) at the checkpoint's widths."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs

    from vllm_hpu_mm.attention.encoder import register_encoder_attention

    register_encoder_attention()
    plan = {"hpu_mm": {"execution": "static" if static else "dynamic"}}
    vc = EngineArgs(
        model=model_dir,
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        additional_config=plan,
    ).create_engine_config()
    # imported after the config: making it loads the plugin, whose model
    # registration keeps torchvision out of vLLM's Qwen imports
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer

    cfg = vc.model_config.hf_config.vision_config
    cfg.window_size = WINDOW_PATCHES * cfg.patch_size
    if released_depth:
        cfg.depth = RELEASED_DEPTH
        cfg.fullatt_block_indexes = list(RELEASED_FULL_LAYERS)
    with set_current_vllm_config(vc):
        if not torch.distributed.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{port}",
            )
            initialize_model_parallel(1, 1)
        tower = Qwen2_5_VisionTransformer(cfg, norm_eps=1e-6, prefix="visual")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return tower.to(dtype).eval(), cfg, vc


def count_qwen_vision(
    tower: Any, cfg: Any, vc: Any, grids: list[list[int]]
) -> QwenVisionCount:
    """Counts one tower call over images of patch grids ``grids``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionAttention
    from vllm.v1.attention.ops import vit_attn_wrappers

    from vllm_hpu_mm.attention.encoder import (
        attach_step_masks,
        uses_static_attention,
        window_patches,
    )

    n = sum(t * h * w for t, h, w in grids)
    width = 3 * cfg.temporal_patch_size * cfg.patch_size**2
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(1))
    counter = WorkCounter()
    counter.tag_module(tower, "weight")
    counter.inline[torch.ops.vllm.torch_sdpa_wrapper.default] = (
        vit_attn_wrappers.torch_sdpa_wrapper
    )
    handles = counter.scope_modules(tower, Qwen2_5_VisionAttention, "attention")
    try:
        with set_current_vllm_config(vc), torch.no_grad(), counter:
            metadata = tower.prepare_encoder_metadata(grids)
            if uses_static_attention(tower):  # the patch-bucket encoder's masks
                metadata = attach_step_masks(
                    metadata, n, torch.bfloat16, window_patches(tower)
                )
            tower(x.to(torch.bfloat16), None, encoder_metadata=metadata)
    finally:
        for h in handles:
            h.remove()
    merge, units = cfg.spatial_merge_size, WINDOW_PATCHES // cfg.spatial_merge_size
    full: list[int] = []
    window: list[int] = []
    for g in grids:
        f, w = qwen_segments(g, merge, units)
        full += f
        window += w
    n_full = len(cfg.fullatt_block_indexes)
    n_window = cfg.depth - n_full
    per_pair = 4 * cfg.hidden_size
    return QwenVisionCount(
        counts=counter.counts,
        min_attention_flops=per_pair
        * (n_full * sum(s * s for s in full) + n_window * sum(s * s for s in window)),
        min_weight_bytes=needed_weight_bytes(counter.counts, tower),
        layers=cfg.depth,
        segments=n_full * len(full) + n_window * len(window),
    )
