"""Image URLs that cannot be fetched are the client's problem: the plugin's media
connector answers each real local failure with a ``RequestRejected`` (a 400)
naming the URL and what went wrong, through vLLM's sync (``requests``) and async
(``aiohttp``) fetch paths alike.

Every failure here is real and stays on this machine: a closed loopback port,
a loopback HTTP server that answers an HTML page, a 404 or too slowly, and a
host name under the reserved ``.invalid`` TLD looked up inside a network
namespace that has no route out (``unshare --user --net``), so the resolver's
query cannot leave the machine and the lookup fails as it does on a host whose
DNS is unreachable.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY

from vllm_hpu_mm.serving import sample_images as s
from vllm_hpu_mm.serving.errors import RequestRejected
from vllm_hpu_mm.serving.media import CONNECTOR_NAME, register_connector

REPO_ROOT = Path(__file__).resolve().parents[2]
SLOW_S = 3.0  # the slow route's delay; the fetch timeout in the tests is 1 s
PNG = s.encode(s.gradient_rgb(40, 24))
HTML = b"<!DOCTYPE html><html><body><h1>Login required</h1></body></html>"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        routes: dict[str, tuple[int, str, bytes]] = {
            "/ok.png": (200, "image/png", PNG),
            "/page.html": (200, "text/html; charset=utf-8", HTML),
            "/missing.png": (404, "text/plain", b"not found"),
            "/slow.png": (200, "image/png", PNG),
        }
        status, ctype, body = routes.get(self.path, (404, "text/plain", b"?"))
        if self.path == "/slow.png":
            time.sleep(SLOW_S)
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (the timeout case)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """One fetch attempt (vLLM retries transient failures 3 times by default,
    with a timeout that grows 4x per attempt)."""
    monkeypatch.setenv("VLLM_MEDIA_FETCH_MAX_RETRIES", "1")
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "1")


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again on leaving the block


def _connector() -> Any:
    register_connector()
    return MEDIA_CONNECTOR_REGISTRY.load(CONNECTOR_NAME)


# vLLM's HTTP connection keeps one aiohttp session, bound to the event loop of
# its first use (as in the API server): every async fetch runs on this loop.
_LOOP = asyncio.new_event_loop()


def _fetch(url: str, mode: str) -> Any:
    conn = _connector()
    if mode == "sync":
        return conn.fetch_image(url)
    return _LOOP.run_until_complete(conn.fetch_image_async(url))


MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_fetchable_png_still_loads(http_base: str, mode: str, no_retries: None) -> None:
    image = _fetch(http_base + "/ok.png", mode)
    assert image.size == (40, 24) and image.mode == "RGB"


@pytest.mark.parametrize("mode", MODES)
def test_connection_refused_is_400(mode: str, no_retries: None) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/cat.png"
    with pytest.raises(RequestRejected, match="connection was refused") as info:
        _fetch(url, mode)
    assert url in str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_html_body_is_400_naming_it(
    http_base: str, mode: str, no_retries: None
) -> None:
    url = http_base + "/page.html"
    with pytest.raises(RequestRejected, match="an HTML page") as info:
        _fetch(url, mode)
    assert url in str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_host_404_is_400(http_base: str, mode: str, no_retries: None) -> None:
    url = http_base + "/missing.png"
    with pytest.raises(RequestRejected, match="answered HTTP 404") as info:
        _fetch(url, mode)
    assert url in str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_slow_host_is_400_after_the_timeout(
    http_base: str, mode: str, no_retries: None
) -> None:
    url = http_base + "/slow.png"
    start = time.monotonic()
    with pytest.raises(RequestRejected, match=r"did not answer within 1 s") as info:
        _fetch(url, mode)
    assert time.monotonic() - start < SLOW_S  # gave up at the timeout, not after
    assert "VLLM_IMAGE_FETCH_TIMEOUT" in str(info.value) and url in str(info.value)


_DNS_CHILD = """
import asyncio, sys
from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY
from vllm_hpu_mm.serving.errors import RequestRejected
from vllm_hpu_mm.serving.media import CONNECTOR_NAME, register_connector
register_connector()
conn = MEDIA_CONNECTOR_REGISTRY.load(CONNECTOR_NAME)
url = "http://image-host.invalid/cat.png"
for name, fetch in [
    ("sync", lambda: conn.fetch_image(url)),
    ("async", lambda: asyncio.new_event_loop().run_until_complete(
        conn.fetch_image_async(url))),
]:
    try:
        fetch()
        print(name, "FETCHED")
    except RequestRejected as exc:
        print(name, "REJECTED", exc.args[0])
    except BaseException as exc:
        print(name, "OTHER", type(exc).__name__, exc)
"""


def _isolated_netns_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run(
        [unshare, "--user", "--net", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


def test_unresolvable_host_is_400() -> None:
    """``image-host.invalid`` (RFC 2606: never resolves), looked up with no
    network at all: the failure is the OS resolver's own."""
    if not _isolated_netns_works():
        pytest.skip("unprivileged network namespaces are not allowed on this host")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "VLLM_MEDIA_FETCH_MAX_RETRIES": "1",
        "VLLM_IMAGE_FETCH_TIMEOUT": "2",
    }
    proc = subprocess.run(
        ["unshare", "--user", "--net", sys.executable, "-c", _DNS_CHILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("sync", "async"))]
    assert len(lines) == 2, proc.stdout + proc.stderr
    for line in lines:
        assert "REJECTED" in line, line
        assert "image-host.invalid" in line and "does not resolve" in line, line
