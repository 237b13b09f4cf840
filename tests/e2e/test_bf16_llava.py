"""LLaVA in bfloat16 through ``vllm.LLM`` in graph mode, compared with HF
transformers' LLaVA in bfloat16.

The vision tower is compiled per items bucket at warmup; the request's pixel
values (float32 from the CLIP image processor) are cast to the model dtype
where they enter the encoder, so a mixed text and image batch compiles nothing
after warmup. Greedy outputs are compared up to the first near-tie
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
from tests.mm_reference import (
    engine_lifetime,
    greedy_generate,
    hf_llava_greedy_steps,
    llava_prompt,
    make_image,
    tiny_llava_dir,
)
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 8


def _serving_compiles() -> float:
    return _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("LLaVA, vllm.LLM")
    yield t
    t.report(request.config)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "llava",
        "prefill_tokens: [32, 64]\ndecode_batch: [1, 4]\nblocks: [4, 16]\n",
    )
    yield from engine_lifetime(
        LLM(
            model=tiny_llava_dir(),
            dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            seed=0,
            limit_mm_per_prompt={"image": 2},
            additional_config=hpu_mm,
        )
    )


CASES = [
    (llava_prompt(1), [make_image("gradient", (40, 24), 3)]),
    (llava_prompt(0, "Say something."), []),
    (
        llava_prompt(2, preamble="Two pictures: "),
        [make_image("checkerboard", (24, 40), 4), make_image("stripes", (32, 32), 5)],
    ),
    (llava_prompt(1, "What colour?"), [make_image("solid", (64, 48), 6)]),
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
        hf_tokens, hf_logits = hf_llava_greedy_steps(
            tiny_llava_dir(), prompt, images, MAX_NEW, torch.bfloat16
        )
        got = list(out.outputs[0].token_ids)
        tally.add(
            f"{len(images)} images: {prompt!r}",
            compare_greedy_bf16(got, hf_tokens, hf_logits),
        )
    assert _serving_compiles() == compiles_before, "images recompiled after warmup"
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
