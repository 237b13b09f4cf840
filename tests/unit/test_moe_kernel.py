"""The routed-experts kernel (``hpu_kernels.moe``): the dense reference's
values in float64, the minimum matmul work (each token through its top-k
experts only), and one graph for every routing."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hpu_kernels.moe import dense_experts_reference, routed_experts, routed_experts_impl
from vllm_hpu_mm.moe import softmax_top_k

E, H, INTER, K = 8, 24, 12, 2


def _weights(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen, dtype=dtype) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=gen, dtype=dtype) / INTER**0.5
    return w13, w2


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=gen, dtype=torch.float64)
    logits = torch.randn(n, E, generator=gen, dtype=torch.float64)
    weights, ids = softmax_top_k(logits, K, renormalize=True, dtype=x.dtype)
    return x, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_routed_equals_the_dense_reference(num_tokens: int) -> None:
    w13, w2 = _weights()
    x, weights, ids = _tokens(num_tokens, seed=num_tokens)
    got = routed_experts(x, w13, w2, weights, ids)
    want = dense_experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_expert_nobody_routes_to_costs_nothing() -> None:
    w13, w2 = _weights()
    x, weights, _ = _tokens(6, seed=1)
    ids = torch.tensor([[0, 3]] * 6)  # experts 1, 2, 4.. get no token
    got = routed_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, dense_experts_reference(x, w13, w2, weights, ids))


def test_matmul_work_is_the_routed_minimum() -> None:
    """Each (token, expert) pair once through its expert's two matmuls:
    2 * T * k * (2I * H + H * I) flops, not E / k times that."""
    w13, w2 = _weights(torch.float32)
    x, weights, ids = _tokens(33, seed=2)
    x = x.float()
    with FlopCounterMode(display=False) as counter:
        routed_experts_impl(x, w13, w2, weights.float(), ids)
    minimum = 2 * 33 * K * (2 * INTER * H + H * INTER)
    assert counter.get_total_flops() == minimum
    with FlopCounterMode(display=False) as dense:
        dense_experts_reference(x, w13, w2, weights.float(), ids)
    assert dense.get_total_flops() >= (E // K) * minimum  # what routing saves


def test_renormalised_weights_sum_to_one_and_follow_the_logits() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = softmax_top_k(logits, 2, renormalize=True, dtype=torch.float32)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
    raw, _ = softmax_top_k(logits, 2, renormalize=False, dtype=torch.float32)
    torch.testing.assert_close(raw, torch.softmax(logits, -1)[:, [1, 2]])


def test_one_compiled_graph_serves_every_routing() -> None:
    """The op hides the routing-dependent segment sizes: a compiled caller
    sees a fixed output shape, so a new routing does not recompile."""
    from torch._dynamo.testing import CompileCounter

    w13, w2 = _weights(torch.float32)
    counter = CompileCounter()

    @torch.compile(backend=counter, dynamic=False, fullgraph=True)
    def layer(x: torch.Tensor, w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return routed_experts(x, w13, w2, w, i)

    x = torch.randn(16, H)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, E, (16, K), generator=gen)
        weights = torch.rand(16, K, generator=gen)
        torch.testing.assert_close(
            layer(x, weights, ids),
            dense_experts_reference(x, w13, w2, weights, ids),
            rtol=1e-5,
            atol=1e-5,
        )
    assert counter.frame_count == 1


def test_expert_tensors_in_either_layout_reach_vllm_in_the_published_one() -> None:
    """Qwen3-VL-MoE: published checkpoints hold gate_up [E, H, 2I] and down
    [E, I, H]; transformers 5's save_pretrained writes [E, 2I, H] and
    [E, H, I]. vLLM loads the published layout, so the saved one is turned."""
    from vllm_hpu_mm.models.expert_layout import published_expert_layout

    hidden, inter, experts = 64, 24, 8
    prefix = "model.language_model.layers.0.mlp.experts."
    published = {
        "gate_up_proj": torch.randn(experts, hidden, 2 * inter),
        "down_proj": torch.randn(experts, inter, hidden),
    }
    for name, weight in published.items():
        kept = published_expert_layout(prefix + name, weight, hidden, inter)
        assert kept is weight
        saved = weight.transpose(1, 2).contiguous()
        turned = published_expert_layout(prefix + name, saved, hidden, inter)
        assert torch.equal(turned, weight)
    other = torch.randn(experts, 2 * inter, hidden)
    assert published_expert_layout("x.mlp.gate.weight", other, hidden, inter) is other


@pytest.mark.parametrize("experts", [4, 8, 64])
@pytest.mark.parametrize("num_tokens", [3, 17, 64])
def test_matmul_work_grows_with_routed_tokens_not_experts(
    experts: int, num_tokens: int
) -> None:
    """FLOPs are ``T * k`` rows through one expert each, whatever the number
    of experts (a dense form: ``T * E`` rows) and however skewed the routing."""
    gen = torch.Generator().manual_seed(experts * 100 + num_tokens)
    w13 = torch.randn(experts, 2 * INTER, H, generator=gen)
    w2 = torch.randn(experts, H, INTER, generator=gen)
    x = torch.randn(num_tokens, H, generator=gen)
    weights = torch.rand(num_tokens, K, generator=gen)
    spread = torch.randint(0, experts, (num_tokens, K), generator=gen)
    skewed = torch.tensor([[0, 1]] * num_tokens)  # every token on two experts
    per_pair = 2 * (2 * INTER * H + H * INTER)
    for ids in (spread, skewed):
        with FlopCounterMode(display=False) as counter:
            routed_experts_impl(x, w13, w2, weights, ids)
        assert counter.get_total_flops() == num_tokens * K * per_pair
    with FlopCounterMode(display=False) as dense:
        dense_experts_reference(x, w13, w2, weights, spread)
    assert dense.get_total_flops() >= num_tokens * experts * per_pair
