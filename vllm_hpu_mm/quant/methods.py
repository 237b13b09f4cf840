"""vLLM's ``fp8`` and ``compressed-tensors`` configs, with the plugin's FP8
linear layers (``fp8_linear``).

vLLM's own FP8 linear methods pick a CUDA, ROCm or CPU scaled-matmul kernel
(``init_fp8_linear_kernel``) that an out-of-tree platform does not have. Each
config here subclasses vLLM's and hands its linear layers to ``fp8_linear``
instead; ``register_quantization`` puts the subclasses in place of vLLM's under
the same names (vLLM's ``register_quantization_config``), in the worker,
before the model is built. Everything else (parsing the checkpoint's
``quantization_config``, ignored layers, the KV-cache scale method) is vLLM's.

Refused at load, with the layer named: FP8 MoE experts, and compressed-tensors
schemes other than FP8 weights (W8A8 with static per-tensor or dynamic
activation scales, or W8A16).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
    CompressedTensorsScheme,
)
from vllm.model_executor.layers.quantization.fp8 import Fp8Config

from vllm_hpu_mm.quant import fp8_linear
from vllm_hpu_mm.quant.fp8_linear import Fp8Scheme

logger = logging.getLogger("vllm.hpu_mm.quant")

SUPPORTED_QUANTIZATION = ("fp8", "compressed-tensors")
ACT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _refuse_moe(prefix: str, method: str) -> None:
    raise NotImplementedError(
        f"vllm-hpu-mm does not run {method} mixture-of-experts layers (layer "
        f"{prefix!r}): FP8 is served for dense linear layers only; use the "
        "model's unquantized checkpoint"
    )


@register_weight_loader_v2_supported_method
class HpuMMFp8LinearMethod(LinearMethodBase):
    """A linear layer of an ``fp8`` checkpoint on ``fp8_linear``. Its scales
    are vLLM's scale parameters, which only vLLM's second weight loader
    (``weight_loader_v2``) places per shard: the decorator lists the class
    (by name) among the methods that use it, as vLLM's ``Fp8LinearMethod``."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self,
        layer: Any,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        layer.orig_dtype = params_dtype
        fp8_linear.create_weights(
            self.scheme,
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            extra_weight_attrs.get("weight_loader"),
        )

    def process_weights_after_loading(self, layer: Any) -> None:
        fp8_linear.process_weights(self.scheme, layer)

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return fp8_linear.apply(self.scheme, layer, x, bias)


class HpuMMFp8Config(Fp8Config):
    """vLLM's ``fp8``: per-tensor or block-wise (``weight_block_size``) weight
    scales, static or dynamic activation scales."""

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return ACT_DTYPES

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        method = super().get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase) and type(method).__name__ == "Fp8LinearMethod":
            block = self.weight_block_size
            return HpuMMFp8LinearMethod(
                Fp8Scheme(
                    scale_kind="block" if block else "tensor",
                    block=(int(block[0]), int(block[1])) if block else None,
                    static_input=self.activation_scheme == "static",
                    quantize_input=True,
                    scale_name="weight_scale_inv" if block else "weight_scale",
                )
            )
        if isinstance(layer, RoutedExperts) and type(method).__name__ != (
            "UnquantizedFusedMoEMethod"
        ):
            _refuse_moe(prefix, "fp8")
        return method


class HpuMMW8A8Fp8(CompressedTensorsScheme):
    """A compressed-tensors FP8 linear layer on ``fp8_linear``."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    def create_weights(self, layer: Any, **kwargs: Any) -> None:
        layer.orig_dtype = kwargs["params_dtype"]
        fp8_linear.create_weights(
            self.scheme,
            layer,
            kwargs["input_size_per_partition"],
            kwargs["output_partition_sizes"],
            kwargs["input_size"],
            kwargs["output_size"],
            kwargs["weight_loader"],
        )

    def process_weights_after_loading(self, layer: Any) -> None:
        fp8_linear.process_weights(self.scheme, layer)

    def apply_weights(
        self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fp8_linear.apply(self.scheme, layer, x, bias)


class HpuMMCompressedTensorsConfig(CompressedTensorsConfig):
    """vLLM's ``compressed-tensors``, FP8 weight schemes only."""

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return ACT_DTYPES

    def _get_scheme_from_parts(  # type: ignore[override]
        self,
        weight_quant: Any,
        input_quant: Any,
        output_quant: Any = None,
        format: str | None = None,
        layer_name: str | None = None,
    ) -> CompressedTensorsScheme:
        w8a8 = self._is_fp8_w8a8(weight_quant, input_quant)
        if not (
            w8a8 or (input_quant is None and self._is_fp8_w8a16(weight_quant, None))
        ):
            raise NotImplementedError(
                f"vllm-hpu-mm runs compressed-tensors FP8 weights only (W8A8 "
                "with per-tensor static or dynamic activation scales, or "
                f"W8A16); layer {layer_name!r} has weights {weight_quant} and "
                f"activations {input_quant}"
            )
        kind = str(getattr(weight_quant.strategy, "value", weight_quant.strategy))
        block = weight_quant.block_structure if kind == "block" else None
        return HpuMMW8A8Fp8(
            Fp8Scheme(
                scale_kind=kind,
                block=(int(block[0]), int(block[1])) if block else None,
                static_input=bool(w8a8 and not input_quant.dynamic),
                quantize_input=w8a8,
            )
        )

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        if isinstance(layer, RoutedExperts) and self.get_scheme_dict(layer, prefix):
            _refuse_moe(prefix, "compressed-tensors")
        return super().get_quant_method(layer, prefix)


_REGISTERED = False


def register_quantization() -> None:
    """Put the plugin's configs in place of vLLM's ``fp8`` and
    ``compressed-tensors`` (idempotent; before the model is built)."""
    global _REGISTERED
    if _REGISTERED:
        return
    register_quantization_config("fp8")(HpuMMFp8Config)
    register_quantization_config("compressed-tensors")(HpuMMCompressedTensorsConfig)
    _REGISTERED = True
