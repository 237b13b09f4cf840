"""KV-cache specs, allocation and binding to the model's attention layers."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
)
from vllm.v1.worker.utils import bind_kv_cache

from hpu_kernels.attention import KVCache, blocks_of
from hpu_kernels.kv_fp8 import FP8_KV_DTYPE


def kv_cache_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """The KV-cache spec of every attention layer that keeps a cache.

    An FP8 cache (``--kv-cache-dtype fp8``): vLLM's spec names ``uint8`` (its
    CUDA kernels reinterpret the bytes); ours names ``float8_e4m3fn``, the
    tensors' dtype. Both are 1 byte, so vLLM sizes the same pages: twice the
    blocks of bfloat16 for the same memory."""
    specs: dict[str, KVCacheSpec] = {}
    layers = get_layers_from_vllm_config(vllm_config, cast(Any, Attention))
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue
        if (
            isinstance(spec, AttentionSpec)
            and spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
        ):
            spec = dataclasses.replace(spec, dtype=FP8_KV_DTYPE)
        specs[name] = spec
    return specs


def new_kv_cache(spec: AttentionSpec, num_blocks: int, device: torch.device) -> KVCache:
    """One layer's zeroed cache: a K and a V tensor of ``[num_blocks *
    block_size, Hkv, D]``, allocated separately (not views of one tensor:
    inside an ``hpu_backend`` graph each is then an input of its own, written
    in place; ``hpu_kernels.attention.KVCache``). The official plugin
    allocates the same pair per layer (vllm-gaudi ``hpu_model_runner.py``
    ``initialize_kv_cache``: ``key_cache``, ``value_cache``).

    Zeroed so that never-written slots (the null block, fresh blocks) hold
    finite values: masked scores times NaN would still poison the output.
    """
    shape = (num_blocks * spec.block_size, spec.num_kv_heads, spec.head_size)
    key = torch.zeros(shape, dtype=spec.dtype, device=device)
    value = torch.zeros(shape, dtype=spec.dtype, device=device)
    return KVCache(key, value, spec.block_size)


def kv_cache_bytes(caches: dict[str, KVCache]) -> int:
    return sum(t.numel() * t.element_size() for kv in caches.values() for t in kv[:2])


def allocate_kv_caches(
    vllm_config: VllmConfig, config: KVCacheConfig, device: torch.device
) -> dict[str, KVCache]:
    """One zeroed ``KVCache`` per layer (``new_kv_cache``), bound to the
    layers (``layer.kv_cache``)."""
    caches: dict[str, KVCache] = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise NotImplementedError(
                f"KV-cache spec {type(spec).__name__} is not supported "
                "(vllm-hpu-mm serves attention-only models)"
            )
        for name in group.layer_names:
            caches[name] = new_kv_cache(spec, config.num_blocks, device)
    runner_list: list[torch.Tensor] = []
    bind_kv_cache(
        cast(dict[str, torch.Tensor], caches),
        vllm_config.compilation_config.static_forward_context,
        runner_list,
        kv_cache_groups=config.kv_cache_groups,
    )
    return caches


def zero_blocks(caches: dict[str, KVCache], block_ids: list[int]) -> None:
    """Clear blocks the scheduler asks to be zeroed before reuse."""
    if not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.int64)
    for kv in caches.values():
        for cache in (kv.key, kv.value):
            if cache.dtype == FP8_KV_DTYPE:  # no FP8 index_fill_ on the CPU
                cache = cache.view(torch.uint8)  # zero bytes: FP8 0.0
            blocks_of(cache, kv.block_size).index_fill_(0, index.to(cache.device), 0)
