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

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.dynamic_ntk_alpha_rope import (
    DynamicNTKAlphaRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.dynamic_ntk_scaling_rope import (
    DynamicNTKScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
    LinearScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.llama3_rope import (
    Llama3RotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.ntk_scaling_rope import (
    NTKScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import (
    YaRNScalingRotaryEmbedding,
)

from hpu_kernels.fused import (
    RopeKernel,
    fused_rms_norm,
    mrope_channel_rows,
    rope_cos_sin,
    rotate_fused,
)
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
    """``forward_oot`` of the rotary embeddings: Gaudi's fused RoPE kernel on
    cos/sin gathered once per step.

    Positions are the same for every layer of a step, and vLLM's ``get_rope``
    hands every layer of a model the same rotary module (one per distinct
    configuration: Gemma 3 has a local and a global one). ``StepRope`` (the
    graph runner, before the body) gathers each module's cos/sin from its cache
    once (``prepare_step``) and drops them afterwards (``end_step``); the
    layers' calls only rotate. Called outside a prepared step (a direct model
    call), a layer gathers for itself. The official plugin does the same:
    vllm-gaudi ``hpu_model_runner.py`` calls ``prepare_cos_sin(positions)`` on
    the model's rotary module before the model, ``ops/hpu_rotary_embedding.py``
    rotates with the stored ``cos``/``sin``. The scaled variants and M-RoPE
    differ only in their cache (and M-RoPE's section pick, ``rope_cos_sin``)."""

    fused_kernel: RopeKernel | None
    step_cos_sin: tuple[torch.Tensor, torch.Tensor] | None
    mrope_rows: torch.Tensor | None

    def _init_fused(self) -> None:
        self.fused_kernel = dev.rope_kernel()
        self.step_cos_sin = None  # cos, sin [T, 1, rotary_dim] of the running step
        if not hasattr(self, "mrope_rows"):
            self.mrope_rows = None

    def cos_sin(
        self, positions: torch.Tensor, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` (or M-RoPE ``[3, T]``) -> cos, sin
        ``[T, 1, rotary_dim]`` from ``cache``."""
        rope: Any = self
        rows = self.mrope_rows
        if rows is not None:
            rows = rows.to(positions.device)
        return rope_cos_sin(positions, cache, rope.is_neox_style, rows)

    def prepare_step(self, positions: torch.Tensor) -> None:
        """Gather the step's cos/sin (``positions [T]``, or ``[3, T]`` for
        M-RoPE); positions this module cannot take leave it to gather per call."""
        if positions.dim() == 2 and self.mrope_rows is None:
            return
        if self.fused_kernel is not None:
            rope: Any = self
            self.step_cos_sin = self.cos_sin(positions, rope.cos_sin_cache)

    def end_step(self) -> None:
        self.step_cos_sin = None

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rope: Any = self
        kernel = self.fused_kernel
        if kernel is None:
            return rope.forward_native(positions, query, key)  # type: ignore[no-any-return]
        step = self.step_cos_sin
        # The step's cos/sin serve a call on the step's rows in the same dtype
        # (static facts: no guard on values); anything else gathers its own.
        if (
            step is None
            or step[0].shape[0] != query.shape[0]
            or (step[0].dtype != query.dtype)
        ):
            step = self.cos_sin(positions, rope._match_cos_sin_cache_dtype(query))
        cos, sin = step
        return rotate_fused(
            kernel,
            cos,
            sin,
            query,
            key,
            rope.head_size,
            rope.rotary_dim,
            rope.is_neox_style,
        )


class FusedMRotaryEmbedding(_FusedRope, MRotaryEmbedding):
    """M-RoPE (Qwen2-VL, Qwen2.5-VL; Qwen3-VL's interleaved sections): each
    frequency channel's angle from one of the T/H/W position rows, picked by
    a constant channel -> row map; text-only positions ``[T]`` are plain RoPE."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rows = None
        if self.mrope_section:
            half = self.rotary_dim // 2
            channels = mrope_channel_rows(
                list(self.mrope_section), self.mrope_interleaved, half
            )
            rows = torch.tensor(channels, dtype=torch.int64)  # [rotary_dim / 2]
        # a buffer, so it lives on the model's device
        self.register_buffer("mrope_rows", rows, persistent=False)
        self._init_fused()


# vLLM's RotaryEmbedding and the subclasses that only change its cos/sin cache
# (the scaled variants): the rotation is the same.


class FusedRotaryEmbedding(_FusedRope, RotaryEmbedding):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_fused()


class FusedLlama3RotaryEmbedding(_FusedRope, Llama3RotaryEmbedding):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_fused()


class FusedLinearScalingRotaryEmbedding(_FusedRope, LinearScalingRotaryEmbedding):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_fused()


class FusedDynamicNTKScalingRotaryEmbedding(
    _FusedRope, DynamicNTKScalingRotaryEmbedding
):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_fused()


class FusedDynamicNTKAlphaRotaryEmbedding(_FusedRope, DynamicNTKAlphaRotaryEmbedding):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_fused()


class FusedNTKScalingRotaryEmbedding(_FusedRope, NTKScalingRotaryEmbedding):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_fused()


class FusedYaRNScalingRotaryEmbedding(_FusedRope, YaRNScalingRotaryEmbedding):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_fused()


class StepRope:
    """The fused rotary modules (those with a kernel: HPU) of ``layers`` (the
    decoder layers, the text model's: a vision tower's rotary module reads its
    cache itself and is left out), whose cos/sin are gathered once per step:
    ``with StepRope(layers).step(positions)`` around the model's body."""

    def __init__(self, layers: Iterable[torch.nn.Module]) -> None:
        found = {
            id(m): m
            for layer in layers
            for m in layer.modules()
            if isinstance(m, _FusedRope) and m.fused_kernel is not None
        }
        self.modules: list[_FusedRope] = list(found.values())

    @contextlib.contextmanager
    def step(self, positions: torch.Tensor) -> Iterator[None]:
        for m in self.modules:
            m.prepare_step(positions)
        try:
            yield
        finally:
            for m in self.modules:
                m.end_step()


# in-tree class -> our subclass; the registered name is the in-tree class name
FUSED_OPS: dict[type, type] = {
    RMSNorm: FusedRMSNorm,
    GemmaRMSNorm: FusedGemmaRMSNorm,
    RotaryEmbedding: FusedRotaryEmbedding,
    Llama3RotaryEmbedding: FusedLlama3RotaryEmbedding,
    LinearScalingRotaryEmbedding: FusedLinearScalingRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding: FusedDynamicNTKScalingRotaryEmbedding,
    DynamicNTKAlphaRotaryEmbedding: FusedDynamicNTKAlphaRotaryEmbedding,
    NTKScalingRotaryEmbedding: FusedNTKScalingRotaryEmbedding,
    YaRNScalingRotaryEmbedding: FusedYaRNScalingRotaryEmbedding,
    MRotaryEmbedding: FusedMRotaryEmbedding,
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
