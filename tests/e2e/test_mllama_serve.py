"""``vllm serve`` with the tiny Mllama: chat with images, compared with HF.

The answer's token ids (``return_token_ids``) are compared with transformers'
greedy continuation of the same prompt ids and image (``tests.mllama_reference``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_serve import Server, serve
from tests.mllama_reference import hf_mllama_greedy, mllama_chat, tiny_mllama_dir
from tests.mm_reference import make_image

pytestmark = pytest.mark.e2e

MAX_NEW = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serve_mllama") / "server.log"
    yield from serve(
        tiny_mllama_dir(), log_path, "--limit-mm-per-prompt", json.dumps({"image": 2})
    )


def _chat(server: Server, images: list[Any], question: str) -> Any:
    return mllama_chat(server, images, question, MAX_NEW)


@pytest.mark.parametrize(
    "images",
    [
        [make_image("gradient", (96, 30), 1)],
        [make_image("checkerboard", (30, 64), 2), make_image("solid", (64, 64), 3)],
        [],
    ],
    ids=["one_image", "two_images", "text_only"],
)
def test_chat_matches_hf(server: Server, images: list[Any]) -> None:
    response = _chat(server, images, "What is in this picture?")
    assert response.status_code == 200, response.text
    data = response.json()
    got = data["choices"][0]["token_ids"]
    prompt_ids = data["prompt_token_ids"]
    assert len(got) == MAX_NEW
    assert hf_mllama_greedy(str(tiny_mllama_dir()), prompt_ids, images, MAX_NEW) == got


def test_too_many_images_is_a_400_and_serving_goes_on(server: Server) -> None:
    images = [make_image("solid", (32, 32), v) for v in range(3)]
    response = _chat(server, images, "Three?")
    assert response.status_code == 400, response.text
    assert "image" in response.text
    assert _chat(server, images[:1], "One?").status_code == 200


def test_metrics_count_encoder_runs(server: Server) -> None:
    import requests

    text = requests.get(f"{server.url}/metrics", timeout=10).text
    runs = [
        line
        for line in text.splitlines()
        if line.startswith("vllm_hpu_mm:encoder_runs_total")
    ]
    assert runs and float(runs[0].split()[-1]) >= 1
