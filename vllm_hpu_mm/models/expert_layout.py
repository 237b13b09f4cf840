"""Fused expert tensors of Qwen3-VL-MoE checkpoints, in the layout vLLM loads
(torch only: importable without vLLM's model modules)."""

from __future__ import annotations

import torch


def published_expert_layout(
    name: str, weight: torch.Tensor, hidden: int, inter: int
) -> torch.Tensor:
    """A fused expert tensor in the published Qwen3-VL-MoE layout, which vLLM
    loads (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``).

    transformers 5 transposes those on load to its own ``[E, 2I, H]`` and
    ``[E, H, I]`` and ``save_pretrained`` writes them as it holds them, so a
    checkpoint saved by transformers has the other layout; it is told apart by
    shape (where the two dimensions are equal the layouts cannot differ in
    shape, and the published one is assumed)."""
    if name.endswith("mlp.experts.gate_up_proj"):
        saved = (2 * inter, hidden)
    elif name.endswith("mlp.experts.down_proj"):
        saved = (hidden, inter)
    else:
        return weight
    if saved[0] != saved[1] and tuple(weight.shape[1:]) == saved:
        return weight.transpose(1, 2)
    return weight
