"""Qwen3-VL-MoE (the vision-language mixture-of-experts form Gaudi teams serve,
e.g. Qwen3-VL-30B-A3B) through ``vllm.LLM``: Qwen3-VL's tower, deep stack and
M-RoPE with the plugin's experts kernel in the text model. A tiny random
checkpoint as transformers writes it, float32, graph mode on the dynamic plan,
tensor parallel over two ranks (vLLM's multiprocessing executor: each rank holds
half of every expert's intermediate rows, the vision tower's heads split), a
32-token step budget that cuts images; greedy tokens identical to transformers'
``Qwen3VLMoeForConditionalGeneration``, nothing compiled while serving across
the routings of different images and prompts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.graph_config import image_engine_in_graph_mode
from tests.mm_reference import engine_lifetime, make_image
from tests.qwen_reference import Case, check_parity, qwen_prompt, tiny_qwen_dir
from vllm_hpu_mm.metrics_reader import read_metric

pytestmark = pytest.mark.e2e

MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_qwen_dir("tiny-qwen3-vl-moe")


@pytest.fixture(scope="module")
def llm(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = image_engine_in_graph_mode(
        model_dir,
        tmp_path_factory,
        "qwen3_vl_moe",
        "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [8, 32]\n"
        "vision_patches: [64, 256]\n",
        32,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    yield from engine_lifetime(engine)


def test_images_and_text_match_hf(llm: Any, model_dir: str) -> None:
    cases: list[Case] = [
        (
            qwen_prompt(2, "Which is brighter?", preamble="Two: "),
            [make_image("checkerboard", (64, 48), 1), make_image("stripes", (24, 56))],
        ),
        (qwen_prompt(0, "The quick brown fox"), []),
        (qwen_prompt(1, "Describe it."), [make_image("gradient", (40, 24), 2)]),
    ]
    check_parity(llm, model_dir, cases, MAX_NEW)
    # Both ranks' counts reach this process (vLLM's multiprocess metrics).
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
