"""Habana's MoE op on Gaudi: the simulated ``torch.ops.hpu.mixture_of_experts``
(``vllm_hpu_mm.gaudi_sim.moe_ops``) computes the routed experts and refuses
what the real op refuses; the MoE layer calls it on HPU, as the official
plugin does, and the plugin's own kernel everywhere else."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hpu_kernels.moe import dense_experts_reference, routed_experts
from tests.fakes.habana import FakeHabana, cpu_only_host
from vllm_hpu_mm import device
from vllm_hpu_mm.gaudi_sim import moe_ops
from vllm_hpu_mm.moe import (
    _check_supported,
    experts_forward,
    local_experts_min,
    softmax_top_k,
)

E, H, INTER, K, T = 8, 24, 12, 2, 9


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    moe_ops.register()
    with cpu_only_host(monkeypatch):
        yield


def _case(
    dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=gen) / INTER**0.5
    x = torch.randn(T, H, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    weights, ids = softmax_top_k(logits, K, renormalize=True, dtype=dtype)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids, logits


def _call(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    **overrides: Any,
) -> torch.Tensor:
    kwargs: dict[str, Any] = {
        "hidden_states": x,
        "expert_routing_table": ids,
        "router_weights": weights,
        "w12": list(w13.unbind(0)),
        "w3": list(w2.unbind(0)),
        "permuted_weights": True,
        "activation": "silu",
        "experts_min": 0,
        "experts_max": w13.shape[0] - 1,
        **overrides,
    }
    out: torch.Tensor = torch.ops.hpu.mixture_of_experts(**kwargs)
    return out


def _reference(*args: torch.Tensor) -> torch.Tensor:
    x, w13, w2, weights, ids = (a.double() if a.is_floating_point() else a
                                for a in args)  # fmt: skip
    return dense_experts_reference(x, w13, w2, weights, ids)


# ---- what the op computes ---------------------------------------------------------


def test_the_op_computes_the_routed_experts() -> None:
    x, w13, w2, weights, ids, _ = _case()
    want = _reference(x, w13, w2, weights, ids)
    got = _call(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # [in, out] weights with permuted_weights=False, and the three-list form
    unpermuted = _call(
        x, w13, w2, weights, ids,
        w12=[w.t() for w in w13], w3=[w.t() for w in w2], permuted_weights=False,
    )  # fmt: skip
    torch.testing.assert_close(unpermuted, got)
    three = torch.ops.hpu.mixture_of_experts(
        x, ids, weights, [w[:INTER] for w in w13], [w[INTER:] for w in w13],
        list(w2), True, "silu", 0, E - 1,
    )  # fmt: skip
    torch.testing.assert_close(three, got)


def test_expert_slices_sum_to_the_whole_and_others_contribute_nothing() -> None:
    """As vllm-gaudi slices the experts: one call per range, whole routing
    table each time, slices summed."""
    x, w13, w2, weights, ids, _ = _case(seed=1)
    whole = _call(x, w13, w2, weights, ids)
    low = _call(x, w13[:5], w2[:5], weights, ids, experts_min=0, experts_max=4)
    high = _call(x, w13[5:], w2[5:], weights, ids, experts_min=5, experts_max=7)
    torch.testing.assert_close(low + high, whole)
    untouched = (ids < 5).all(-1)  # tokens routed to experts 0..4 only
    assert untouched.any() and (~untouched).any()
    assert (high[untouched] == 0).all()


def test_bfloat16_stays_within_bfloat16_rounding_of_float64() -> None:
    x, w13, w2, weights, ids, _ = _case(torch.bfloat16, seed=2)
    got = _call(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    want = _reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


# ---- what the op refuses ----------------------------------------------------------


def _refused(match: str, **overrides: Any) -> None:
    x, w13, w2, weights, ids, _ = _case(torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        _call(x, w13, w2, weights, ids, **overrides)


def test_an_activation_the_kernel_lacks_is_refused() -> None:
    _refused(
        'Activation "gelu_tanh" not found among MoeActivationMode_t',
        activation="gelu_tanh",
    )


def test_stacked_weights_instead_of_lists_are_refused_by_the_schema() -> None:
    x, w13, w2, weights, ids, _ = _case(torch.bfloat16)
    with pytest.raises(RuntimeError, match="failed to match any schema"):
        _call(x, w13, w2, weights, ids, w12=w13, w3=w2)


def test_dtypes_must_agree_with_the_activations() -> None:
    _, w13, _, weights, ids, _ = _case(torch.bfloat16)
    _refused("router_weights are torch.float32", router_weights=weights.float())
    _refused("takes int64", expert_routing_table=ids.to(torch.int32))
    _refused("expert 3's weights are torch.float32",
             w12=[w.float() if i == 3 else w for i, w in enumerate(w13)])  # fmt: skip


def test_the_expert_range_must_match_the_weight_lists() -> None:
    w13 = _case(torch.bfloat16)[1]
    _refused("is 7 expert", experts_max=6)
    _refused("is 8 expert.* hold 7 and 8", w12=list(w13.unbind(0))[:7])
    _refused("is 0 expert", experts_min=3, experts_max=2)
    _refused("is 9 expert", experts_min=-1)


def test_routing_shapes_must_agree() -> None:
    x, _, _, weights, _, _ = _case(torch.bfloat16)
    _refused("router_weights .* differ", router_weights=weights[:, :1])
    _refused("for the same T", hidden_states=x[:4])
    _refused(r"expected \(24, 24\)", permuted_weights=False)


# ---- the MoE layer on HPU and elsewhere -------------------------------------------


def _layer(kernel: Any, dtype: torch.dtype) -> Any:
    x, w13, w2, _, _, logits = _case(dtype, seed=3)
    layer = SimpleNamespace(
        top_k=K, renormalize=True, w13_weight=w13, w2_weight=w2, habana_moe=kernel
    )
    return layer, x, logits


def test_off_gaudi_the_layer_runs_the_plugins_kernel() -> None:
    assert device.habana_moe() is None
    layer, x, logits = _layer(device.habana_moe(), torch.float32)
    calls = moe_ops.MoeCounts.calls
    got = experts_forward(layer, x, logits)
    assert moe_ops.MoeCounts.calls == calls
    weights, ids = softmax_top_k(logits, K, True, x.dtype)
    torch.testing.assert_close(
        got, routed_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)
    )


def test_on_gaudi_the_layer_calls_habanas_op(habana: FakeHabana) -> None:
    kernel = device.habana_moe()
    assert kernel is not None
    layer, x, logits = _layer(kernel, torch.bfloat16)
    calls = moe_ops.MoeCounts.calls
    got = experts_forward(layer, x, logits)
    assert moe_ops.MoeCounts.calls == calls + 1
    weights, ids = softmax_top_k(logits, K, True, x.dtype)
    want = _reference(x, layer.w13_weight, layer.w2_weight, weights, ids)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_hpu_backend_compiles_the_op_once_for_every_routing(
    habana: FakeHabana,
) -> None:
    layer, x, logits = _layer(device.habana_moe(), torch.bfloat16)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return torch._dynamo.lookup_backend(device.compile_backend())(
            gm, example_inputs
        )

    compiled = torch.compile(
        lambda x, logits: experts_forward(layer, x, logits),
        backend=backend,
        fullgraph=True,
    )
    calls = moe_ops.MoeCounts.calls
    first = compiled(x, logits)
    second = compiled(x, logits.flip(-1))  # another routing, same shapes
    assert habana.calls.count("compile") == 1
    # The op is one node of the graph: its body is not traced.
    (graph,) = graphs
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert [str(t) for t in targets if "mixture_of_experts" in str(t)] == [
        "hpu.mixture_of_experts"
    ], targets
    assert not any("matmul" in str(t) or "zeros" in str(t) for t in targets), targets
    assert moe_ops.MoeCounts.calls == calls + 2
    assert not torch.equal(first, second)
    torch.testing.assert_close(first, experts_forward(layer, x, logits))


def test_on_hpu_vllms_moe_runner_calls_the_layer_directly(
    habana: FakeHabana, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unpatched, vLLM's runner enters the layer through its mutating custom
    op on this platform (which hpu_backend refuses as auto_functionalized);
    the patch makes it call the layer as on the CPU."""
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    from vllm_hpu_mm import patches
    from vllm_hpu_mm.platform import HpuMMPlatform

    monkeypatch.setattr(moe_runner, "current_platform", HpuMMPlatform())
    runner = moe_runner.MoERunner
    unpatched = patches.REPLACED_HELPERS.get(  # an earlier test may have patched it
        "MoERunner._select_forward", runner._select_forward
    )
    monkeypatch.setattr(runner, "_select_forward", unpatched)
    plain, shared = (
        SimpleNamespace(_shared_experts=None),
        SimpleNamespace(_shared_experts=object()),
    )
    assert runner._select_forward(plain) is torch.ops.vllm.moe_forward
    (patch,) = [p for p in patches.PATCHES if "MoE runner" in p.name]
    assert patch.applies()
    patch.apply()
    assert runner._select_forward(plain) is moe_runner._moe_forward
    assert runner._select_forward(shared) is moe_runner._moe_forward_shared


def test_off_hpu_the_moe_runner_patch_does_not_apply() -> None:
    from vllm_hpu_mm import patches

    (patch,) = [p for p in patches.PATCHES if "MoE runner" in p.name]
    assert not patch.applies()


def _layer_dynamo_skips(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w12: list[torch.Tensor],
    w3: list[torch.Tensor],
) -> torch.Tensor:
    """An MoE layer's forward that Dynamo runs eagerly (its code is skipped,
    as Dynamo skipped for good the decoder layers it first met inside the
    memory profile) while it still intercepts the Python frames this one
    calls: here only the op's kernel."""
    out: torch.Tensor = torch.ops.hpu.mixture_of_experts.fused_weights(
        x, ids, weights, w12, w3, True, "silu", 0, E - 1
    )
    return out


def test_dynamo_never_traces_the_simulated_ops_body(habana: FakeHabana) -> None:
    """Called from a frame Dynamo runs eagerly, the op's kernel is not taken
    for a frame of its own to compile (its body would guard on the expert
    counters and recompile at each call): two routings compile nothing, and
    the op runs twice."""
    torch._dynamo.eval_frame.skip_code(_layer_dynamo_skips.__code__)
    x, w13, w2, weights, ids, _ = _case(torch.bfloat16, seed=4)
    compiled = torch.compile(_layer_dynamo_skips, backend=device.compile_backend())
    calls = moe_ops.MoeCounts.calls
    first = compiled(x, weights, ids, list(w13), list(w2))
    second = compiled(x, weights, ids.flip(-1), list(w13), list(w2))
    assert moe_ops.MoeCounts.calls == calls + 2
    assert not torch.equal(first, second)
    assert habana.calls.count("compile") == 0, habana.calls


# ---- expert parallelism on Gaudi --------------------------------------------------


def _ep_layer(kernel: Any, rank: int, expert_map: list[int] | None) -> Any:
    """Rank ``rank`` of 2 under expert parallelism: experts 4r .. 4r+3 whole."""
    x, w13, w2, _, _, logits = _case(torch.bfloat16, seed=5)
    held = slice(4 * rank, 4 * rank + 4)
    layer = SimpleNamespace(
        top_k=K,
        renormalize=True,
        w13_weight=w13[held],
        w2_weight=w2[held],
        habana_moe=kernel,
        expert_map=None if expert_map is None else torch.tensor(expert_map),
    )
    return layer, x, w13, w2, logits


def test_local_experts_min_is_the_ranks_first_global_expert() -> None:
    none = SimpleNamespace(expert_map=None)
    assert local_experts_min(none) == 0
    first = SimpleNamespace(expert_map=torch.tensor([0, 1, 2, 3] + [-1] * 4))
    second = SimpleNamespace(expert_map=torch.tensor([-1] * 4 + [0, 1, 2, 3]))
    assert (local_experts_min(first), local_experts_min(second)) == (0, 4)
    for scattered in ([0, -1, 1, -1, 2, -1, 3, -1], [-1] * 4 + [1, 0, 2, 3]):
        with pytest.raises(ValueError, match="contiguous range"):
            local_experts_min(SimpleNamespace(expert_map=torch.tensor(scattered)))


def test_expert_parallel_ranks_on_gaudi_sum_to_all_experts(habana: FakeHabana) -> None:
    """Each rank passes its range of global ids to the op with the whole
    routing table; the two ranks' outputs (vLLM's layer all-reduces them)
    are the output of all eight experts."""
    kernel = device.habana_moe()
    outs = []
    for rank in (0, 1):
        expert_map = [-1] * 8
        expert_map[4 * rank : 4 * rank + 4] = [0, 1, 2, 3]
        layer, x, w13, w2, logits = _ep_layer(kernel, rank, expert_map)
        layer.habana_experts_min = local_experts_min(layer)
        assert layer.habana_experts_min == 4 * rank
        outs.append(experts_forward(layer, x, logits))
    weights, ids = softmax_top_k(logits, K, True, x.dtype)
    assert (ids < 4).any() and (ids >= 4).any()  # both ranks have work
    whole = _call(x, w13, w2, weights, ids)
    torch.testing.assert_close(outs[0] + outs[1], whole, rtol=2e-2, atol=2e-2)
    assert not torch.equal(outs[0], outs[1])


def test_expert_parallelism_is_refused_off_gaudi_and_when_scattered(
    habana: FakeHabana,
) -> None:
    linear = [-1] * 4 + [0, 1, 2, 3]
    moe = SimpleNamespace(has_bias=False)
    layer = _ep_layer(device.habana_moe(), 1, linear)[0]
    _check_supported(layer, moe)  # on Gaudi, one contiguous range: accepted
    off_gaudi = _ep_layer(None, 1, linear)[0]
    with pytest.raises(NotImplementedError, match=r"expert parallelism .* off Gaudi"):
        _check_supported(off_gaudi, moe)
    scattered = _ep_layer(device.habana_moe(), 1, [-1, 0, -1, 1, -1, 2, -1, 3])[0]
    with pytest.raises(NotImplementedError, match="placement other than 'linear'"):
        _check_supported(scattered, moe)
