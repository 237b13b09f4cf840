"""Mixture of experts in bfloat16 on the simulated Gaudi (one engine in a fresh
interpreter, ``tests/moe_sim_engine.py``): the tiny random Qwen3-MoE of
``test_moe`` (8 experts, top-2) served with the static plan in graph mode,
its experts through Habana's MoE op ``torch.ops.hpu.mixture_of_experts``
(``vllm_hpu_mm.gaudi_sim.moe_ops``, with the real op's argument checks;
counted in the worker) instead of the plugin's own kernel.

Greedy outputs equal HF transformers' ``Qwen3MoeForCausalLM`` in bfloat16
token for token except at a near-tie (``tests.hf_reference.compare_greedy_bf16``:
top-2 margin at most 3 bfloat16 spacings; there the engine must pick one of the
tied tokens and the sequence is not compared further). Two prompt sets route
their tokens to every expert; no graph compiles while serving them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.e2e.test_moe import _prompts, build_tiny_qwen3_moe
from tests.fresh_interpreter import run_for_result
from tests.hf_reference import Bf16Tally, compare_greedy_bf16, hf_greedy_steps

pytestmark = pytest.mark.e2e

MAX_NEW = 10
NUM_EXPERTS = 8
BUCKETS = "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8]\n"


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("Qwen3-MoE on the simulated Gaudi (Habana MoE op)")
    yield t
    t.report(request.config)


def test_bf16_moe_runs_the_habana_op_matches_hf_and_compiles_nothing(
    tiny_llama_dir: str, tmp_path: Path, tally: Bf16Tally
) -> None:
    model = build_tiny_qwen3_moe(tmp_path / "qwen3moe", tiny_llama_dir)
    (tmp_path / "buckets.yaml").write_text(BUCKETS)
    prompt_sets = [_prompts(seed) for seed in (1, 2)]  # two routings
    result = run_for_result(
        [
            "-m",
            "tests.moe_sim_engine",
            model,
            json.dumps(prompt_sets),
            str(MAX_NEW),
            str(tmp_path / "buckets.yaml"),
        ],
        tmp_path / "cache",
        timeout=900,
    )
    assert (result["device_kind"], result["plan"]) == ("hpu", "static")
    # Habana's op ran in every MoE layer (2 of the 3 layers) at warmup and at
    # each served step, and every expert received tokens while serving.
    assert result["moe_calls_warmup"] > 0
    assert result["moe_calls_serving"] >= 2 * MAX_NEW
    routed = {int(e): n for e, n in result["routed_serving"].items()}
    assert sorted(routed) == list(range(NUM_EXPERTS))
    assert all(n > 0 for n in routed.values()), routed
    # Warmup compiled the graphs; serving both routings compiled none.
    assert result["sim_compiles_warmup"] > 0
    assert result["sim_compiles_serving"] == 0
    assert result["metric_compiles_serving"] == 0
    for prompts, outs in zip(prompt_sets, result["tokens"], strict=True):
        for prompt, got in zip(prompts, outs, strict=True):
            hf_tokens, hf_logits = hf_greedy_steps(
                model, prompt, MAX_NEW, torch.bfloat16
            )
            match = compare_greedy_bf16(got, hf_tokens, hf_logits)
            tally.add(f"prompt of {len(prompt)} tokens", match)
