"""Vision-encoder attention on static shapes: vLLM's ``MMEncoderAttention``
replaced through ``CustomOp.register_oot``.

vLLM's CPU form of ``MMEncoderAttention`` (``torch_sdpa_wrapper``) reads the
segment offsets ``cu_seqlens`` back to the host and runs one SDPA per
segment, every layer. Where the execution plan says
``static_encoder_attention`` (the static plan, and every plan on Gaudi) this
subclass runs ``hpu_kernels.encoder_attention`` instead: one masked SDPA a
layer over the whole padded patch sequence (FusedSDPA on Gaudi, exact
softmax), the block-diagonal mask computed from the offsets as a tensor.
Elsewhere it is vLLM's layer unchanged. The plan is read once, when the
layer is built (under the engine's vLLM config).

The mask of a step is built once and shared: the patch-bucket encoder
(``worker.vision_buckets``) calls ``attach_step_masks`` on the tower's
metadata, which puts the additive mask in place of each offsets tensor
(``cu_seqlens``; Qwen2.5-VL's window layers: ``cu_window_seqlens``, whose
windows are small, in the banded form: query tiles against the keys around
them). The tower hands that tensor to every layer of its kind unchanged, and
the layer takes a 2-D ``cu_seqlens`` as the step's square mask, a 3-D one as
its banded mask. A tower called with
plain offsets (a single image above the largest bucket, run unpadded) gets
its mask built from them in each layer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.attention.mm_encoder_attention import (
    MMEncoderAttention,
)

from hpu_kernels.encoder_attention import (
    band_bias,
    banded_attention,
    encoder_attention,
    segment_bias,
)
from vllm_hpu_mm import device as dev

logger = logging.getLogger("vllm.hpu_mm.encoder_attention")

# Offsets in a tower's encoder metadata that ``attach_step_masks`` replaces,
# and the one whose segments are windows of a known largest size.
SEGMENT_KEYS = ("cu_seqlens", "cu_window_seqlens")
WINDOW_KEY = "cu_window_seqlens"

# FusedSDPA's exact softmax, as the official plugin calls it for vision towers
# (its default ``softmax_mode``).
ENCODER_SOFTMAX_MODE = "None"


class HpuMMEncoderAttention(MMEncoderAttention):
    """``MMEncoderAttention`` as one masked SDPA a layer when the plan says
    ``static_encoder_attention``; vLLM's layer otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from vllm_hpu_mm.plan import current_plan

        self.static = current_plan().static_encoder_attention
        self.sdpa = dev.sdpa_kernel(ENCODER_SOFTMAX_MODE)

    def forward_oot(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: torch.Tensor | None = None,
        sequence_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.static:
            return self._forward_sdpa(query, key, value, cu_seqlens)
        return self.forward_static(query, key, value, cu_seqlens)

    def forward_static(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """One masked SDPA over the whole sequence. ``cu_seqlens``: segment
        offsets ([S + 1]); a mask of the step from ``attach_step_masks``, the
        whole square's ([N, N]) or the banded form's ([NT, T, T + 2 halo]);
        or None (one segment). Inputs ``[B, N, H * D]`` or ``[B, N, H, D]``;
        the output has the input's layout."""
        bsz, n = query.shape[:2]
        flat = query.dim() != 4
        q, k, v = self.view_qkv_to_4d(query, key, value, bsz, n, key.shape[1])
        if cu_seqlens is not None and cu_seqlens.dim() == 3:
            out = banded_attention(q, k, v, cu_seqlens, self.scale, self.sdpa)
            return out.reshape(bsz, n, -1) if flat else out
        if cu_seqlens is None or cu_seqlens.dim() == 2:
            bias = cu_seqlens
        else:
            bias = segment_bias(cu_seqlens, n, q.dtype)
        out = encoder_attention(q, k, v, bias, self.scale, self.sdpa)
        return out.reshape(bsz, n, -1) if flat else out


def uses_static_attention(tower: torch.nn.Module) -> bool:
    """Whether ``tower``'s encoder attention layers run the static form."""
    return any(
        isinstance(m, HpuMMEncoderAttention) and m.static for m in tower.modules()
    )


def window_patches(tower: Any) -> int | None:
    """The most patches a window of ``tower`` holds (Qwen2.5-VL's window
    layers: ``window_size / patch_size`` patches a side, clipped at an
    image's edge, never larger), or None for a tower without windows."""
    size = getattr(tower, "window_size", None)
    patch = getattr(tower, "patch_size", None)
    merge = getattr(tower, "spatial_merge_size", None)
    if not (
        isinstance(size, int) and isinstance(patch, int) and isinstance(merge, int)
    ):
        return None
    units = size // merge // patch  # merged units a window's side
    return units * units * merge * merge if units > 0 else None


def attach_step_masks(
    metadata: dict[str, Any],
    num_patches: int,
    dtype: torch.dtype,
    window: int | None = None,
) -> dict[str, Any]:
    """``metadata`` with each segment-offsets tensor replaced by the step's
    additive mask, built once here for every layer that reads it: the whole
    ``[N, N]`` square, or for the window offsets when every window holds at
    most ``window`` patches and the band is narrower than the square, the
    banded form (tiles of ``window`` rows against ``3 * window - 2`` keys;
    ``hpu_kernels.encoder_attention.band_bias``)."""
    out = dict(metadata)
    for name in SEGMENT_KEYS:
        offsets = out.get(name)
        if not (isinstance(offsets, torch.Tensor) and offsets.dim() == 1):
            continue
        if name == WINDOW_KEY and window is not None and 3 * window < num_patches:
            out[name] = band_bias(offsets, num_patches, window, window, dtype)
        else:
            out[name] = segment_bias(offsets, num_patches, dtype)
    return out


def register_encoder_attention() -> bool:
    """Register ``HpuMMEncoderAttention`` with vLLM (idempotent; before the
    model is built); True when this call added it."""
    name = MMEncoderAttention.__name__
    if op_registry_oot.get(name) is HpuMMEncoderAttention:
        return False
    MMEncoderAttention.register_oot(HpuMMEncoderAttention)  # type: ignore[attr-defined]
    logger.info("vllm-hpu-mm: %s replaced by the static-shape form", name)
    return True
