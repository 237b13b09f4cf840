"""The execution plan (``hpu_mm.execution``): each setting on each device kind
gives one set of facts; contradictory settings are refused at start-up."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_hpu_mm.config import ConfigError, HpuMMConfig
from vllm_hpu_mm.plan import ExecutionPlan, build_plan

KINDS = ("hpu", "cpu", "cuda")


def cfg(**keys: str) -> HpuMMConfig:
    return HpuMMConfig.from_mapping(keys, source="a test")


def facts(plan: ExecutionPlan) -> dict[str, object]:
    out = dataclasses.asdict(plan)
    del out["reason"], out["device_kind"]
    return out


# Gaudi's path, whatever the device: traced static graphs, tiles, flat decode,
# two-pass mixed steps, the flat cross layout, nothing read on the host.
STATIC_COMPILED = {
    "name": "static",
    "graph_mode": "compile",
    "opaque_attention": False,
    "symbolic_tokens": False,
    "host_attention": False,
    "per_request_prefill": False,
    "dense_decode_cache": False,
    "split_mixed_steps": True,
    "per_request_cross": False,
    "decode_form": "flat",
    "prepack_linear": False,
    "padded_sampler": True,
    "static_encoder_attention": True,
}


@pytest.mark.parametrize("kind", KINDS)
def test_static_is_gaudis_path_on_every_device(kind: str) -> None:
    plan = build_plan(cfg(execution="static"), kind, enforce_eager=False)
    assert facts(plan) == STATIC_COMPILED
    # eager: the same layouts, without graphs
    eager = build_plan(cfg(execution="static", graph_mode="eager"), kind, False)
    assert facts(eager) == {
        **STATIC_COMPILED,
        "graph_mode": "eager",
        "padded_sampler": False,  # no graphs: nothing keyed by the batch size
    }


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_dynamic_off_gaudi_is_the_fast_path(kind: str) -> None:
    plan = build_plan(cfg(execution="dynamic"), kind, enforce_eager=False)
    assert facts(plan) == {
        "name": "dynamic",
        "graph_mode": "compile",
        "opaque_attention": True,
        "symbolic_tokens": True,
        "host_attention": True,
        "per_request_prefill": True,
        "dense_decode_cache": kind == "cpu",  # an accelerator's KV cache fills it
        "split_mixed_steps": False,
        "per_request_cross": True,
        "decode_form": "batched",
        "prepack_linear": kind == "cpu",
        "padded_sampler": False,
        "static_encoder_attention": False,  # vLLM's per-segment SDPA
    }
    # eager mode: attention is called directly, never under a graph
    eager = build_plan(cfg(execution="dynamic"), kind, enforce_eager=True)
    assert (eager.graph_mode, eager.opaque_attention, eager.symbolic_tokens) == (
        "eager",
        False,
        False,
    )
    assert eager.host_attention and eager.per_request_prefill


def test_dynamic_on_gaudi_keeps_static_shapes() -> None:
    """Gaudi's graph compiler takes static shapes only: attention opaque, but a
    graph per token count and nothing read on the host."""
    plan = build_plan(cfg(execution="dynamic"), "hpu", enforce_eager=False)
    assert plan.opaque_attention and not plan.symbolic_tokens
    assert not (plan.host_attention or plan.per_request_prefill)
    assert not (plan.dense_decode_cache or plan.prepack_linear)
    assert plan.split_mixed_steps and plan.decode_form == "flat"
    assert plan.padded_sampler  # a static count per graph: the sampler too
    assert plan.static_encoder_attention  # no host read in the vision tower


@pytest.mark.parametrize(
    ("kind", "name"), [("hpu", "static"), ("cpu", "dynamic"), ("cuda", "dynamic")]
)
def test_auto_is_static_on_gaudi_only(kind: str, name: str) -> None:
    plan = build_plan(cfg(), kind, enforce_eager=False)
    assert plan.name == name
    explicit = build_plan(cfg(execution=name), kind, enforce_eager=False)
    assert facts(plan) == facts(explicit)
    assert "auto" in plan.reason and kind in plan.reason


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("legacy", "name"), [("traced", "static"), ("opaque", "dynamic")]
)
def test_deprecated_graph_attention_maps_onto_the_plan(
    kind: str, legacy: str, name: str
) -> None:
    plan = build_plan(cfg(graph_attention=legacy), kind, enforce_eager=False)
    assert plan.name == name
    assert "deprecated" in plan.reason and repr(name) in plan.reason
    # restating the plan is allowed
    same = build_plan(cfg(graph_attention=legacy, execution=name), kind, False)
    assert same.name == name


@pytest.mark.parametrize(
    ("legacy", "execution"), [("traced", "dynamic"), ("opaque", "static")]
)
def test_contradictory_settings_are_refused(legacy: str, execution: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg(graph_attention=legacy, execution=execution)
    msg = str(err.value)
    assert err.value.key == "hpu_mm.graph_attention"
    assert f"contradicts hpu_mm.execution = {execution!r}" in msg
    assert "deprecated" in msg and "'auto', 'static' or 'dynamic'" in msg


def test_unknown_execution_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"hpu_mm\.execution"):
        cfg(execution="lazy")


def test_describe_names_the_plan_why_and_its_facts() -> None:
    line = build_plan(cfg(execution="static"), "cpu", False).describe()
    assert line.startswith("vllm-hpu-mm execution plan: static (hpu_mm.execution")
    assert "tiled prefill" in line and "flat decode" in line
    assert "attention traced" in line and "flat cross-attention" in line
    assert "encoder attention masked, one call a layer" in line
    line = build_plan(cfg(), "cpu", False).describe()
    assert "dynamic (execution auto on cpu)" in line
    assert "encoder attention per segment" in line
    assert "prefill per request" in line and "symbolic token count" in line
