"""Graph mode with Gemma 3's bidirectional images (tiny Gemma 3): every step
shape warmed, none compiled while serving, tokens equal to HF's.

A bidirectional-image model's prefill steps carry the rows' image spans
(``prefill_tile_span_lo/hi``) and its tiles widen to the end of their images;
warmup prepares the steps with (empty) spans, so a step with images must find
its graph. Text, one and two images in one batch at a 24-token budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_gemma3 import BUDGET, MAX_NEW, case, hf_greedy
from tests.graph_config import image_engine_in_graph_mode
from tests.mm_reference import engine_lifetime, greedy_generate
from vllm_hpu_mm.metrics_reader import read_metric

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model_dir() -> str:
    from tests.conftest import _tiny_model_dir

    return _tiny_model_dir("tiny-gemma3")


@pytest.fixture(scope="module")
def llm(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = image_engine_in_graph_mode(
        model_dir,
        tmp_path_factory,
        "gemma3",
        f"prefill_tokens: [8, {BUDGET}]\ndecode_batch: [1, 4]\nblocks: [4, 16]\n",
        BUDGET,
    )
    yield from engine_lifetime(engine)


def test_images_serve_without_compiling_and_match_hf(llm: Any, model_dir: str) -> None:
    cases = [
        case("Describe the picture.", "gradient", preamble="Look at this: "),
        case("What is the capital of France?"),
        case("Compare the two pictures.", "checker", "stripes"),
    ]
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    outs = greedy_generate(llm, [c.vllm_input() for c in cases], MAX_NEW)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == [hf_greedy(model_dir, c) for c in cases]
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert read_metric("vllm_hpu_mm:fallback_buckets_total") == 0
