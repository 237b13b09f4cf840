"""SIGTERM while streams are in flight: they complete, ``vllm serve`` exits 0.

vLLM 0.33's ``vllm serve`` handles SIGTERM itself (entrypoints/launchers/
launcher.py): with ``--shutdown-timeout 0`` (vLLM's default) it aborts in-flight
requests; with N > 0 the engine core drains them for up to N seconds (the HTTP
server keeps streaming meanwhile), then the process exits 0. The plugin makes
the drain the default (``platform_config.DEFAULT_SHUTDOWN_DRAIN_S``), so the
server here is started without the flag.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_serve import STOP_TIMEOUT_S, Server, _sse_events, serve
from tests.mm_reference import make_image, png_data_url, tiny_llava_dir
from vllm_hpu_mm.platform_config import DEFAULT_SHUTDOWN_DRAIN_S as DRAIN_S

pytestmark = pytest.mark.e2e

NUM_STREAMS = 3
# Each stream decodes at 50 ms a step at least (the pacing logits processor,
# tests/e2e/custom_logitsprocs.py): 120 tokens take 6 s or more, so every
# stream is still in flight when SIGTERM arrives, and on a loaded machine
# (the tiny LLaVA eager at about 12 tokens/s a stream under two test workers)
# about 10 s, well inside the drain's DRAIN_S. Token counts alone cannot hold
# both: 400 tokens outran the 30 s drain under load.
MAX_NEW = 120
PACE_MS = 50


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("sigterm") / "server.log"
    yield from serve(
        tiny_llava_dir(),
        log_path,
        "--limit-mm-per-prompt",
        json.dumps({"image": 1}),
        pacing=True,
    )


def _body(server: Server, i: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"Tell story {i}."}]
    if i % 2 == 0:
        url = png_data_url(make_image("stripes", (32, 32), variant=i))
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_NEW,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "vllm_xargs": {"pace_ms": PACE_MS},
    }


def test_sigterm_drains_streams_and_exits_0(server: Server) -> None:
    started = threading.Barrier(NUM_STREAMS + 1)
    results: list[Any] = [None] * NUM_STREAMS

    def run(i: int) -> None:
        try:
            with server.post(
                "/v1/chat/completions", _body(server, i), stream=True
            ) as response:
                lines = response.iter_lines(decode_unicode=True)
                first = next(line for line in lines if line.startswith("data:"))
                started.wait()
                rest = "\n".join(lines)
            results[i] = (first, rest)
        except Exception as exc:  # reported below, in the test's thread
            results[i] = exc
            started.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    started.wait(timeout=120)  # every stream has sent its first token
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=DRAIN_S + 30)
    code = server.proc.wait(timeout=DRAIN_S + STOP_TIMEOUT_S)
    for result in results:
        assert isinstance(result, tuple), result
        first, rest = result
        events = _sse_events(_Lines(first + "\n" + rest))
        assert events[-1]["usage"]["completion_tokens"] == MAX_NEW, events[-1]
        finish = [e["choices"][0].get("finish_reason") for e in events if e["choices"]]
        assert finish[-1] == "length", finish
    assert code == 0, server.log_tail()
    log = server.log_path.read_text(errors="replace")
    # The engine core saw the streams unfinished at SIGTERM, and drained them.
    assert "draining in-flight requests count=" in log, server.log_tail()


class _Lines:
    """A finished SSE body in the shape ``_sse_events`` reads."""

    status_code = 200
    headers = {"content-type": "text/event-stream"}

    def __init__(self, text: str) -> None:
        self.text = text

    def iter_lines(self, decode_unicode: bool = True) -> Iterator[str]:
        return iter(self.text.splitlines())
