"""``vllm serve`` with the tiny LLaVA: chat requests with base64 PNG images.

The server is started like ``test_serve.py``'s (same helpers, 127.0.0.1, its log
checked for tracebacks at the end). Each chat answer is compared with HF greedy
on the prompt the model's chat template renders (through the HF processor), with
the same Pillow image, PNG-encoded and sent as a ``data:image/png;base64`` URL.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.e2e.test_serve import Server, serve
from tests.mm_reference import (
    hf_decode,
    hf_llava_chat_prompt,
    hf_llava_greedy,
    hf_llava_prompt_ids,
    make_image,
    named_image,
    png_bytes,
    png_data_url,
    tiny_llava_dir,
)

pytestmark = pytest.mark.e2e

MAX_NEW = 12
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``vllm serve`` on tiny-llava; after the tests, stopped and its log checked."""
    log_path = tmp_path_factory.mktemp("serve_llava") / "server.log"
    yield from serve(
        tiny_llava_dir(), log_path, "--limit-mm-per-prompt", json.dumps({"image": 2})
    )


def _messages(urls: list[str], question: str = QUESTION) -> list[dict[str, Any]]:
    """OpenAI chat messages: the images (as URLs) first, then the question."""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": u}} for u in urls
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def _chat_request(server: Server, urls: list[str], **extra: Any) -> Any:
    body = {
        "model": server.model,
        "messages": _messages(urls),
        "max_tokens": MAX_NEW,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return server.post("/v1/chat/completions", body)


def _check_chat_matches_hf(server: Server, images: list[Any]) -> None:
    response = _chat_request(server, [png_data_url(im) for im in images])
    assert response.status_code == 200, response.text
    body = response.json()
    # The chat template writes BOS itself: no special tokens added on either side.
    prompt = hf_llava_chat_prompt(server.model, QUESTION, len(images))
    want_prompt = hf_llava_prompt_ids(
        server.model, prompt, images, add_special_tokens=False
    )
    want = hf_llava_greedy(
        server.model, prompt, images, MAX_NEW, add_special_tokens=False
    )
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == want_prompt, (body["prompt_token_ids"], prompt)
    assert choice["token_ids"] == want, (choice["token_ids"], want)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].rstrip("\ufffd") == hf_decode(
        server.model, want
    ).rstrip("\ufffd")
    assert body["usage"]["prompt_tokens"] == len(want_prompt)
    assert body["usage"]["completion_tokens"] == MAX_NEW


def test_chat_with_image_matches_hf(server: Server) -> None:
    _check_chat_matches_hf(server, [named_image("gradient_40x24")])


def test_chat_with_two_images_matches_hf(server: Server) -> None:
    _check_chat_matches_hf(
        server, [named_image("checker_24x40"), named_image("stripes_64x48")]
    )


def test_chat_text_only_matches_hf(server: Server) -> None:
    _check_chat_matches_hf(server, [])


def _corrupt_png_url() -> str:
    """Valid base64 of bytes that are not a decodable PNG (truncated image)."""
    data = png_bytes(named_image("solid_32x32"))
    return "data:image/png;base64," + base64.b64encode(data[: len(data) // 2]).decode()


@pytest.mark.parametrize(
    "url",
    [
        _corrupt_png_url(),
        "data:image/png;base64,iVBORw0KGgo!!!not*base64@@",
        "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(),
    ],
    ids=["truncated-png", "invalid-base64", "not-an-image"],
)
def test_bad_image_is_4xx_then_still_serving(server: Server, url: str) -> None:
    response = _chat_request(server, [url])
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    _check_chat_matches_hf(server, [named_image("solid_32x32")])


def test_too_many_images_is_400(server: Server) -> None:
    url = png_data_url(named_image("solid_32x32"))
    response = _chat_request(server, [url] * 3)  # --limit-mm-per-prompt image=2
    assert response.status_code == 400, response.text


def _plugin_metrics(server: Server) -> dict[str, float]:
    response = requests.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200
    return {
        line.split()[0]: float(line.split()[-1])
        for line in response.text.splitlines()
        if line.startswith("vllm_hpu_mm:") and " " in line
    }


def test_metrics_count_encoder_runs(server: Server) -> None:
    """One new image: one item received, one encoder run, seen on /metrics."""
    runs, items = "vllm_hpu_mm:encoder_runs_total", "vllm_hpu_mm:mm_items_total"
    before = _plugin_metrics(server)
    image = make_image("gradient", (56, 40), variant=99)  # not sent before
    _check_chat_matches_hf(server, [image])
    after = _plugin_metrics(server)
    assert runs in after and items in after, sorted(after)
    assert after[runs] - before.get(runs, 0.0) == 1, (before, after)
    assert after[items] - before.get(items, 0.0) == 1, (before, after)
