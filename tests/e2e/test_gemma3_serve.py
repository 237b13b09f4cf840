"""``vllm serve`` with the tiny Gemma 3: chat requests with base64 PNG images of
several sizes, each answer equal to HF greedy (bidirectional image attention) on
the prompt the model's chat template renders.

The server is started like ``test_serve.py``'s (same helpers, its log checked for
tracebacks at the end). Images of different sizes are resized to the tower's
32x32 by the (PIL) Gemma 3 image processor on both sides.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_gemma3 import MAX_NEW, Case, hf_greedy, hf_processor, image
from tests.e2e.test_serve import Server, serve
from tests.mm_reference import chat_messages

pytestmark = pytest.mark.e2e

QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.conftest import _tiny_model_dir

    log_path = tmp_path_factory.mktemp("serve_gemma3") / "server.log"
    yield from serve(
        _tiny_model_dir("tiny-gemma3"),
        log_path,
        "--limit-mm-per-prompt",
        json.dumps({"image": 2}),
    )


def check_chat(server: Server, images: list[Any]) -> None:
    out = server.greedy_image_chat(images, QUESTION, MAX_NEW)
    prompt = hf_processor(server.model).apply_chat_template(
        chat_messages(QUESTION, len(images)), add_generation_prompt=True, tokenize=False
    )
    c = Case(prompt, images, add_special_tokens=False)
    want_prompt = hf_processor(server.model)(
        text=prompt, images=images or None, add_special_tokens=False
    )["input_ids"][0]
    assert out["prompt_token_ids"] == list(want_prompt), out["prompt_token_ids"]
    assert out["choices"][0]["token_ids"] == hf_greedy(server.model, c)


def test_chat_with_one_image(server: Server) -> None:
    check_chat(server, [image("stripes")])  # 64x48


def test_chat_with_two_images_of_other_sizes(server: Server) -> None:
    check_chat(server, [image("checker"), image("gradient")])  # 24x40, 40x24


def test_chat_text_only(server: Server) -> None:
    check_chat(server, [])
