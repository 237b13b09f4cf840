"""KV-cache specs, allocation and binding to the model's attention layers."""

from __future__ import annotations

from typing import Any, cast

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.worker.utils import bind_kv_cache


def kv_cache_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """The KV-cache spec of every attention layer that keeps a cache."""
    specs: dict[str, KVCacheSpec] = {}
    layers = get_layers_from_vllm_config(vllm_config, cast(Any, Attention))
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is not None:
            specs[name] = spec
    return specs


def allocate_kv_caches(
    vllm_config: VllmConfig, config: KVCacheConfig, device: torch.device
) -> dict[str, torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, Hkv, D]`` tensor per layer.

    Zeroed so that never-written slots (the null block, fresh blocks) hold
    finite values: masked scores times NaN would still poison the output.
    """
    caches: dict[str, torch.Tensor] = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise NotImplementedError(
                f"KV-cache spec {type(spec).__name__} is not supported "
                "(vllm-hpu-mm serves attention-only models)"
            )
        shape = (
            2,
            config.num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_size,
        )
        for name in group.layer_names:
            caches[name] = torch.zeros(shape, dtype=spec.dtype, device=device)
    runner_list: list[torch.Tensor] = []
    bind_kv_cache(
        caches,
        vllm_config.compilation_config.static_forward_context,
        runner_list,
        kv_cache_groups=config.kv_cache_groups,
    )
    return caches


def zero_blocks(caches: dict[str, torch.Tensor], block_ids: list[int]) -> None:
    """Clear blocks the scheduler asks to be zeroed before reuse."""
    if not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.int64)
    for cache in caches.values():
        cache.index_fill_(1, index.to(cache.device), 0)
