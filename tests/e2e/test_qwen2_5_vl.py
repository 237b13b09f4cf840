"""vLLM's Qwen2.5-VL through ``vllm.LLM`` on the plugin: greedy parity with HF.

One engine for the module (float32, graph mode over explicit buckets on
``execution: static``, Gaudi's path: attention traced into static graphs per
bucket, tiled prefill, flat paged decode, two-pass mixed steps, the vision
tower per patch bucket; a 32-token step budget so that chunked prefill cuts
through images: every image here has 4 to 52 placeholder tokens). HF
transformers' ``generate`` on the same prompt ids and pixel values (the
processor saved with the model: the PIL image processor, no torchvision) is
the oracle. The language model takes M-RoPE
positions ([3, T]: temporal, height, width), computed per request by the
model's own ``get_mrope_input_positions`` and carried through chunks, prefix-cache
hits and decode (``vllm_hpu_mm.worker.mrope``); the vision tower takes every
image at its own resolution (flat patches plus one grid row per image), padded
to a patch bucket by a padding image (``vllm_hpu_mm.worker.vision_buckets``).
Qwen2.5-VL on the dynamic path (the CPU's default) is served by
``test_qwen_serve.py``; M-RoPE in dynamic graph mode by ``test_qwen3_vl_moe.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tests.graph_config import image_engine_in_graph_mode
from tests.mm_reference import engine_lifetime, make_image
from tests.qwen_reference import (
    Case,
    check_parity,
    num_image_tokens,
    qwen_prompt,
    tiny_qwen_dir,
)
from vllm_hpu_mm.metrics_reader import read_metric

pytestmark = pytest.mark.e2e

MAX_NEW = 8
BUDGET = 32  # max_num_batched_tokens: smaller than most images' placeholders


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_qwen_dir()


@pytest.fixture(scope="module")
def llm(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = image_engine_in_graph_mode(
        model_dir,
        tmp_path_factory,
        "static_qwen2_5_vl",
        "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [8, 32]\n",
        BUDGET,
        execution="static",
    )
    yield from engine_lifetime(engine)


def _check(llm: Any, model_dir: str, cases: Sequence[Case]) -> list[Any]:
    return check_parity(llm, model_dir, cases, MAX_NEW)


def test_image_sizes_give_their_own_token_counts(model_dir: str) -> None:
    # Dynamic resolution: the cases below really differ in placeholder length
    # (and several are longer than the step budget, so chunks cut them).
    sizes = [(40, 24), (24, 56), (64, 48), (100, 30), (16, 16)]
    counts = [num_image_tokens(model_dir, make_image("gradient", s)) for s in sizes]
    assert counts == [15, 21, 48, 48, 4]


def test_text_only(llm: Any, model_dir: str) -> None:
    _check(llm, model_dir, [(qwen_prompt(0, "Say something nice."), [])])


def test_one_image(llm: Any, model_dir: str) -> None:
    _check(llm, model_dir, [(qwen_prompt(1), [make_image("gradient", (40, 24))])])


def test_two_images_of_different_sizes_in_one_prompt(llm: Any, model_dir: str) -> None:
    images = [make_image("checkerboard", (64, 48), 1), make_image("stripes", (24, 56))]
    _check(llm, model_dir, [(qwen_prompt(2, preamble="Compare: "), images)])


def test_batch_of_resolutions_with_chunked_prefill(llm: Any, model_dir: str) -> None:
    # Four prompts at once under a 32-token budget: each step mixes chunks of
    # several requests, images are cut across steps, decodes run beside them.
    cases: list[Case] = [
        (qwen_prompt(1, "Describe it."), [make_image("stripes", (100, 30), 2)]),
        (qwen_prompt(0, "The quick brown fox"), []),
        (qwen_prompt(1), [make_image("solid", (16, 16), 3)]),
        (
            qwen_prompt(2, "Which is brighter?", preamble="Two: "),
            [
                make_image("gradient", (24, 56), 4),
                make_image("checkerboard", (40, 24), 5),
            ],
        ),
    ]
    _check(llm, model_dir, cases)
    # Every language-model shape and every vision patch bucket (16 to 256
    # patches: the encoder budget of 64 rows times 2x2 merge) was compiled at
    # warmup, with padding images only: these resolutions compile nothing.
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert read_metric("vllm_hpu_mm:fallback_buckets_total") == 0
    assert read_metric("vllm_hpu_mm:vision_patches_total") > 0
    assert read_metric("vllm_hpu_mm:vision_padding_patches_total") > 0


def test_prefix_cache_hit(llm: Any, model_dir: str) -> None:
    # The same prompt twice, in two calls: the second starts after the cached
    # blocks (which end inside the image), so its M-RoPE positions are read
    # from the middle of the stored prompt positions.
    case = (qwen_prompt(1, "Again?"), [make_image("stripes", (64, 48), 7)])
    _check(llm, model_dir, [case])
    (out,) = _check(llm, model_dir, [case])
    assert out.num_cached_tokens >= 32, out.num_cached_tokens
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert read_metric("vllm_hpu_mm:fallback_buckets_total") == 0
