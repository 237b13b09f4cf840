"""Mixture-of-experts feed-forward over routed tokens, in pure PyTorch.

Each of ``T`` tokens is routed to ``k`` of ``E`` experts (``topk_ids[T, k]``,
``topk_weights[T, k]``). An expert is a gated MLP: ``w13[e]`` is ``[2I, H]``
(gate rows then up rows), ``w2[e]`` is ``[H, I]``.

``routed_experts`` is the form off Gaudi: the ``T * k`` (token, expert) pairs are
sorted by expert, each expert multiplies only the rows routed to it, and the
weighted rows are summed back per token. Its matmul work is ``T * k`` rows
through one expert each, the minimum (a dense form would run every token
through every expert: ``E / k`` times more). The sizes of the segments depend on
the routing, so the op is registered as ``hpu_mm::moe_experts``: a graph sees
one op with a static output shape (``[T, H]``, like ``x``) however the tokens
route, and no compilation follows a new routing.

Accumulation order per token follows the expert index, as transformers'
Qwen-MoE loop over experts does (``index_add_`` expert by expert), so float32
results agree to the last bits that matter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu",)


def routed_experts_impl(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k], expert indices into w13/w2
) -> torch.Tensor:  # [T, H]
    num_tokens, k = topk_ids.shape
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1)  # [P], P = T * k pairs, token-major
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    tokens = order // k  # [P] token row of each sorted pair
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = x.index_select(0, tokens)  # [P, H]
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        seg = rows[start : start + n]
        gate_up = seg @ w13[expert].t()  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out_rows[start : start + n] = act @ w2[expert].t()
        start += n
    weights = topk_weights.reshape(-1).index_select(0, order).to(out_rows.dtype)
    out_rows = out_rows * weights[:, None]
    out = torch.zeros(num_tokens, x.shape[1], dtype=x.dtype, device=x.device)
    return out.index_add_(0, tokens, out_rows)


routed_experts = torch.library.custom_op("hpu_mm::moe_experts", mutates_args=())(
    routed_experts_impl
)


@routed_experts.register_fake
def _(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return torch.empty_like(x)


def dense_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Every token through every expert, weights zero where not routed (the
    ``E / k`` times costlier form; tests compare against it)."""
    inter = w2.shape[2]
    num_experts = w13.shape[0]
    gate_up = torch.einsum("th,eoh->teo", x, w13)  # [T, E, 2I]
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    per_expert = torch.einsum("tei,ehi->teh", act, w2)  # [T, E, H]
    dense = torch.zeros(x.shape[0], num_experts, dtype=x.dtype, device=x.device)
    dense.scatter_add_(1, topk_ids.long(), topk_weights.to(x.dtype))
    return torch.einsum("teh,te->th", per_expert, dense)
