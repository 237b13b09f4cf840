"""Gaudi's fused RMSNorm and rotary embedding in vLLM's layers, without patching.

vLLM's ``CustomOp`` lets a platform plugin register an out-of-tree subclass of
a layer (``CustomOp.register_oot``): every ``RMSNorm(...)`` a model builds is
then made from the subclass, and on an out-of-tree platform its
``forward_oot`` runs when the op is enabled (``+RMSNorm`` in
``compilation_config.custom_ops``; see ``platform_config._enable_fused_ops``).

``forward_oot`` calls the fused kernel that ``device.py`` hands over (HPU), and
falls back to the layer's ``forward_native`` when there is none or the layer
uses an option the kernel lacks (no weight, a variance over fewer channels).
``register_fused_ops`` runs in the worker on HPU only, before the model is
built, so CPU and CUDA keep vLLM's classes untouched.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.llama3_rope import (
    Llama3RotaryEmbedding,
)

from hpu_kernels.fused import fused_rms_norm, fused_rope
from vllm_hpu_mm import device as dev

logger = logging.getLogger("vllm.hpu_mm.fused_ops")


class FusedRMSNorm(RMSNorm):
    """vLLM's RMSNorm through Gaudi's FusedRMSNorm."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_kernel = dev.rms_norm_kernel()

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernel = self.fused_kernel
        if kernel is None or not self.has_weight or self.variance_size_override:
            return self.forward_native(x, residual)
        return fused_rms_norm(
            kernel, x, self.weight.data, self.variance_epsilon, residual
        )


class FusedGemmaRMSNorm(GemmaRMSNorm):
    """vLLM's GemmaRMSNorm (``x * (1 + w)``, Gemma 2/3) through Gaudi's
    FusedRMSNorm, with the weight ``1 + w`` made in float32 as
    ``forward_native`` makes it (in bfloat16 ``1 + w`` would round ``w`` away)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_kernel = dev.rms_norm_kernel()

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernel = self.fused_kernel
        if kernel is None:
            return self.forward_native(x, residual)
        weight = self.weight.data.float() + 1.0
        return fused_rms_norm(kernel, x, weight, self.variance_epsilon, residual)


class _FusedRope:
    """``forward_oot`` of the rotary embeddings: Gaudi's fused RoPE kernel."""

    fused_kernel: Any

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rope: Any = self
        if self.fused_kernel is None:
            return rope.forward_native(positions, query, key)  # type: ignore[no-any-return]
        cache = rope._match_cos_sin_cache_dtype(query)
        return fused_rope(
            self.fused_kernel,
            positions,
            query,
            key,
            rope.head_size,
            rope.rotary_dim,
            cache,
            rope.is_neox_style,
        )


class FusedRotaryEmbedding(_FusedRope, RotaryEmbedding):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_kernel = dev.rope_kernel()


class FusedLlama3RotaryEmbedding(_FusedRope, Llama3RotaryEmbedding):
    """Llama 3 scaling only changes the cos/sin cache; the rotation is the same."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_kernel = dev.rope_kernel()


# in-tree class -> our subclass; the registered name is the in-tree class name
FUSED_OPS: dict[type, type] = {
    RMSNorm: FusedRMSNorm,
    GemmaRMSNorm: FusedGemmaRMSNorm,
    RotaryEmbedding: FusedRotaryEmbedding,
    Llama3RotaryEmbedding: FusedLlama3RotaryEmbedding,
}
FUSED_OP_NAMES = tuple(cls.__name__ for cls in FUSED_OPS)


def register_fused_ops() -> list[str]:
    """Register the fused subclasses with vLLM (idempotent); the names added."""
    added = []
    for base, fused in FUSED_OPS.items():
        if op_registry_oot.get(base.__name__) is fused:
            continue
        base.register_oot(fused)  # type: ignore[attr-defined]
        added.append(base.__name__)
    if added:
        logger.info("vllm-hpu-mm: fused Gaudi ops for %s", ", ".join(added))
    return added
