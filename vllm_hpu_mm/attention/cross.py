"""Cross-attention of the plugin's attention backend (Mllama's gated layers).

The step's ``HpuMMAttentionMetadata.cross`` (built by the runner's
``worker.cross_attention``) says which cached image slots each token row reads.
The layers call ``hpu_mm::cross_attention``, an opaque op like vLLM's attention
op: it reads the step's metadata and the layer's cross-attention cache from the
forward context, so a compiled model body keeps one graph per token bucket
whatever images the step carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.forward_context import get_forward_context

from hpu_kernels.cross_attention import (
    CrossRequest,
    cross_attention_decode,
    cross_attention_prefill,
    cross_attention_requests,
)


@dataclass
class CrossAttentionMetadata:
    """Row layout as ``HpuMMAttentionMetadata``: decode rows, then prefill rows."""

    dec_slots: torch.Tensor  # [num_decodes, M] int64 image slots (0 = null)
    dec_tile_mask: torch.Tensor  # [num_decodes, M, tiles] bool
    pre_slots: torch.Tensor  # [N] int64: the step's prefill images, padded
    pre_tile_mask: torch.Tensor  # [num_prefill_tokens, N, tiles] bool
    active: torch.Tensor  # [num_tokens, 1]: 1 where the request has images
    mlp_scale: torch.Tensor  # [num_tokens, 1]: 0 before a request's first image
    # Real rows of a tile; the cache holds the encoder's padded rows per tile
    # (``vision.rows_per_tile``), of which the rest are never read.
    patches: int | None = None
    # Off Gaudi: the prefill requests, each reading only its own images
    # (``cross_attention_requests``; the flat layout above is then empty,
    # N = 0); None: the flat layout.
    pre_requests: list[CrossRequest] | None = None


def cross_layer_registry(
    static_forward_context: dict, name: str, layer: object
) -> None:
    if name in static_forward_context:
        raise ValueError(f"duplicate layer name {name!r}")
    static_forward_context[name] = layer


@torch.library.custom_op("hpu_mm::cross_attention", mutates_args=())
def cross_attention(
    query: torch.Tensor, layer_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [T, H, D] -> (output [T, H*D], active [T, 1], mlp_scale [T, 1])."""
    ctx = get_forward_context()
    md = ctx.attn_metadata
    cross: CrossAttentionMetadata | None = getattr(md, "cross", None)
    t, h, d = query.shape
    if cross is None:  # memory profiling, or a step with no cross metadata
        zeros = query.new_zeros(t, 1)
        return query.new_zeros(t, h * d), zeros, zeros.clone()
    layer = ctx.no_compile_layers[layer_name]
    cache, scale = layer.cache, layer.scale
    out = query.new_zeros(t, h, d)
    n_dec = md.num_decodes  # type: ignore[union-attr]
    n_pre = md.num_prefill_tokens  # type: ignore[union-attr]
    if n_dec:
        out[:n_dec] = cross_attention_decode(
            query[:n_dec],
            cache,
            cross.dec_slots,
            cross.dec_tile_mask,
            scale,
            cross.patches,
        )
    if n_pre and cross.pre_requests is not None:
        out[n_dec : n_dec + n_pre] = cross_attention_requests(
            query[n_dec : n_dec + n_pre], cache, cross.pre_requests, scale
        )
    elif n_pre and cross.pre_slots.numel():
        out[n_dec : n_dec + n_pre] = cross_attention_prefill(
            query[n_dec : n_dec + n_pre],
            cache,
            cross.pre_slots,
            cross.pre_tile_mask,
            scale,
            cross.patches,
        )
    return (
        out.view(t, h * d),
        cross.active.to(query.dtype).clone(),
        cross.mlp_scale.to(query.dtype).clone(),
    )


@cross_attention.register_fake
def _(query: torch.Tensor, layer_name: str) -> tuple[torch.Tensor, ...]:
    t, h, d = query.shape
    return query.new_empty(t, h * d), query.new_empty(t, 1), query.new_empty(t, 1)
