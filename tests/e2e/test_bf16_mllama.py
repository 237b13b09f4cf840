"""Mllama in bfloat16 through ``vllm.LLM`` in graph mode, compared with HF
transformers' Mllama in bfloat16.

The vision encoder is compiled per images bucket at warmup with the model's
dtype; a request's pixel values arrive from the processor in float32 and must
be cast at the runner's boundary, or every images bucket compiles again on its
first real request. Greedy outputs are compared up to the first near-tie
(``tests.hf_reference.compare_greedy_bf16``: HF's top-2 margin at most 2
bfloat16 spacings); the module prints how many cases needed that tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.graph_config import compiled_with_buckets
from tests.hf_reference import Bf16Tally, compare_greedy_bf16
from tests.mllama_reference import hf_mllama_greedy_steps, tiny_mllama_dir
from tests.mm_reference import engine_lifetime, greedy_generate, make_image
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 8


def _serving_compiles() -> float:
    return _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("Mllama, vllm.LLM")
    yield t
    t.report(request.config)


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
            dtype="bfloat16",
            max_model_len=128,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            seed=0,
            limit_mm_per_prompt={"image": 2},
            additional_config=hpu_mm,
        )
    )


CASES = [
    ("Look: <|image|> what is it?", [make_image("gradient", (96, 30), 1)]),
    ("Just words here, nothing else.", []),
    (
        "Two: <|image|> and <|image|> compare.",
        [make_image("checkerboard", (30, 64), 2), make_image("solid", (64, 64), 3)],
    ),
    ("<|image|> A tall one.", [make_image("stripes", (20, 90), 4)]),
]


def test_bf16_mixed_image_batch_matches_hf_and_compiles_nothing(
    llm: Any, tally: Bf16Tally
) -> None:
    assert llm.llm_engine.model_config.dtype == torch.bfloat16
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    compiles_before = _serving_compiles()
    requests = [
        {"prompt": p, "multi_modal_data": {"image": ims}} if ims else {"prompt": p}
        for p, ims in CASES
    ]
    outs = greedy_generate(llm, requests, MAX_NEW)
    for (prompt, images), out in zip(CASES, outs, strict=True):
        hf_tokens, hf_logits = hf_mllama_greedy_steps(
            tiny_mllama_dir(),
            list(out.prompt_token_ids),
            images,
            MAX_NEW,
            torch.bfloat16,
        )
        match = compare_greedy_bf16(
            list(out.outputs[0].token_ids), hf_tokens, hf_logits
        )
        tally.add(f"{len(images)} images: {prompt!r}", match)
    assert _serving_compiles() == compiles_before, "images recompiled after warmup"
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
