"""bfloat16 linear layers on the CPU: prepacked oneDNN weights for decode rows.

On this platform vLLM's linear layers call ``F.linear``, which hands oneDNN a
plain ``[N, K]`` weight on every call. For few rows (decode steps) the call is
bound by reading the weight, and oneDNN reads its own blocked layout faster:
``torch.ops.mkldnn._reorder_linear_weight`` packs it once (the layout inductor's
weight freezing uses) and ``_linear_pointwise`` runs on it, bit-identical to
``F.linear``. Measured on 2 AMX cores at 32 rows: 768x4096 0.52 -> 0.38 ms,
2048x768 0.23 -> 0.14 ms; at 2048 rows the packed call is 5-8 % slower. So a
layer keeps both weights and picks by the rows of the call
(``PACKED_MAX_ROWS``): decode steps read the packed one, prefill steps the
plain one. That costs the weights' bytes once more in host memory.

The packed weight is an mkldnn-layout tensor, which inductor lowers only as a
frozen graph constant; our compiled regions take the weights as inputs (one
graph shared by every layer), so the call is an opaque custom op
(``hpu_mm::packed_linear``) with a shape-only fake, and the choice by rows is
made inside it, at run time, without a guard.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("vllm.hpu_mm.cpu_linear")

PACKED_MAX_ROWS = 64
"""Calls with at most this many rows use the packed weight."""


@torch.library.custom_op("hpu_mm::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; packed: the same weight reordered for
    oneDNN. Returns [..., N]."""
    if x.numel() // max(x.shape[-1], 1) <= PACKED_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


@packed_linear.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _packed_gemm(
    layer: torch.nn.Module,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    packed: torch.Tensor | None = getattr(layer, "hpu_mm_packed_weight", None)
    if packed is None:  # a layer left unpacked that shares the method object
        return F.linear(x, weight, bias)
    return torch.ops.hpu_mm.packed_linear(x, weight, packed, bias)


def supported() -> bool:
    """oneDNN with bfloat16 (AVX-512 BF16 or AMX) in this torch build."""
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Give every bfloat16 unquantized 2-D linear layer of ``model`` on the
    CPU a prepacked weight beside its own and the row-choosing call; returns
    how many layers were packed. A later ``model.load_weights`` (weights
    updated in place, as a reinforcement-learning worker does) packs them
    again, so decode never reads stale weights."""
    packed = _pack(model)
    load = getattr(model, "load_weights", None)
    if packed and callable(load) and not getattr(load, "_hpu_mm_repacks", False):

        def load_and_repack(*args: object, **kwargs: object) -> object:
            out = load(*args, **kwargs)
            _pack(model)
            return out

        load_and_repack._hpu_mm_repacks = True  # type: ignore[attr-defined]
        model.load_weights = load_and_repack  # type: ignore[method-assign,assignment]
    return packed


def _pack(model: torch.nn.Module) -> int:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    packed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if (
            not isinstance(method, UnquantizedLinearMethod)
            or not isinstance(weight, torch.Tensor)
            or weight.dtype != torch.bfloat16
            or weight.dim() != 2
            or weight.device.type != "cpu"
            or weight.is_meta
        ):
            continue
        module.hpu_mm_packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), None
        )
        method._gemm_impl = _packed_gemm  # type: ignore[attr-defined]
        packed += 1
    return packed
