"""Reliability of ``vllm serve`` on the plugin (tiny LLaVA, one server).

- every malformed request gets a 4xx whose message names the problem, and the
  server keeps serving; an image URL that cannot be fetched (closed port, an
  HTML page, a host slower than ``VLLM_IMAGE_FETCH_TIMEOUT``) is a 400;
  unusual but valid images are converted and answered
  (compared with HF greedy on the image the plugin's conversion makes);
- a client that disconnects mid-stream frees its KV blocks (vLLM's
  ``vllm:kv_cache_usage_perc`` back to 0) and its encoder-cache entry (later
  images evict it: the plugin's ``vllm_hpu_mm:encoder_cache_items`` stays
  within the cache's capacity and every later request is served);
- concurrent mixed text and image streams all complete.

The server runs with a 64-token step budget so that vLLM's encoder cache holds
4 of the tiny LLaVA's 16-embedding images (capacity in embeddings = budget) and
prompts are cut by chunked prefill.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from PIL import Image

from tests.e2e.test_serve import Server, _sse_events, serve
from tests.mm_reference import (
    NUM_IMAGE_TOKENS,
    hf_llava_chat_prompt,
    hf_llava_greedy,
    make_image,
    tiny_llava_dir,
)
from vllm_hpu_mm.serving import sample_images as s
from vllm_hpu_mm.serving.image_checks import to_rgb

pytestmark = pytest.mark.e2e

MAX_NEW = 8
QUESTION = "What is in the picture?"
STEP_BUDGET = 64
ENCODER_CACHE_IMAGES = STEP_BUDGET // NUM_IMAGE_TOKENS
WAIT_S = 60.0  # bound on waiting for the server to settle (not a timing check)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("reliability") / "server.log"
    with pytest.MonkeyPatch.context() as env:
        # One fetch attempt of at most 1 s for image URLs (the slow-host case).
        env.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "1")
        env.setenv("VLLM_MEDIA_FETCH_MAX_RETRIES", "1")
        yield from serve(
            tiny_llava_dir(),
            log_path,
            "--limit-mm-per-prompt",
            json.dumps({"image": 2}),
            "--max-num-batched-tokens",
            str(STEP_BUDGET),
            max_model_len=2048,  # the model's whole context: see LONG_STREAM_TOKENS
            pacing=True,  # pace_ms: see LONG_STREAM_TOKENS
        )


def _messages(urls: list[str], text: str = QUESTION) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": u}} for u in urls
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _chat(server: Server, urls: list[str], **extra: Any) -> requests.Response:
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


def _png_url(variant: int) -> str:
    return s.data_url(s.encode(make_image("gradient", (40, 24), variant=variant)))


def _still_serving(server: Server) -> None:
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    response = _chat(server, [_png_url(0)], max_tokens=2)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == 2


# ---- bad input: 4xx naming the problem, and still serving ---------------------------

OK_URL = s.data_url(s.encode(s.gradient_rgb()))

BAD_IMAGES = {
    "truncated": (s.data_url(s.truncated_png()), "cannot be decoded"),
    "empty": ("data:image/png;base64,", "empty"),
    "zero-size": (s.data_url(s.png_with_header(0, 10)), "zero size"),
    "bomb-under-pillow-limit": (
        s.data_url(s.png_with_header(12000, 12000)),
        "12000x12000 = 144000000 pixels",
    ),
    "bomb-over-pillow-limit": (
        s.data_url(s.png_with_header(100_000, 100_000)),
        "too large",
    ),
    "gif-bomb": (s.data_url(s.gif_with_header(60000, 60000), "image/gif"), "too large"),
    "svg": (s.data_url(s.SVG, "image/svg+xml"), "SVG"),
    "pdf-labelled-png": (s.data_url(s.PDF, "image/png"), "PDF"),
    "eps-labelled-png": (s.data_url(s.EPS, "image/png"), "PostScript"),
    "not-base64-data-url": ("data:image/png,rawbytes", "base64"),
    "invalid-base64": ("data:image/png;base64,iVBORw0KGgo!!!*@@", "base64"),
    "file-url": ("file:///etc/hostname", "--allowed-local-media-path"),
}


@pytest.mark.parametrize(
    ("url", "words"), list(BAD_IMAGES.values()), ids=list(BAD_IMAGES)
)
def test_bad_image_is_4xx_naming_it(server: Server, url: str, words: str) -> None:
    response = _chat(server, [url])
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert words.lower() in response.json()["error"]["message"].lower(), response.text
    _still_serving(server)


class _ImageHost(BaseHTTPRequestHandler):
    """A loopback image host: an HTML page, and an image that comes too late."""

    def do_GET(self) -> None:
        body, ctype = b"<!DOCTYPE html><html><body>Sign in</body></html>", "text/html"
        if self.path == "/slow.png":
            time.sleep(3.0)  # longer than the server's 1 s fetch timeout
            body, ctype = s.encode(s.gradient_rgb()), "image/png"
        try:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server gave up waiting

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    host = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    host.daemon_threads = True
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}"
    finally:
        host.shutdown()
        host.server_close()


def _closed_port_url() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    return f"http://127.0.0.1:{port}/cat.png"  # nothing listens there now


# (path on the loopback image host, or None for a closed port; words expected)
UNFETCHABLE = {
    "connection-refused": (None, "connection was refused"),
    "html-page": ("/page.html", "an HTML page"),
    "timeout": ("/slow.png", "did not answer within 1 s"),
}


@pytest.mark.parametrize(
    ("path", "words"), list(UNFETCHABLE.values()), ids=list(UNFETCHABLE)
)
def test_unfetchable_image_url_is_400_naming_it(
    server: Server, image_host: str, path: str | None, words: str
) -> None:
    """An image URL the server cannot fetch is the client's error (400, naming
    the URL and why), not a 500; the server keeps serving. (The DNS failure is
    tested in tests/unit/test_media_fetch.py, where the lookup runs with no
    network: here it would ask this host's resolver.)"""
    url = _closed_port_url() if path is None else image_host + path
    response = _chat(server, [url])
    assert response.status_code == 400, (response.status_code, response.text)
    message = response.json()["error"]["message"]
    assert words in message and url in message, message
    _still_serving(server)


def _image_token_id(server: Server) -> int:
    config = json.loads((Path(server.model) / "config.json").read_text())
    return int(config["image_token_index"])


BAD_REQUESTS = {
    "too-many-images": ({"messages": _messages([OK_URL] * 3)}, "at most 2"),
    "image-token-in-text": (
        {"messages": _messages([OK_URL], "<image><image> " + QUESTION)},
        "no image fills",
    ),
    "image-token-without-image": (
        {"messages": [{"role": "user", "content": "<image> hello"}]},
        "no image fills",
    ),
    "over-max-model-len": (
        {"messages": _messages([OK_URL], "word " * 2200)},
        "maximum context length",
    ),
    "temperature": ({"messages": _messages([OK_URL]), "temperature": -1}, "temper"),
    "top_p": ({"messages": _messages([OK_URL]), "top_p": 2}, "top_p"),
    "n": ({"messages": _messages([OK_URL]), "n": 0}, "n must be"),
    "max_tokens": ({"messages": _messages([OK_URL]), "max_tokens": 10**5}, "max_"),
    "min_p": ({"messages": _messages([OK_URL]), "min_p": 1.5}, "min_p"),
    "logit_bias": (
        {"messages": _messages([OK_URL]), "logit_bias": {"5": 3, "99999": 1}},
        "99999",
    ),
}


@pytest.mark.parametrize(
    ("body", "words"), list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS)
)
def test_bad_request_is_4xx_naming_it(
    server: Server, body: dict[str, Any], words: str
) -> None:
    response = server.post(
        "/v1/chat/completions", {"model": server.model, "max_tokens": 4, **body}
    )
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert words.lower() in response.json()["error"]["message"].lower(), response.text
    _still_serving(server)


def test_image_token_ids_without_image_in_completions_is_400(server: Server) -> None:
    image_token = _image_token_id(server)
    body = {"model": server.model, "prompt": [1, image_token, 5], "max_tokens": 2}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    assert "no image fills" in response.json()["error"]["message"]
    _still_serving(server)


def test_an_image_of_a_rejected_request_serves_the_next_one(server: Server) -> None:
    """A request refused after vLLM processed its image (the stray image token
    check runs on the processed prompt) leaves nothing behind: vLLM's front-end
    cache of processed images must not believe the engine holds this image, or
    the next request that sends it gets a 500 (a multimodal cache miss)."""
    url = _png_url(31)  # an image no other test sends
    body = {
        "model": server.model,
        "max_tokens": 2,
        "messages": _messages([url], "<image><image> " + QUESTION),
    }
    refused = server.post("/v1/chat/completions", body)
    assert refused.status_code == 400, refused.text
    response = _chat(server, [url], max_tokens=2)
    assert response.status_code == 200, response.text


# ---- unusual but valid images --------------------------------------------------------


@pytest.mark.parametrize("name", list(s.unusual_valid()))
def test_unusual_valid_image_matches_hf(server: Server, name: str) -> None:
    media_type, data = s.unusual_valid()[name]
    response = _chat(server, [s.data_url(data, media_type)])
    assert response.status_code == 200, response.text
    # The reference: HF on the image as the plugin converts it (EXIF applied).
    from PIL import ImageOps

    image = to_rgb(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    prompt = hf_llava_chat_prompt(server.model, QUESTION, 1)
    want = hf_llava_greedy(server.model, prompt, [image], MAX_NEW, False)
    assert response.json()["choices"][0]["token_ids"] == want


# ---- aborts ----------------------------------------------------------------


def _metrics(server: Server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
    return out


def _wait_for(server: Server, ok: Any, what: str) -> dict[str, float]:
    deadline = time.monotonic() + WAIT_S
    while True:
        metrics = _metrics(server)
        if ok(metrics):
            return metrics
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached after {WAIT_S:.0f} s: {metrics}")
        time.sleep(0.2)


# The disconnected stream asks for nearly the tiny model's whole context
# (2048) at 10 ms a step at least (tests.e2e.custom_logitsprocs.PaceProcessor):
# 19 s or more of decoding, so it is still running when the test reads
# /metrics and when the server notices the disconnect, however fast or loaded
# the machine is.
LONG_STREAM_TOKENS = 1900
LONG_STREAM_PACE_MS = 10


def test_disconnect_mid_stream_frees_kv_and_encoder_cache(server: Server) -> None:
    kv, running = "vllm:kv_cache_usage_perc", "vllm:num_requests_running"
    cache = "vllm_hpu_mm:encoder_cache_items"
    body = {
        "model": server.model,
        "messages": _messages([_png_url(1000)]),  # an image no other test sends
        "max_tokens": LONG_STREAM_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"pace_ms": LONG_STREAM_PACE_MS},
    }
    generated = "vllm:generation_tokens_total"
    before = _metrics(server)[generated]
    with server.post("/v1/chat/completions", body, stream=True) as response:
        assert response.status_code == 200
        lines = response.iter_lines(decode_unicode=True)
        seen = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data:") for line in seen), seen
        mid = _metrics(server)
        assert mid[kv] > 0 and mid[running] == 1, mid
    # The connection is closed: vLLM aborts the request, short of its tokens.
    freed = _wait_for(server, lambda m: m[kv] == 0 and m[running] == 0, "KV usage 0")
    assert 0 < freed[generated] - before < LONG_STREAM_TOKENS, (before, freed)
    # Fill the encoder cache with new images: the aborted request's entry must
    # be evictable, or a request would wait forever for encoder space.
    for variant in range(1001, 1001 + ENCODER_CACHE_IMAGES + 1):
        response = _chat(server, [_png_url(variant)])
        assert response.status_code == 200, response.text
    after = _wait_for(server, lambda m: m[kv] == 0, "KV usage 0")
    assert 0 < after[cache] <= ENCODER_CACHE_IMAGES, after


# ---- load ----------------------------------------------------------------

NUM_STREAMS = 12


def _stream(server: Server, i: int) -> dict[str, Any]:
    """Stream i of the mix: text chat, completion, chat with 1 or 2 images."""
    kind = i % 4
    common = {
        "model": server.model,
        "max_tokens": 6 + i % 5,
        "temperature": 0.0 if i % 2 else 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == 1:
        path, body = "/v1/completions", {"prompt": f"Story {i}: once upon", **common}
    else:
        urls = [_png_url(2000 + i + j) for j in range(kind // 2 + (kind == 3))]
        path, body = "/v1/chat/completions", {"messages": _messages(urls), **common}
    with server.post(path, body, stream=True) as response:
        events = _sse_events(response)
    return {"events": events, "max_tokens": common["max_tokens"], "path": path}


def test_concurrent_mixed_streams_all_complete(server: Server) -> None:
    with ThreadPoolExecutor(max_workers=NUM_STREAMS) as pool:
        results = list(pool.map(lambda i: _stream(server, i), range(NUM_STREAMS)))
    for result in results:
        events = result["events"]
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == result["max_tokens"], usage
        finish = [e["choices"][0].get("finish_reason") for e in events if e["choices"]]
        assert finish[-1] == "length", finish
    m = _wait_for(server, lambda m: m["vllm:num_requests_running"] == 0, "idle")
    assert m["vllm:kv_cache_usage_perc"] == 0
