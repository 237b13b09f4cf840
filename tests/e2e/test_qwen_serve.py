"""``vllm serve`` with the tiny Qwen2.5-VL: chat requests with base64 PNG images
of several sizes (dynamic resolution) and a base64 video (``video_url`` data
URL, decoded by vLLM's OpenCV loader), greedy-identical with HF on the prompt
the chat template renders; empty, corrupt and too long videos get 400s that say
why, and the server keeps serving.

The tiny model's saved chat template knows image parts only; the server gets
the same template with a video branch (``--chat-template``), as released
Qwen2.5-VL templates have."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_serve import Server, serve
from tests.mm_reference import chat_messages, make_image
from tests.qwen_reference import (
    hf_qwen_greedy,
    hf_qwen_video_greedy,
    load_hf_qwen_processor,
    load_video,
    tiny_qwen_dir,
    write_video,
)

pytestmark = pytest.mark.e2e

MAX_NEW = 8
QUESTION = "What is in the picture?"


IMAGE_PART = "{% if part['type'] == 'image' %}"
VIDEO_BRANCH = (
    "{% if part['type'] == 'video' %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'image' %}"
)


def video_chat_template(model_dir: str) -> str:
    """The model's chat template with a video branch beside its image one."""
    template = (Path(model_dir) / "chat_template.jinja").read_text()
    assert IMAGE_PART in template
    return template.replace(IMAGE_PART, VIDEO_BRANCH, 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve_qwen")
    template = root / "chat_template.jinja"
    template.write_text(video_chat_template(tiny_qwen_dir()))
    yield from serve(
        tiny_qwen_dir(),
        root / "server.log",
        "--limit-mm-per-prompt",
        json.dumps({"image": 2, "video": 1}),
        "--chat-template",
        str(template),
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


def _video_chat(server: Server, data: bytes, max_tokens: int = MAX_NEW) -> Any:
    url = "data:video/x-msvideo;base64," + base64.b64encode(data).decode()
    content = [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": QUESTION},
    ]
    return server.post(
        "/v1/chat/completions",
        {
            "model": server.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )


def test_chat_with_a_video_matches_hf(server: Server, tmp_path: Path) -> None:
    path = write_video(tmp_path / "clip.avi", frames=6, size=(48, 32), fps=4.0)
    response = _video_chat(server, path.read_bytes())
    assert response.status_code == 200, response.text
    out = response.json()
    messages = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": QUESTION}],
        }
    ]
    prompt = load_hf_qwen_processor(server.model).apply_chat_template(
        messages,
        chat_template=video_chat_template(server.model),
        add_generation_prompt=True,
        tokenize=False,
    )
    want_prompt, want = hf_qwen_video_greedy(
        server.model, prompt, [], [load_video(path)], MAX_NEW, add_special_tokens=False
    )
    assert out["prompt_token_ids"] == want_prompt, (out["prompt_token_ids"], prompt)
    assert out["choices"][0]["token_ids"] == want


def test_bad_videos_get_400s_that_say_why(server: Server, tmp_path: Path) -> None:
    good = write_video(tmp_path / "ok.avi", frames=6).read_bytes()
    slow = write_video(tmp_path / "slow.avi", frames=6, fps=0.005).read_bytes()
    for data, why in [
        (b"", "video is empty"),
        (b"<html><body>not found</body></html>" * 4, "not a video OpenCV can open"),
        (good[:200], "video"),
        (slow, "video is too long: 1200 s"),
    ]:
        response = _video_chat(server, data)
        assert response.status_code == 400, (why, response.status_code, response.text)
        assert why in response.json()["error"]["message"], response.text
    # Still serving.
    assert _video_chat(server, good, max_tokens=2).status_code == 200
