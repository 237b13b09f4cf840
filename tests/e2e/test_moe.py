"""Mixture-of-experts on the plugin's own experts kernel (``hpu_mm::moe_experts``),
token-identical to transformers.

- A tiny random Qwen3-MoE (8 experts, top-2, renormalised, one dense MLP layer
  among the MoE ones) as transformers' ``save_pretrained`` writes it: float32
  on the static plan (graph mode, attention traced into the step graphs, as on
  Gaudi) across two prompt sets that route their tokens differently, with
  nothing compiled while serving; float32 on the dynamic plan (the CPU's
  default: opaque attention, symbolic token counts); bfloat16 on the dynamic
  plan within ``compare_greedy_bf16``'s near-tie rule; and with tensor
  parallelism (each rank a slice of every expert), against transformers'
  ``Qwen3MoeForCausalLM``.
- The tiny random Qwen3-VL-MoE (``models/tiny-qwen3-vl-moe``: Qwen3-VL's tower,
  deep stack and M-RoPE, experts in the text model) with images and text on the
  static plan in float32 and on the dynamic plan in bfloat16, against
  ``Qwen3VLMoeForConditionalGeneration`` (its float32 dynamic-plan parity:
  ``test_qwen3_vl_moe.py``).

Each engine serves one class's tests and is shut down after them, so at most
one runs at a time."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.graph_config import compiled_with_buckets, image_engine_in_graph_mode
from tests.hf_reference import (
    Bf16Tally,
    compare_greedy_bf16,
    hf_greedy,
    hf_greedy_steps,
    load_hf_model,
)
from tests.mm_reference import (
    engine_lifetime,
    greedy_generate,
    hf_vlm_greedy_steps,
    make_image,
)
from tests.qwen_reference import (
    Case,
    check_parity,
    hf_qwen_inputs,
    qwen_prompt,
    tiny_qwen_dir,
)
from vllm_hpu_mm.metrics_reader import read_metric

pytestmark = pytest.mark.e2e

MAX_NEW = 10
LENGTHS = (5, 41, 17, 70)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
NUM_EXPERTS = 8
TOP_K = 2


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
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
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


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("Qwen3-MoE and Qwen3-VL-MoE, dynamic plan, CPU")
    yield t
    t.report(request.config)


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


def _hf_routing(model_dir: str, prompts: list[list[int]]) -> torch.Tensor:
    """Tokens each expert receives over ``prompts``' prompt tokens in
    transformers' model: ``[MoE layers, experts]``."""
    model = load_hf_model(model_dir)
    counts = torch.zeros(2, NUM_EXPERTS, dtype=torch.long)
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p]), output_router_logits=True).router_logits
            for layer, lg in enumerate(logits):
                ids = lg.topk(TOP_K, dim=-1).indices.flatten()
                counts[layer] += torch.bincount(ids, minlength=NUM_EXPERTS)
    return counts


def _llm(model_dir: str, dtype: str, hpu_mm: dict[str, Any], **kw: Any) -> Any:
    from vllm import LLM

    settings: dict[str, Any] = {
        "model": model_dir,
        "dtype": dtype,
        "max_model_len": 256,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "seed": 0,
        "additional_config": {"hpu_mm": hpu_mm},
    }
    return LLM(**(settings | kw))


# --- Qwen3-MoE, float32, static plan -----------------------------------------


# Few buckets, few graphs to warm up (a static plan compiles every one): the
# prompts' chunks pad to 16 or 64 tokens, decodes to 4 rows, every step to 32
# blocks of context.
BUCKETS = "prefill_tokens: [16, 64]\ndecode_batch: [4]\nblocks: [32]\n"


class TestStaticPlan:
    @pytest.fixture(scope="class")
    def llm(
        self, moe_dir: str, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Any]:
        config = compiled_with_buckets(tmp_path_factory, "moe", BUCKETS, "static")
        yield from engine_lifetime(_llm(moe_dir, "float32", config["hpu_mm"]))

    def test_matches_hf_and_compiles_nothing_across_routings(
        self, llm: Any, moe_dir: str
    ) -> None:
        # Two prompt sets whose tokens go to different experts (per-expert
        # token counts differ in every MoE layer), every expert reached.
        sets = [_prompts(seed) for seed in (1, 2)]
        routing = [_hf_routing(moe_dir, p) for p in sets]
        assert (routing[0] != routing[1]).any(dim=1).all(), routing
        assert ((routing[0] + routing[1]) > 0).all(), routing
        before = read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})
        for prompts in sets:
            assert _greedy(llm, prompts) == hf_greedy(moe_dir, prompts, MAX_NEW)
        after = read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})
        assert after == before, f"compiled while serving: {before} -> {after}"


# --- Qwen3-MoE, dynamic plan: float32 and bfloat16 ---------------------------


def _dynamic(moe_dir: str, dtype: str) -> Any:
    """The CPU's default path, named: graph mode, dynamic plan."""
    return _llm(
        moe_dir,
        dtype,
        {
            "graph_mode": "compile",
            "execution": "dynamic",
            "warmup": {"progress_bar": False},
        },
    )


class TestDynamicPlanFloat32:
    @pytest.fixture(scope="class")
    def llm(self, moe_dir: str) -> Iterator[Any]:
        yield from engine_lifetime(_dynamic(moe_dir, "float32"))

    def test_matches_hf(self, llm: Any, moe_dir: str) -> None:
        prompts = _prompts(4)
        assert _greedy(llm, prompts) == hf_greedy(moe_dir, prompts, MAX_NEW)


class TestDynamicPlanBfloat16:
    @pytest.fixture(scope="class")
    def llm(self, moe_dir: str) -> Iterator[Any]:
        yield from engine_lifetime(_dynamic(moe_dir, "bfloat16"))

    def test_matches_hf_up_to_near_ties(
        self, llm: Any, moe_dir: str, tally: Bf16Tally
    ) -> None:
        prompts = _prompts(5)
        for prompt, got in zip(prompts, _greedy(llm, prompts), strict=True):
            hf_tokens, hf_logits = hf_greedy_steps(
                moe_dir, prompt, MAX_NEW, torch.bfloat16
            )
            match = compare_greedy_bf16(got, hf_tokens, hf_logits)
            tally.add(f"Qwen3-MoE, prompt of {len(prompt)} tokens", match)


# --- Qwen3-MoE, tensor parallel ----------------------------------------------


class TestTensorParallel:
    @pytest.fixture(scope="class")
    def llm(self, moe_dir: str) -> Iterator[Any]:
        """TP=2 over gloo (vLLM's multiprocessing executor), eager: each rank
        holds half of every expert's intermediate rows and the layer
        all-reduces."""
        yield from engine_lifetime(
            _llm(
                moe_dir,
                "float32",
                {},
                max_num_batched_tokens=32,
                enforce_eager=True,
                tensor_parallel_size=2,
                distributed_executor_backend="mp",
            )
        )

    def test_experts_split_across_ranks_match_hf(self, llm: Any, moe_dir: str) -> None:
        prompts = _prompts(3)
        assert _greedy(llm, prompts) == hf_greedy(moe_dir, prompts, MAX_NEW)


# --- Qwen3-VL-MoE: static plan float32, dynamic plan bfloat16 ----------------

VL_BUCKETS = (
    "prefill_tokens: [32]\ndecode_batch: [4]\nblocks: [32]\nvision_patches: [64, 256]\n"
)


@pytest.fixture(scope="module")
def vl_dir() -> str:
    return tiny_qwen_dir("tiny-qwen3-vl-moe")


def _vl_cases() -> list[Case]:
    return [
        (
            qwen_prompt(2, "Which is brighter?", preamble="Two: "),
            [make_image("checkerboard", (64, 48), 1), make_image("stripes", (24, 56))],
        ),
        (qwen_prompt(0, "The quick brown fox"), []),
        (qwen_prompt(1, "Describe it."), [make_image("gradient", (40, 24), 2)]),
    ]


class TestVisionStaticPlan:
    @pytest.fixture(scope="class")
    def llm(
        self, vl_dir: str, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Any]:
        yield from engine_lifetime(
            image_engine_in_graph_mode(
                vl_dir,
                tmp_path_factory,
                "qwen3_vl_moe_static",
                VL_BUCKETS,
                32,
                "static",
            )
        )

    def test_images_and_text_match_hf_compiling_nothing(
        self, llm: Any, vl_dir: str
    ) -> None:
        before = read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})
        check_parity(llm, vl_dir, _vl_cases(), MAX_NEW)
        after = read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})
        assert after == before, f"compiled while serving: {before} -> {after}"


@functools.cache
def _hf_vl_bf16(model_dir: str) -> Any:
    from transformers import Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    return model


class TestVisionDynamicPlanBfloat16:
    @pytest.fixture(scope="class")
    def llm(
        self, vl_dir: str, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Any]:
        from vllm import LLM

        yield from engine_lifetime(
            LLM(
                model=vl_dir,
                dtype="bfloat16",
                max_model_len=256,
                max_num_seqs=4,
                max_num_batched_tokens=32,
                limit_mm_per_prompt={"image": 2},
                seed=0,
                additional_config=compiled_with_buckets(
                    tmp_path_factory, "qwen3_vl_moe_bf16", VL_BUCKETS, "dynamic"
                ),
            )
        )

    def test_images_and_text_match_hf_up_to_near_ties(
        self, llm: Any, vl_dir: str, tally: Bf16Tally
    ) -> None:
        cases = _vl_cases()
        requests = [
            {"prompt": p, "multi_modal_data": {"image": ims}} if ims else {"prompt": p}
            for p, ims in cases
        ]
        outputs = greedy_generate(llm, requests, MAX_NEW)
        for i, ((prompt, images), out) in enumerate(zip(cases, outputs, strict=True)):
            inputs = hf_qwen_inputs(vl_dir, prompt, images)
            assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
            hf_tokens, hf_logits = hf_vlm_greedy_steps(
                _hf_vl_bf16(vl_dir), inputs, MAX_NEW
            )
            got = list(out.outputs[0].token_ids)
            match = compare_greedy_bf16(got, hf_tokens, hf_logits)
            tally.add(f"Qwen3-VL-MoE case {i} ({len(images)} images)", match)
