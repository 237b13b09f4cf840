"""Mllama on vLLM V1 through the plugin, greedy token-identical to transformers.

One eager engine for the module, with a 16-token step budget so that prefill is
chunked through the prompts (before, at and after the images). Every case is
compared with transformers' ``MllamaForConditionalGeneration`` on the same token
ids (see ``tests.mllama_reference``). Images have different aspect ratios, so
they get 1, 2, 3 or 4 tiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.mllama_reference import hf_mllama_greedy, tiny_mllama_dir
from tests.mm_reference import engine_lifetime, greedy_generate, make_image

pytestmark = pytest.mark.e2e

MAX_NEW = 8
BUDGET = 16  # tokens per step: prompts below are cut into several chunks
LONG_TEXT = "The quick brown fox jumps over the lazy dog near the river bank. "


def _metric(name: str) -> float:
    from vllm_hpu_mm.metrics_reader import read_metric

    return read_metric(name)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_mllama_dir()


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[Any]:
    from vllm import LLM

    yield from engine_lifetime(
        LLM(
            model=model_dir,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=6,
            max_num_batched_tokens=BUDGET,
            limit_mm_per_prompt={"image": 2},
            enforce_eager=True,
            seed=0,
        )
    )


def _request(prompt: str, images: list[Any]) -> dict[str, Any]:
    if not images:
        return {"prompt": prompt}
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def _check_against_hf(
    model_dir: str, cases: list[tuple[str, list[Any]]], outs: list[Any]
) -> None:
    for (prompt, images), out in zip(cases, outs, strict=True):
        expected = hf_mllama_greedy(
            model_dir, list(out.prompt_token_ids), images, MAX_NEW
        )
        assert list(out.outputs[0].token_ids) == expected, prompt


# Widths x heights chosen for 1, 2, 3 and 4 tiles of 32x32.
WIDE = (96, 30)  # 1x3 tiles
TALL = (30, 64)  # 2x1
SQUARE = (32, 32)  # 1x1
BIG = (64, 64)  # 2x2


def test_zero_one_two_images_chunked(llm: Any, model_dir: str) -> None:
    cases = [
        ("Hello there, how are you today?", []),
        ("<|image|>What is in this picture?", [make_image("gradient", WIDE, 1)]),
        (
            LONG_TEXT + "Now look: <|image|> and describe it.",
            [make_image("checkerboard", TALL, 2)],
        ),
        (
            "First <|image|> then some words in between <|image|> compare them.",
            [make_image("stripes", SQUARE, 3), make_image("gradient", BIG, 4)],
        ),
        (
            LONG_TEXT + "Two at once: <|image|><|image|> which is brighter?",
            [make_image("solid", BIG, 5), make_image("checkerboard", WIDE, 6)],
        ),
    ]
    outs = greedy_generate(llm, [_request(p, ims) for p, ims in cases], MAX_NEW)
    # The long prompts really were cut: they exceed one step's budget.
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * BUDGET
    _check_against_hf(model_dir, cases, outs)


def test_concurrent_requests_with_different_images(llm: Any, model_dir: str) -> None:
    sizes = [WIDE, TALL, SQUARE, BIG, (50, 20)]
    kinds = ["gradient", "checkerboard", "stripes", "solid", "gradient"]
    cases = [
        (f"Picture {i}: <|image|> tell me about it.", [make_image(k, s, 10 + i)])
        for i, (k, s) in enumerate(zip(kinds, sizes, strict=True))
    ]
    outs = greedy_generate(llm, [_request(p, ims) for p, ims in cases], MAX_NEW)
    _check_against_hf(model_dir, cases, outs)
    # Different images lead somewhere different: the images are really read.
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_image_changes_tokens_before_it(llm: Any, model_dir: str) -> None:
    """Tokens before the first image read every image (HF's rule), so a prompt
    that only differs in its image differs already in its text-only prefix."""
    prompt = LONG_TEXT + "<|image|>"
    a, b = make_image("gradient", BIG, 20), make_image("checkerboard", BIG, 21)
    outs = greedy_generate(llm, [_request(prompt, [a]), _request(prompt, [b])], MAX_NEW)
    _check_against_hf(model_dir, [(prompt, [a]), (prompt, [b])], outs)


def test_repeated_image_hits_the_prefix_cache_and_skips_the_encoder(
    llm: Any, model_dir: str
) -> None:
    image = make_image("stripes", TALL, 30)
    prompt = LONG_TEXT + LONG_TEXT + "Here: <|image|> what is it?"
    cold = greedy_generate(llm, [_request(prompt, [image])], MAX_NEW)[0]
    runs = _metric("vllm_hpu_mm:encoder_runs_total")
    warm = greedy_generate(llm, [_request(prompt, [image])], MAX_NEW)[0]
    assert warm.num_cached_tokens >= 16
    assert _metric("vllm_hpu_mm:encoder_runs_total") == runs  # not encoded again
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    _check_against_hf(model_dir, [(prompt, [image])], [warm])


def test_same_text_other_image_gets_no_false_hit(llm: Any, model_dir: str) -> None:
    prompt = LONG_TEXT + LONG_TEXT + "Look at <|image|> please."
    first, other = make_image("gradient", WIDE, 40), make_image("solid", WIDE, 41)
    greedy_generate(llm, [_request(prompt, [first])], MAX_NEW)
    out = greedy_generate(llm, [_request(prompt, [other])], MAX_NEW)[0]
    # Even the text before the image depends on the image: nothing is reused.
    assert out.num_cached_tokens == 0
    _check_against_hf(model_dir, [(prompt, [other])], [out])


def test_multi_turn_chat_reencodes_nothing(llm: Any, model_dir: str) -> None:
    from vllm import SamplingParams

    from tests.mm_reference import png_data_url

    image = make_image("checkerboard", BIG, 50)
    url = png_data_url(image)
    turn1 = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.chat(turn1, params, use_tqdm=False)[0]
    runs = _metric("vllm_hpu_mm:encoder_runs_total")
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "A board of squares."},
        {"role": "user", "content": "And what colours does it have?"},
    ]
    second = llm.chat(turn2, params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 16  # turn 1's blocks are reused
    assert _metric("vllm_hpu_mm:encoder_runs_total") == runs
    for out in (first, second):
        expected = hf_mllama_greedy(
            model_dir, list(out.prompt_token_ids), [image], MAX_NEW
        )
        assert list(out.outputs[0].token_ids) == expected
