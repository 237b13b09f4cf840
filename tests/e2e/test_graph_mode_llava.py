"""Graph mode with images (tiny LLaVA): every step shape warmed, none compiled
while serving, tokens equal to HF's.

Attention is traced into the compiled layers, so a multimodal step's graph key
is its whole shape; images add encoder graphs (one per images-per-batch size)
and merged embeddings, which must not add step shapes of their own. The
prompts mix text, one and two images, chunked at a 32-token budget beside
decoding requests. LLaVA in graph mode on the dynamic path (the CPU's
default) is checked by ``test_bf16_llava.py``, in float32 eager by
``test_llava.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.graph_config import compiled_with_buckets
from tests.mm_reference import (
    engine_lifetime,
    greedy_generate,
    hf_llava_greedy,
    llava_prompt,
    named_image,
    tiny_llava_dir,
)
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_llava_dir()


@pytest.fixture(scope="module")
def llm(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "llava",
        "prefill_tokens: [8, 32]\ndecode_batch: [1, 4]\nblocks: [4, 16, 32]\n",
        execution="static",  # Gaudi's path: a graph per step shape
    )
    engine = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_chunked_prefill=True,
        seed=0,
        limit_mm_per_prompt={"image": 2},
        additional_config=hpu_mm,
    )
    yield from engine_lifetime(engine)


CASES = [
    (0, (), "Tell me a story. "),
    (1, ("gradient_40x24",), ""),
    (2, ("checker_24x40", "stripes_64x48"), "Look at this. "),
    (1, ("solid_32x32",), "Here is a photo I took on holiday: "),
    (0, (), "Our team meets every Tuesday to review progress. " * 2),
]


def test_images_serve_without_compiling_and_match_hf(llm: Any, model_dir: str) -> None:
    from vllm_hpu_mm.bucketing.buckets import Limits, explicit, step_shapes

    limits = Limits(4, 32, 256, 16)
    decode, prefill = step_shapes(
        explicit(limits, [8, 32], [1, 4], [4, 16, 32]), limits, "flat"
    )
    warmed = _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"})
    # One graph per step shape for all decoder layers, one per logits size, the
    # rest are the vision tower's (encoder sizes).
    assert warmed >= len(decode) + len(prefill) + 2

    inputs, expected = [], []
    for n, names, preamble in CASES:
        prompt = llava_prompt(n, preamble=preamble)
        images = [named_image(x) for x in names]
        inputs.append(
            {"prompt": prompt, "multi_modal_data": {"image": images}}
            if images
            else {"prompt": prompt}
        )
        expected.append(hf_llava_greedy(model_dir, prompt, images, MAX_NEW))
    outs = greedy_generate(llm, inputs, MAX_NEW)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
