"""Where attention runs in graph mode (``hpu_mm.graph_attention``)."""

from __future__ import annotations

import pytest

from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.worker.shapes import opaque_attention


def cfg(**keys: str) -> HpuMMConfig:
    return HpuMMConfig.from_mapping(keys, source="a test")


@pytest.mark.parametrize(
    ("kind", "expected"), [("hpu", False), ("cpu", True), ("cuda", True)]
)
def test_auto_traces_on_gaudi_only(kind: str, expected: bool) -> None:
    assert opaque_attention(cfg(), kind, enforce_eager=False) is expected


@pytest.mark.parametrize("kind", ["hpu", "cpu"])
def test_explicit_choice_wins_on_every_device(kind: str) -> None:
    assert opaque_attention(cfg(graph_attention="opaque"), kind, False) is True
    assert opaque_attention(cfg(graph_attention="traced"), kind, False) is False


def test_eager_mode_calls_the_backend_directly() -> None:
    # Nothing is compiled, so the opaque op would only add a dispatch.
    opaque = cfg(graph_attention="opaque")
    assert opaque_attention(opaque, "cpu", enforce_eager=True) is False
    eager = cfg(graph_mode="eager", graph_attention="opaque")
    assert opaque_attention(eager, "cpu", enforce_eager=False) is False
    compiled = cfg(graph_mode="compile", graph_attention="opaque")
    assert opaque_attention(compiled, "cpu", enforce_eager=True) is True
