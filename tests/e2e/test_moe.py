"""Mixture-of-experts on the plugin's own experts kernel: a tiny random
Qwen3-MoE (8 experts, top-2, renormalised, one dense MLP layer among the MoE
ones) as transformers' ``save_pretrained`` writes it, served in float32 graph
mode (attention traced into the static step graphs, as on Gaudi) and with
tensor parallelism (each rank a slice of every expert), token-identical to
transformers' ``Qwen3MoeForCausalLM``. Different prompts route their tokens to
different experts: warmup's graphs serve every routing, so nothing compiles
while serving."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.test_graph_mode import write_buckets
from tests.hf_reference import hf_greedy
from tests.mm_reference import engine_lifetime
from vllm_hpu_mm.metrics_reader import read_metric

pytestmark = pytest.mark.e2e

MAX_NEW = 10
LENGTHS = (5, 41, 17, 70)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_qwen3_moe(out: Path, tokenizer_dir: str) -> str:
    """A tiny random Qwen3-MoE checkpoint with the tiny Llama's tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,  # the dense layer's MLP
        moe_intermediate_size=32,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # sharper routing than the default init gives
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.mul_(8.0)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return str(out)


@pytest.fixture(scope="module")
def moe_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe"), tiny_llama_dir)


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 600, (n,), generator=gen).tolist() for n in LENGTHS]


def _greedy(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def graph_llm(moe_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    yield from engine_lifetime(
        LLM(
            model=moe_dir,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            seed=0,
            additional_config={
                "hpu_mm": {
                    "graph_mode": "compile",
                    "graph_attention": "traced",
                    "bucketing": {
                        "strategy": "explicit",
                        "file": write_buckets(tmp_path_factory),
                    },
                    "warmup": {"progress_bar": False},
                }
            },
        )
    )


def test_graph_mode_matches_hf_and_compiles_nothing_across_routings(
    graph_llm: Any, moe_dir: str
) -> None:
    before = read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})
    for seed in (1, 2):  # two prompt sets: different tokens, different experts
        prompts = _prompts(seed)
        assert _greedy(graph_llm, prompts) == hf_greedy(moe_dir, prompts, MAX_NEW)
    after = read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})
    assert after == before, f"compiled while serving: {before} -> {after}"


@pytest.fixture(scope="module")
def tp_llm(moe_dir: str) -> Iterator[Any]:
    """TP=2 over gloo (vLLM's multiprocessing executor), eager: each rank holds
    half of every expert's intermediate rows and the layer all-reduces."""
    from vllm import LLM

    yield from engine_lifetime(
        LLM(
            model=moe_dir,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            enforce_eager=True,
            seed=0,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
        )
    )


def test_tensor_parallel_experts_match_hf(tp_llm: Any, moe_dir: str) -> None:
    prompts = _prompts(3)
    assert _greedy(tp_llm, prompts) == hf_greedy(moe_dir, prompts, MAX_NEW)
