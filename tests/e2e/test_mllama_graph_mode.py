"""Mllama in graph mode: the vision encoder (per images bucket; on the CPU a
symbolic image count) and the language model (per token bucket) are compiled
at warmup; serving a mixed batch with images of different tile counts then
compiles nothing and matches HF."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.graph_config import compiled_with_buckets
from tests.mllama_reference import hf_mllama_greedy, tiny_mllama_dir
from tests.mm_reference import engine_lifetime, greedy_generate, make_image
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 6


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "mllama",
        "prefill_tokens: [16, 32]\ndecode_batch: [1, 2]\nblocks: [4, 8]\n",
    )
    yield from engine_lifetime(
        LLM(
            model=tiny_mllama_dir(),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            seed=0,
            limit_mm_per_prompt={"image": 2},
            additional_config=hpu_mm,
        )
    )


def test_mixed_image_batch_compiles_nothing_after_warmup(llm: Any) -> None:
    warmup = _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"})
    assert warmup > 0
    cases = [
        ("Look: <|image|> what is it?", [make_image("gradient", (96, 30), 1)]),
        ("Just words here, nothing else.", []),
        (
            "Two: <|image|> and <|image|> compare.",
            [make_image("checkerboard", (30, 64), 2), make_image("solid", (64, 64), 3)],
        ),
    ]
    requests = [
        {"prompt": p, "multi_modal_data": {"image": ims}} if ims else {"prompt": p}
        for p, ims in cases
    ]
    outs = greedy_generate(llm, requests, MAX_NEW)
    for (_, images), out in zip(cases, outs, strict=True):
        expected = hf_mllama_greedy(
            tiny_mllama_dir(), list(out.prompt_token_ids), images, MAX_NEW
        )
        assert list(out.outputs[0].token_ids) == expected
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
