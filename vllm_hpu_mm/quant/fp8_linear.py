"""FP8 linear layers: the weights vLLM's FP8 methods create, kept FP8, and the
matmul of this device (``hpu_kernels.fp8``).

Shared by ``fp8`` (vLLM's ``Fp8Config``) and ``compressed-tensors`` FP8: both
create ``weight [N, K]`` in ``float8_e4m3fn`` and a float32 scale, per logical
shard (``[S]``: a fused QKV or gate-up layer has one per shard), per output row
(``[N, 1]``) or per block (``[ceil(N/bn), ceil(K/bk)]``), and for a static
activation scheme an ``input_scale`` per shard.

After loading, per-shard scales become one scale per output row: exact, where
vLLM's CUDA path requantizes the shards to their largest scale (which changes
the weights' values). Static input scales become their maximum, as in vLLM
(every shard of a fused layer sees the same input).

The matmul (``apply``):

- on Gaudi, per-tensor and per-row weight scales: the activations are quantized
  (per token, dynamically, or with the static ``input_scale``) and both FP8
  operands go through ``torch.ops.hpu.fp8_gemm_v2``, as vllm-gaudi's
  ``apply_fp8_linear_hpu``;
- on Gaudi with block scales, and everywhere else: the weight is dequantized
  for the call and the activations stay as they are (vllm-gaudi dequantizes
  block-scaled weights the same way, ``apply_block_fp8_linear_hpu_dequant``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.layers.quantization.utils.fp8_utils import (
    create_fp8_input_scale,
    create_fp8_scale_parameter,
    create_fp8_weight_parameter,
    validate_fp8_block_shape,
)
from vllm.model_executor.parameter import (
    BlockQuantScaleParameter,
    ChannelQuantScaleParameter,
    PerTensorScaleParameter,
)
from vllm.model_executor.utils import replace_parameter

from hpu_kernels import fp8
from vllm_hpu_mm import device

# The scale layouts a checkpoint may give.
SCALE_KINDS = ("tensor", "channel", "block")
_PARAMETER_TYPES: dict[str, Any] = {
    "tensor": PerTensorScaleParameter,
    "channel": ChannelQuantScaleParameter,
    "block": BlockQuantScaleParameter,
}


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """One FP8 layout, as a checkpoint's quantization config describes it."""

    scale_kind: str  # one of SCALE_KINDS
    block: tuple[int, int] | None  # (bn, bk) for "block"
    static_input: bool  # the checkpoint gives input_scale (W8A8 static)
    quantize_input: bool  # W8A8 (False: weight-only, W8A16)
    scale_name: str = "weight_scale"  # Fp8Config's block scale: weight_scale_inv


def create_weights(
    scheme: Fp8Scheme,
    layer: Any,
    input_size_per_partition: int,
    output_partition_sizes: list[int],
    input_size: int,
    output_size: int,
    weight_loader: Any,
) -> None:
    """Register ``weight`` (FP8), its scale and, if static, ``input_scale``."""
    layer.logical_widths = output_partition_sizes
    layer.input_size_per_partition = input_size_per_partition
    layer.output_size_per_partition = sum(output_partition_sizes)
    layer.weight_block_size = list(scheme.block) if scheme.block else None
    if scheme.block is not None:
        validate_fp8_block_shape(
            layer,
            input_size,
            output_size,
            input_size_per_partition,
            output_partition_sizes,
            list(scheme.block),
        )
    weight = create_fp8_weight_parameter(
        sum(output_partition_sizes), input_size_per_partition, weight_loader
    )
    layer.register_parameter("weight", weight)
    scale = create_fp8_scale_parameter(
        _PARAMETER_TYPES[scheme.scale_kind],
        output_partition_sizes,
        input_size_per_partition,
        list(scheme.block) if scheme.block else None,
        weight_loader,
    )
    layer.register_parameter(scheme.scale_name, scale)
    if scheme.static_input:
        layer.register_parameter(
            "input_scale", create_fp8_input_scale(output_partition_sizes, weight_loader)
        )


def process_weights(scheme: Fp8Scheme, layer: Any) -> None:
    """Scales into the form ``apply`` uses (see the module docstring); the
    weight stays the loaded FP8 tensor."""
    scale = getattr(layer, scheme.scale_name).data.float()
    if scheme.scale_kind == "tensor" and scale.numel() > 1:
        # [S] per shard -> [N, 1] per output row
        widths = torch.tensor(layer.logical_widths, device=scale.device)
        scale = scale.repeat_interleave(widths).reshape(-1, 1)
    elif scheme.scale_kind == "channel":
        scale = scale.reshape(-1, 1)
    if scheme.scale_name != "weight_scale":
        delattr(layer, scheme.scale_name)
        layer.register_parameter(
            "weight_scale", torch.nn.Parameter(scale, requires_grad=False)
        )
    else:
        replace_parameter(layer, "weight_scale", scale)
    replace_parameter(layer, "weight", layer.weight.data)
    if scheme.static_input:
        replace_parameter(layer, "input_scale", layer.input_scale.data.max().float())
    else:
        layer.input_scale = None
    # Looked up once, here: a compiled forward reads the attribute as a constant
    # (a device query traced by Dynamo would break the graph).
    layer.fp8_ops = device.fp8_ops()


def apply(
    scheme: Fp8Scheme,
    layer: Any,
    x: torch.Tensor,  # [..., K]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [..., N]
    ops = layer.fp8_ops  # device.fp8_ops(), set by process_weights
    if ops is None or scheme.block is not None or not scheme.quantize_input:
        return fp8.linear_dequantized(
            x, layer.weight, layer.weight_scale, scheme.block, bias
        )
    x2 = x.reshape(-1, x.shape[-1])  # [T, K]
    if layer.input_scale is None:  # dynamic, per token: [T, 1]
        x_scale = (
            x2.abs().amax(-1, keepdim=True).float() + fp8.SCALE_EPS
        ) / fp8.FP8_MAX
    else:
        x_scale = layer.input_scale
    x_fp8 = ops.cast(x2, 1.0 / x_scale, False, False, fp8.FP8_DTYPE)[0]
    out = ops.gemm(
        A=x_fp8,
        trans_A=False,
        B=layer.weight,  # [N, K]
        trans_B=True,
        D=None,
        out_dtype=x.dtype,
        A_scale_inv=x_scale,
        B_scale_inv=layer.weight_scale,
        bias=bias,
        accumulate=False,
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])
