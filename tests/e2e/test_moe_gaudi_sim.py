"""Mixture of experts in bfloat16 on the simulated Gaudi: three engines, one
after another in one fresh interpreter (``tests/moe_sim_engine.py``), each on
Gaudi's path (static plan, graph mode, graphs compiled by the simulated
``hpu_backend``) with its experts through Habana's MoE op
``torch.ops.hpu.mixture_of_experts`` (``vllm_hpu_mm.gaudi_sim.moe_ops``, with
the real op's argument checks; counted in each worker) instead of the
plugin's own kernel:

- the tiny random Qwen3-MoE of ``test_moe`` (8 experts, top-2), two prompt
  sets whose tokens go to every expert;
- the tiny random Qwen3-VL-MoE (8 experts, top-2): image prompts the step
  budget cuts and a text prompt;
- the tiny Qwen3-MoE at TP=2 with expert parallelism: each rank holds 4
  whole experts and passes their range of global ids to the op
  (``experts_min`` / ``experts_max``), and the layer all-reduces. (Plain TP=2,
  each rank a slice of every expert, calls the op as one rank does, with
  sliced weights; ``test_moe.py`` runs it with the plugin's kernel.)

Greedy outputs equal HF transformers' in bfloat16 token for token except at a
near-tie (``tests.hf_reference.compare_greedy_bf16``: top-2 margin at most 3
bfloat16 spacings; there the engine must pick one of the tied tokens and the
sequence is not compared further). No graph compiles while serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.e2e.test_moe import _prompts, build_tiny_qwen3_moe
from tests.fresh_interpreter import REPO_ROOT
from tests.hf_reference import Bf16Tally, compare_greedy_bf16, hf_greedy_steps
from tests.mm_reference import hf_vlm_greedy_steps, load_hf_vlm
from tests.moe_sim_engine import EP2_SEED, MAX_NEW, TEXT_SEEDS, VL_CASES, vl_case
from tests.qwen_reference import hf_qwen_inputs, tiny_qwen_dir

# Three engine starts in one fixture (one of them two workers): more than the
# suite's 900 s per test on a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NUM_EXPERTS = 8
MOE_LAYERS = {"qwen3_moe": 2, "qwen3_vl_moe": 1}  # the others are dense MLPs


@pytest.fixture(scope="module")
def moe_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe"), tiny_llama_dir)


@pytest.fixture(scope="module")
def vl_dir() -> str:
    return tiny_qwen_dir("tiny-qwen3-vl-moe")


@pytest.fixture(scope="module")
def results(
    moe_dir: str, vl_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("moe_gaudi_sim")
    out = tmp / "results.json"
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(tmp / "cache"),
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.moe_sim_engine", str(out), moe_dir, vl_dir],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("MoE on the simulated Gaudi (Habana MoE op)")
    yield t
    t.report(request.config)


def _served(results: dict[str, Any], name: str, ranks: int) -> list[dict[str, Any]]:
    """The engine's per-rank facts, after the checks every engine passes:
    Gaudi's path, Habana's op at warmup and at every served step, graphs
    compiled at warmup and none while serving."""
    got = results[name]
    assert "error" not in got, got.get("error")
    assert got["block_size"] == 128  # Gaudi's KV block size: the HPU platform
    assert got["metric_compiles_warmup"] > 0
    assert got["metric_compiles_serving"] == 0, got
    assert [r["rank"] for r in got["ranks"]] == list(range(ranks))
    for rank in got["ranks"]:
        assert (rank["device_kind"], rank["plan"]) == ("hpu", "static")
        assert rank["moe_calls_warmup"] > 0
        assert rank["moe_calls_serving"] >= MOE_LAYERS.get(name, 2) * MAX_NEW
        assert rank["sim_compiles_warmup"] > 0
        assert rank["sim_compiles_serving"] == 0, rank
    return list(got["ranks"])


def _check_text(
    results: dict[str, Any],
    name: str,
    seeds: tuple[int, ...],
    moe_dir: str,
    tally: Bf16Tally,
) -> None:
    sets = results[name]["sets"]
    assert len(sets) == len(seeds)
    for seed, outs in zip(seeds, sets, strict=True):
        for prompt, out in zip(_prompts(seed), outs, strict=True):
            assert out["prompt_ids"] == prompt
            want, logits = hf_greedy_steps(moe_dir, prompt, MAX_NEW, torch.bfloat16)
            tally.add(
                f"{name}: prompt of {len(prompt)} tokens",
                compare_greedy_bf16(out["tokens"], want, logits),
            )


def test_qwen3_moe_runs_the_habana_op_matches_hf_and_compiles_nothing(
    results: dict[str, Any], moe_dir: str, tally: Bf16Tally
) -> None:
    (rank,) = _served(results, "qwen3_moe", 1)
    # Both prompt sets together routed tokens to every expert while serving,
    # one call over all experts at a time.
    routed = {int(e): n for e, n in rank["routed_serving"].items()}
    assert sorted(routed) == list(range(NUM_EXPERTS))
    assert all(n > 0 for n in routed.values()), routed
    assert rank["ranges"] == [[0, NUM_EXPERTS - 1, 2 * 32, 64]]  # [2I, H] each
    _check_text(results, "qwen3_moe", TEXT_SEEDS, moe_dir, tally)


def test_qwen3_vl_moe_images_and_text_match_hf(
    results: dict[str, Any], vl_dir: str, tally: Bf16Tally
) -> None:
    (rank,) = _served(results, "qwen3_vl_moe", 1)
    assert sum(rank["routed_serving"].values()) > 0
    assert rank["ranges"] == [[0, NUM_EXPERTS - 1, 2 * 24, 64]]
    (outs,) = results["qwen3_vl_moe"]["sets"]
    assert len(outs) == len(VL_CASES)
    model = load_hf_vlm(vl_dir, torch.bfloat16)
    for i, out in enumerate(outs):
        prompt, images = vl_case(i)
        inputs = hf_qwen_inputs(vl_dir, prompt, images)
        assert out["prompt_ids"] == inputs["input_ids"][0].tolist(), f"case {i}"
        want, logits = hf_vlm_greedy_steps(model, inputs, MAX_NEW)
        tally.add(
            f"qwen3_vl_moe case {i} ({len(images)} images)",
            compare_greedy_bf16(out["tokens"], want, logits),
        )


def test_qwen3_moe_expert_parallel_each_rank_four_whole_experts_matches_hf(
    results: dict[str, Any], moe_dir: str, tally: Bf16Tally
) -> None:
    """Expert parallelism (TP=2, ``enable_expert_parallel``): rank 0 holds
    experts 0..3 whole ([2I, H] = [64, 64] each), rank 1 experts 4..7; each
    passes its range to the op with the routing table of global ids, and
    vLLM's layer sums the two ranks' outputs."""
    ranks = _served(results, "qwen3_moe_ep2", 2)
    assert [r["ranges"] for r in ranks] == [[[0, 3, 64, 64]], [[4, 7, 64, 64]]]
    for rank, held in zip(ranks, (range(0, 4), range(4, 8)), strict=True):
        routed = {int(e): n for e, n in rank["routed_serving"].items()}
        assert sorted(routed) == list(held), routed  # the op ran its own only
        assert all(n > 0 for n in routed.values()), routed
    _check_text(results, "qwen3_moe_ep2", (EP2_SEED,), moe_dir, tally)
