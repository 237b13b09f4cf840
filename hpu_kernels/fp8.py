"""FP8 (``float8_e4m3fn``) linear layers in pure PyTorch.

A checkpoint's FP8 weight ``w [N, K]`` stands for ``w * scale``, with the scale
either one float per tensor (``[]`` or ``[1]``), one per output row (``[N]`` or
``[N, 1]``, compressed-tensors' channel strategy), or one per ``bn x bk`` block
(``[ceil(N / bn), ceil(K / bk)]``, vLLM's ``weight_block_size``, as published
Qwen FP8 checkpoints use; the edge blocks may be partial).

Off Gaudi the layer dequantizes per call: ``w.to(dtype) * scale`` with block
scales expanded to ``[N, K]`` by ``repeat_interleave`` over the static weight
shape, then ``F.linear``. Every shape depends only on the weight, never on the
tokens, so a compiled graph sees the same ops at every batch size. The weight
stays FP8 in memory (1 byte per element); the dequantized copy lives for the
call only.

On Gaudi, activations are quantized too (``quantize_per_token`` dynamically, or
with the checkpoint's static ``input_scale``) and both FP8 operands go to
Habana's ``fp8_gemm_v2`` (``vllm_hpu_mm.device.fp8_ops``), as the official
plugin's ``apply_fp8_linear_hpu`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# vllm-gaudi's dynamic_quant: scale = (amax + 1e-8) / FP8_MAX per row.
SCALE_EPS = 1e-8


def expand_scale(
    scale: torch.Tensor,  # [], [1], [N], [N, 1] or [ceil(N/bn), ceil(K/bk)]
    shape: tuple[int, int],  # the weight's [N, K]
    block: tuple[int, int] | None,  # (bn, bk) for block scales
) -> torch.Tensor:
    """The scale broadcastable against the weight ``[N, K]``."""
    n, k = shape
    if block is None:
        if scale.numel() == 1:
            return scale.reshape(1, 1)
        if scale.numel() == n:
            return scale.reshape(n, 1)
        raise ValueError(
            f"FP8 weight scale of shape {tuple(scale.shape)} fits neither one "
            f"scale per tensor nor one per output row of a [{n}, {k}] weight"
        )
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    if tuple(scale.shape) != (rows, cols):
        raise ValueError(
            f"FP8 block scale of shape {tuple(scale.shape)} does not fit a "
            f"[{n}, {k}] weight in [{bn}, {bk}] blocks: expected "
            f"[ceil({n}/{bn}), ceil({k}/{bk})] = [{rows}, {cols}]"
        )
    # [rows, cols] -> [rows*bn, cols*bk] -> cut to [N, K] (partial edge blocks)
    full = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return full[:n, :k]


def dequantize(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] in dtype
    """``weight * scale`` in ``dtype`` (the product is formed in float32)."""
    full = expand_scale(scale.float(), (weight.shape[0], weight.shape[1]), block)
    return (weight.float() * full).to(dtype)


def linear_dequantized(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [..., N] in x.dtype
    """``x @ (weight * scale).T + bias``, the weight dequantized for this call."""
    return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)


def quantize_per_token(
    x: torch.Tensor,  # [T, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] fp8, [T, 1] float32)
    """Dynamic per-token FP8 quantization, vllm-gaudi's ``dynamic_quant``:
    ``scale = (max |x_row| + 1e-8) / 448``, ``x_fp8 = x / scale``."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() + SCALE_EPS) / FP8_MAX
    return quantize_static(x, scale), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to the FP8 range, then cast (round to nearest
    even); the scale is a checkpoint's ``input_scale`` or a per-row one."""
    scaled = x.float() / scale.float()
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
