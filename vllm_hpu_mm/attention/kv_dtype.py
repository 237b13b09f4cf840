"""Which ``--kv-cache-dtype`` the plugin serves, and the FP8 cache's scales.

``fp8`` / ``fp8_e4m3``: the paged cache is ``torch.float8_e4m3fn`` (1 byte per
element: twice the blocks of a bfloat16 cache, four times a float32 one, for
the same memory), written as ``k / k_scale`` and read back times the scale
(``hpu_kernels.kv_fp8``). The scales are vLLM's: the ``Attention`` layer's
``_k_scale`` / ``_v_scale`` buffers, 1.0 unless the checkpoint's quantization
method loads ``k_scale`` / ``v_scale`` (vLLM's ``BaseKVCacheMethod``). vLLM
0.33 has no option that computes scales from the first batch (its former
``calculate_kv_scales`` is gone), so there is none to refuse.
"""

from __future__ import annotations

from typing import Any

import torch

FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
SUPPORTED_KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    *FP8_KV_CACHE_DTYPES,
)

_WHY_NOT = {
    "fp8_e5m2": "E5M2 keeps 2 mantissa bits; the FP8 cache is E4M3 (3 bits), "
    "as the official Gaudi plugin's",
    "fp8_inc": "Intel Neural Compressor's calibrated FP8 is not part of this "
    "plugin; fp8 takes the checkpoint's k_scale / v_scale (or 1.0)",
}


def kv_cache_dtype_problem(cache_dtype: str, skip_layers: list[str]) -> str | None:
    """What is wrong with ``--kv-cache-dtype`` (None: served), for the
    start-up refusal (``platform_config``)."""
    if cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        why = _WHY_NOT.get(cache_dtype)
        return (
            f"--kv-cache-dtype {cache_dtype!r}"
            + (f" ({why})" if why else "")
            + f"; supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )
    if cache_dtype in FP8_KV_CACHE_DTYPES and skip_layers:
        return (
            f"--kv-cache-dtype-skip-layers {skip_layers} with an FP8 KV cache "
            "(every layer's cache must be FP8: one page size)"
        )
    return None


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in FP8_KV_CACHE_DTYPES


def layer_scales(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V scales, ``[]`` float32 buffers (vLLM's
    ``set_default_quant_scales`` / ``BaseKVCacheMethod``), on the layer's
    device: read inside a traced graph as inputs, not as constants."""
    return layer._k_scale, layer._v_scale
