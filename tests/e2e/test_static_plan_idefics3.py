"""``execution: static`` (Gaudi's path) on the CPU with tiny Idefics3: attention
traced into static graphs per bucket, tiled prefill, flat paged decode,
two-pass mixed steps. One engine, float32, token-identical to HF transformers:
images whose placeholder runs are cut by the step budget, beside a text prompt
and decoding requests, then an image prompt again (a prefix-cache hit); no
compilation while serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_vlm2 import (
    BUDGET,
    MAX_NUM_SEQS,
    check_parity,
    image_case,
    text_case,
)
from tests.graph_config import compiled_with_buckets
from tests.mm_reference import engine_lifetime
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(
    tiny_idefics3_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "static_idefics3",
        f"prefill_tokens: [{BUDGET}]\ndecode_batch: [1, {MAX_NUM_SEQS}]\n"
        "blocks: [4, 16]\n",
        execution="static",
    )
    engine = LLM(
        model=tiny_idefics3_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        seed=0,
        additional_config=hpu_mm,
    )
    yield from engine_lifetime(engine)


def test_chunked_images_mixed_steps_and_prefix_hit(
    llm: Any, tiny_idefics3_dir: str
) -> None:
    cases = [
        image_case("checker_24x40", "What is in this image?"),
        text_case("Please answer in a single clear sentence."),
        image_case("gradient_32x32", "What is in this image?"),
    ]
    check_parity(llm, tiny_idefics3_dir, cases)
    again = image_case("bands_40x24")
    check_parity(llm, tiny_idefics3_dir, [again])
    (out,) = check_parity(llm, tiny_idefics3_dir, [again])
    assert (out.num_cached_tokens or 0) >= 16, out.num_cached_tokens
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
