"""The work counter's MoE row (``vllm_hpu_mm.bench.work_moe``): an MoE layer on
the static plan's step layout, counted from the ops that run, against the
minimum (each real token through its top-k experts only)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vllm_hpu_mm.moe
from hpu_kernels.moe import routed_experts
from vllm_hpu_mm.bench.work_moe import (
    MoEShape,
    count_moe_step,
    expert_bytes,
    minimum_moe_flops,
    moe_row,
)
from vllm_hpu_mm.bench.work_steps import TextStep

M = MoEShape(hidden=32, inter=16, experts=16, top_k=4)
DECODE_20 = TextStep("decode 20 req", (1,) * 20, (300,) * 20)  # bucket: 32 rows
PREFILL_96 = TextStep("prefill 96 fresh", (96,), (96,))  # bucket: 128 tokens
MIXED = TextStep("mixed 4 dec + 64 fresh", (1,) * 4 + (64,), (200,) * 4 + (64,))


def _flops(counts: Any) -> int:
    return int(sum(counts.flops.values()))


@pytest.mark.parametrize("step", [DECODE_20, PREFILL_96])
def test_exact_shape_is_the_minimum_and_padding_rows_are_counted(
    step: TextStep,
) -> None:
    c = count_moe_step(step, M)
    assert c.tokens == sum(step.query_lens)
    assert _flops(c.exact) == c.min_flops == minimum_moe_flops(c.tokens, M)
    assert c.exact.read("weight") == c.min_weight_bytes
    # the bucket's rows all run their top-k experts: padding is work too
    assert c.padded_tokens > c.tokens
    assert _flops(c.padded) == minimum_moe_flops(c.padded_tokens, M)
    # padding rows share one hidden state, so at most top_k more experts
    assert c.experts_routed <= c.experts_read_padded <= c.experts_routed + M.top_k
    assert c.padded.read("weight") == c.experts_read_padded * expert_bytes(
        M, torch.bfloat16
    )
    row = moe_row(c)
    assert row["expert_flops"]["work"] == 1.0
    assert row["expert_flops"]["pad"] == round(c.padded_tokens / c.tokens, 3)


def test_the_counter_sees_a_doubled_expert_computation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that runs every routed expert twice counts twice the FLOPs and
    weight reads: the row would show ``work`` 2.00."""

    def twice(*args: torch.Tensor) -> torch.Tensor:
        return (routed_experts(*args) + routed_experts(*args)) / 2

    once = count_moe_step(PREFILL_96, M)
    monkeypatch.setattr(vllm_hpu_mm.moe, "routed_experts", twice)
    doubled = count_moe_step(PREFILL_96, M)
    assert _flops(doubled.exact) == 2 * _flops(once.exact) == 2 * once.min_flops
    assert doubled.exact.read("weight") == 2 * once.exact.read("weight")
    assert moe_row(doubled)["expert_flops"]["work"] == 2.0


def test_a_mixed_step_reads_the_experts_of_each_pass() -> None:
    """The static plan runs a mixed step as a decode pass and a prefill pass:
    the FLOPs stay the minimum, an expert both passes use is read twice."""
    c = count_moe_step(MIXED, M)
    assert c.passes == 2
    assert _flops(c.exact) == c.min_flops
    assert c.min_weight_bytes < c.exact.read("weight") <= 2 * c.min_weight_bytes
