"""``execution: static`` (Gaudi's path) on the CPU with tiny Mllama: attention
traced into static graphs per bucket, tiled prefill, flat paged decode,
two-pass mixed steps, the flat cross-attention layout and one vision-encoder
graph per images bucket. One engine, float32, token-identical to HF
transformers on a batch mixing text, one and two images of different tile
counts, then the same image prompt again (a prefix-cache hit); no compilation
while serving. Mllama in graph mode on the dynamic path (the CPU's default: a
symbolic image count for the vision encoder) is checked by
``test_bf16_mllama.py``, in float32 eager by ``test_mllama.py``.
"""

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
        "static_mllama",
        "prefill_tokens: [16, 32]\ndecode_batch: [1, 2]\nblocks: [4, 8]\n",
        execution="static",
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


def _check(llm: Any, cases: list[tuple[str, list[Any]]]) -> list[Any]:
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
    return outs


def test_mixed_image_batch_and_prefix_hit_match_hf(llm: Any) -> None:
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    long = "Please look very carefully at this picture and then tell me: "
    cases = [
        ("Look: <|image|> what is it?", [make_image("gradient", (96, 30), 1)]),
        ("Just words here, nothing else.", []),
        (
            "Two: <|image|> and <|image|> compare.",
            [make_image("checkerboard", (30, 64), 2), make_image("solid", (64, 64), 3)],
        ),
    ]
    _check(llm, cases)
    again = (long + "<|image|> which colours?", [make_image("stripes", (64, 48), 4)])
    _check(llm, [again])
    (out,) = _check(llm, [again])
    assert (out.num_cached_tokens or 0) >= 16, out.num_cached_tokens
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
