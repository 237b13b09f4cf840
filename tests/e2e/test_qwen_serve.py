"""``vllm serve`` with the tiny Qwen2.5-VL: chat requests with base64 PNG images
of several sizes (dynamic resolution), greedy-identical with HF on the prompt the
model's chat template renders."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_serve import Server, serve
from tests.mm_reference import chat_messages, make_image
from tests.qwen_reference import hf_qwen_greedy, load_hf_qwen_processor, tiny_qwen_dir

pytestmark = pytest.mark.e2e

MAX_NEW = 8
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serve_qwen") / "server.log"
    yield from serve(
        tiny_qwen_dir(), log_path, "--limit-mm-per-prompt", json.dumps({"image": 2})
    )


def _check_chat(server: Server, images: list[Any]) -> None:
    out = server.greedy_image_chat(images, QUESTION, MAX_NEW)
    prompt = load_hf_qwen_processor(server.model).apply_chat_template(
        chat_messages(QUESTION, len(images)), add_generation_prompt=True, tokenize=False
    )
    want_prompt, want = hf_qwen_greedy(
        server.model, prompt, images, MAX_NEW, add_special_tokens=False
    )
    assert out["prompt_token_ids"] == want_prompt, (out["prompt_token_ids"], prompt)
    assert out["choices"][0]["token_ids"] == want


def test_chat_with_images_of_several_sizes_matches_hf(server: Server) -> None:
    _check_chat(server, [make_image("gradient", (40, 24))])
    _check_chat(
        server,
        [make_image("checkerboard", (64, 48), 1), make_image("stripes", (24, 56))],
    )
    _check_chat(server, [])
