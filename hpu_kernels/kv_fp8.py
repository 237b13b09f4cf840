"""The FP8 KV cache's two conversions, in pure PyTorch (``--kv-cache-dtype fp8``).

A cache of ``torch.float8_e4m3fn`` holds ``k / k_scale`` (and ``v / v_scale``),
one float32 scale per layer and tensor: vLLM's ``Attention`` layer's
``_k_scale`` / ``_v_scale`` (1.0, or the checkpoint's ``k_scale`` /
``v_scale``). Written: the value divided by its scale, saturated to the e4m3
range (+-448: e4m3fn has no infinity, and a device whose cast does not
saturate makes an out-of-range value NaN), then rounded to nearest even.
Read: the FP8 value times its scale, formed in float32, then cast to the
compute dtype. Both are elementwise, so they keep every shape static.

On Gaudi the same two steps run as Habana's cast ops (``vllm_hpu_mm.device.
kv_fp8_casts``), as the official plugin's FP8 KV cache does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448.0

QuantizeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x, scale []) -> x / scale`` in FP8, saturated."""
DequantizeFn = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
"""``(x_fp8, scale [], dtype) -> x_fp8 * scale`` in ``dtype``."""


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [..., D] any float dtype; scale: [] float32 -> [..., D] float8_e4m3fn."""
    scaled = x.float() / scale
    return scaled.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """x: [...] float8_e4m3fn; scale: [] float32 -> [...] in ``dtype``."""
    return (x.float() * scale).to(dtype)


class KVQuant(NamedTuple):
    """How one layer's FP8 cache converts: its two scales and the device's
    casts (``quantize_kv`` / ``dequantize_kv``, or Habana's ops on HPU)."""

    k_scale: torch.Tensor  # [] float32
    v_scale: torch.Tensor  # [] float32
    quantize: QuantizeFn = quantize_kv
    dequantize: DequantizeFn = dequantize_kv


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache.index_copy_(0, slots, rows)`` for any cache dtype. PyTorch's CPU
    ``index_copy_`` has no FP8 kernel; an FP8 cache is written through its
    ``uint8`` view (the same bytes). For eager callers and opaque ops only: in
    a traced graph the view would make the write a copy of the whole cache.
    """
    if cache.dtype == FP8_KV_DTYPE and cache.device.type == "cpu":
        cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows)
