"""Mixture-of-experts layers (vLLM's ``FusedMoE``) on the plugin's own kernel.

On an out-of-tree platform vLLM's unquantized MoE method picks no kernel of its
own (its backend oracle answers ``OOT``) and expects the plugin to supply one:
``register_moe_method`` registers ``HpuMMFusedMoEMethod`` in its place through
vLLM's ``CustomOp.register_oot``, so every ``FusedMoE`` a model builds uses it.
The method is "monolithic" in vLLM's terms: it takes the router logits and
routes itself (softmax, top-k, renormalised where the model asks, as
transformers' Qwen-MoE does: float32 softmax, weights cast to the activations'
dtype), because vLLM's own routers for a non-CPU platform call compiled kernels
that a build without them lacks; then it runs the routed experts: on Gaudi
through Habana's MoE op, ``torch.ops.hpu.mixture_of_experts``, called as the
official Gaudi plugin calls it (``device.habana_moe``); on every other device
through ``hpu_kernels.moe`` (``hpu_mm::moe_experts``), whose work follows the
tokens each expert receives. Which one is decided once per layer, after
loading, from the device (``layer.habana_moe``, None off Gaudi).
Tensor parallelism needs nothing more: each rank holds its slice of every
expert's intermediate dimension and vLLM's layer all-reduces the partial sums.
Expert parallelism (``--enable-expert-parallel``) on Gaudi: each rank holds
whole experts, a contiguous range of them (vLLM's ``linear`` placement), and
passes that range to Habana's op as ``experts_min`` / ``experts_max`` with the
routing table of global expert ids, as vllm-gaudi does; the op skips the
experts of other ranks and vLLM's layer all-reduces.

What the method refuses, at load: routing other than softmax top-k (grouped
top-k, sigmoid scoring, a correction bias, a custom routing function, a scaling
factor), activations other than SiLU-gated, expert biases, expert parallelism
off Gaudi or with experts not in one contiguous range per rank (an
``expert_map`` the op's range cannot express) and routing weights applied to
the input; each named in the message.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from hpu_kernels.moe import routed_experts
from vllm_hpu_mm import device

logger = logging.getLogger("vllm.hpu_mm.moe")


class HpuMMFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method with the experts on ``hpu_mm::moe_experts``."""

    @property
    def is_monolithic(self) -> bool:
        # Router logits in, expert output out: routing and experts are ours.
        return True

    def process_weights_after_loading(self, layer: Any) -> None:
        super().process_weights_after_loading(layer)
        # Looked up once, here: a compiled forward reads the attributes as
        # constants (a device query traced by Dynamo would break the graph).
        layer.habana_moe = device.habana_moe()
        _check_supported(layer, self.moe)
        layer.habana_experts_min = local_experts_min(layer)
        # vLLM builds the (empty) quant config on the first forward; built here,
        # it is not traced into a graph (on HPU Dynamo failed inside it).
        if self.moe_quant_config is None:
            self.moe_quant_config = self.get_fused_moe_quant_config(layer)

    def apply_monolithic(  # type: ignore[override]
        self,
        layer: Any,
        x: torch.Tensor,  # [T, H]
        router_logits: torch.Tensor,  # [T, E]
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return experts_forward(layer, x, router_logits)


def experts_forward(
    layer: Any,
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E]
) -> torch.Tensor:  # [T, H]
    """Route each token to its top-k experts and run them: Habana's MoE op
    where ``layer.habana_moe`` holds it (Gaudi), else ``hpu_mm::moe_experts``."""
    topk_weights, topk_ids = softmax_top_k(
        router_logits, int(layer.top_k), bool(layer.renormalize), x.dtype
    )
    habana = layer.habana_moe  # device.habana_moe(), set after loading
    out: torch.Tensor
    if habana is None:
        out = routed_experts(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids
        )
    else:
        out = habana(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
            experts_min=int(getattr(layer, "habana_experts_min", 0)),
        )  # fmt: skip
    return out


def local_experts_min(layer: Any) -> int:
    """The global id of this rank's first expert: 0 without expert
    parallelism; under it, the start of the contiguous range of global ids
    whose weights this rank holds (local expert ``i`` is global expert
    ``start + i``), or ValueError where the ``expert_map`` is not one."""
    expert_map = getattr(layer, "expert_map", None)
    if expert_map is None:
        return 0
    local = [int(i) for i in expert_map.tolist()]  # global id -> local id or -1
    held = [g for g, i in enumerate(local) if i >= 0]
    start = held[0] if held else 0
    linear = [i - start if start <= i < start + len(held) else -1
              for i in range(len(local))]  # fmt: skip
    if not held or local != linear:
        raise ValueError(
            "vllm-hpu-mm's MoE layer on Gaudi needs each rank's experts as one "
            "contiguous range of global ids (expert placement 'linear'), for "
            f"Habana's op's experts_min/experts_max; this rank's map: {local}"
        )
    return start


def softmax_top_k(
    router_logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``k`` experts and their weights: [T, k] each."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def _check_supported(layer: Any, moe: Any) -> None:
    problems = []
    scoring = str(getattr(layer, "scoring_func", "softmax"))
    if scoring != "softmax":
        problems.append(f"scoring function {scoring!r} (supported: softmax)")
    if getattr(layer, "use_grouped_topk", False):
        problems.append("grouped top-k routing")
    if getattr(layer, "custom_routing_function", None) is not None:
        problems.append("a custom routing function")
    if getattr(layer, "e_score_correction_bias", None) is not None:
        problems.append("a routing correction bias")
    scale = float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0)
    if scale != 1.0:
        problems.append(f"routed scaling factor {scale}")
    activation = str(getattr(layer, "activation", "silu"))
    if "silu" not in activation.lower():
        problems.append(f"activation {activation!r} (supported: SiLU-gated)")
    if getattr(moe, "has_bias", False):
        problems.append("expert biases")
    if getattr(layer, "expert_map", None) is not None:
        if getattr(layer, "habana_moe", None) is None:
            problems.append("expert parallelism (--enable-expert-parallel) off Gaudi")
        else:
            try:
                local_experts_min(layer)
            except ValueError:
                problems.append(
                    "expert placement other than 'linear' (each rank one "
                    "contiguous range of experts)"
                )
    if getattr(layer, "apply_router_weight_on_input", False):
        problems.append("routing weights applied to the input")
    if problems:
        raise NotImplementedError(
            "vllm-hpu-mm's MoE layer does not support "
            + "; ".join(problems)
            + " (this model's FusedMoE layer asks for it)"
        )


_REGISTERED = False


def register_moe_method() -> None:
    """Put ``HpuMMFusedMoEMethod`` in place of vLLM's unquantized MoE method
    (idempotent; before the model is built, in every worker)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.model_executor.custom_op import op_registry_oot

    if "UnquantizedFusedMoEMethod" not in op_registry_oot:
        UnquantizedFusedMoEMethod.register_oot(HpuMMFusedMoEMethod)
    _REGISTERED = True
