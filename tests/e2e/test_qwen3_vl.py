"""vLLM's Qwen3-VL through ``vllm.LLM`` on the plugin, on ``execution: static``
(Gaudi's path) on the CPU: attention traced into static graphs per bucket,
tiled prefill, flat paged decode, two-pass mixed steps, the vision tower per
patch bucket. One engine, float32, token-identical to HF transformers: one
image alone, a batch whose images are cut by the 32-token step budget beside
decoding requests, then a prefix-cache hit that ends inside an image (its
M-RoPE positions and deep-stack rows start mid-image); no compilation while
serving.

The Qwen2.5-VL machinery (``test_qwen2_5_vl.py``: M-RoPE positions per request,
patch-bucketed vision tower, PIL images-only processor) plus Qwen3-VL's deep
stack: the tower's output rows are the main features followed by one feature
row per deep-stack level (here 2); the main part is merged into the token
embeddings, the levels are scattered to the same token rows of a [levels, T, H]
tensor that the model adds to the outputs of its first decoder layers, handed
over per pass (a mixed step's decode and prefill passes each get their rows).
The deep stack on the dynamic path (the CPU's default, graph mode) is checked
by ``test_qwen3_vl_moe.py``.
"""

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
    return tiny_qwen_dir("tiny-qwen3-vl")


@pytest.fixture(scope="module")
def llm(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = image_engine_in_graph_mode(
        model_dir,
        tmp_path_factory,
        "static_qwen3_vl",
        "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [8, 32]\n"
        "vision_patches: [64, 256]\n",
        32,
        execution="static",
    )
    yield from engine_lifetime(engine)


def test_one_image(llm: Any, model_dir: str) -> None:
    case = (qwen_prompt(1), [make_image("gradient", (40, 24))])
    check_parity(llm, model_dir, [case], MAX_NEW)


def test_chunked_images_mixed_steps_and_prefix_hit(llm: Any, model_dir: str) -> None:
    cases: list[Case] = [
        (
            qwen_prompt(2, "Which is brighter?", preamble="Two: "),
            [make_image("checkerboard", (64, 48), 1), make_image("stripes", (24, 56))],
        ),
        (qwen_prompt(0, "The quick brown fox"), []),
        (qwen_prompt(1, "Describe it."), [make_image("stripes", (100, 30), 2)]),
        (qwen_prompt(1), [make_image("solid", (16, 16), 3)]),
    ]
    check_parity(llm, model_dir, cases, MAX_NEW)
    again = (qwen_prompt(1, "Again?"), [make_image("stripes", (64, 48), 7)])
    check_parity(llm, model_dir, [again], MAX_NEW)
    (out,) = check_parity(llm, model_dir, [again], MAX_NEW)
    assert out.num_cached_tokens >= 32, out.num_cached_tokens
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert read_metric("vllm_hpu_mm:fallback_buckets_total") == 0
