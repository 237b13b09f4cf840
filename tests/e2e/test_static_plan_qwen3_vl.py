"""``execution: static`` (Gaudi's path) on the CPU with tiny Qwen3-VL: attention
traced into static graphs per bucket, tiled prefill, flat paged decode,
two-pass mixed steps, the vision tower per patch bucket. One engine, float32,
token-identical to HF transformers: a batch whose images are cut by the
32-token step budget beside decoding requests, then a prefix-cache hit that
ends inside an image; no compilation while serving.
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
