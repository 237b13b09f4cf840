"""The attention kernels called with their layer cache given as one stacked
``[2, num_blocks, block_size, Hkv, D]`` tensor (index 0 keys, 1 values).

The kernels take a ``hpu_kernels.attention.KVCache`` (separate K and V
tensors); the kernel tests build, read and overwrite their scenarios' caches
as one stacked tensor, which these wrappers pass as a ``KVCache`` of views of
it (``kv_cache_of_stacked``: eager, so writes land in the stacked tensor).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from hpu_kernels import attention


def _on_stacked(kernel: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(kernel)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        cache = bound.arguments["kv_cache"]
        if isinstance(cache, torch.Tensor):
            bound.arguments["kv_cache"] = attention.kv_cache_of_stacked(cache)
        return kernel(*bound.args, **bound.kwargs)

    call.__doc__ = kernel.__doc__
    return call


write_kv = _on_stacked(attention.write_kv)
prefill_attention = _on_stacked(attention.prefill_attention)
causal_prefill_attention = _on_stacked(attention.causal_prefill_attention)
decode_attention = _on_stacked(attention.decode_attention)
batched_decode_attention = _on_stacked(attention.batched_decode_attention)
request_prefill_attention = _on_stacked(attention.request_prefill_attention)
dense_decode_attention = _on_stacked(attention.dense_decode_attention)
