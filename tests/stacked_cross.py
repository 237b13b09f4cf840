"""The cross-attention kernels called with their layer cache given as one
stacked ``[2, slots, rows, Hkv, D]`` tensor (index 0 keys, 1 values).

The kernels take a ``hpu_kernels.cross_attention.CrossCache`` (separate K and
V tensors); the kernel tests build and overwrite their caches as one stacked
tensor, which these wrappers pass as a ``CrossCache`` of views of it
(``cross_cache_of_stacked``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hpu_kernels import cross_attention as kernels
from hpu_kernels.cross_attention import CrossRequest


def cross_attention_decode(
    query: torch.Tensor, cache: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    stacked = kernels.cross_cache_of_stacked(cache)
    return kernels.cross_attention_decode(query, stacked, *args, **kwargs)


def cross_attention_prefill(
    query: torch.Tensor, cache: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    stacked = kernels.cross_cache_of_stacked(cache)
    return kernels.cross_attention_prefill(query, stacked, *args, **kwargs)


def cross_attention_requests(
    query: torch.Tensor,
    cache: torch.Tensor,
    requests: Sequence[CrossRequest],
    scale: float,
) -> torch.Tensor:
    stacked = kernels.cross_cache_of_stacked(cache)
    return kernels.cross_attention_requests(query, stacked, requests, scale)
