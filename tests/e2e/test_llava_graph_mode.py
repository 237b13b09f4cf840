"""LLaVA in graph mode: the vision encoder and the language model are compiled
per bucket at warmup; a mixed image batch then compiles nothing and matches HF."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.graph_config import compiled_with_buckets
from tests.mm_reference import hf_llava_greedy, llava_prompt, make_image, tiny_llava_dir
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 8


@pytest.fixture(scope="module")
def llava_dir() -> str:
    return tiny_llava_dir()


@pytest.fixture(scope="module")
def llm(llava_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "llava",
        "prefill_tokens: [32, 64]\ndecode_batch: [1, 4]\nblocks: [4, 16]\n",
    )
    engine = LLM(
        model=llava_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        seed=0,
        limit_mm_per_prompt={"image": 2},
        additional_config=hpu_mm,
    )
    yield engine
    del engine


def test_image_batch_compiles_nothing_after_warmup(llm: object, llava_dir: str) -> None:
    from vllm import SamplingParams

    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    cases = [
        (llava_prompt(1), [make_image("gradient", (40, 24), 3)]),
        (llava_prompt(0, "Say something."), []),
        (
            llava_prompt(2, preamble="Two pictures: "),
            [
                make_image("checkerboard", (24, 40), 4),
                make_image("stripes", (32, 32), 5),
            ],
        ),
    ]
    requests = [
        {"prompt": p, "multi_modal_data": {"image": ims}} if ims else {"prompt": p}
        for p, ims in cases
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(requests, params, use_tqdm=False)  # type: ignore[attr-defined]
    for (prompt, images), out in zip(cases, outs, strict=True):
        expected = hf_llava_greedy(llava_dir, prompt, images, MAX_NEW)
        assert list(out.outputs[0].token_ids) == expected
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
