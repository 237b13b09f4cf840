"""Soak a running ``vllm serve``: mixed streaming requests for a while, then
errors and latency percentiles (figures, never pass/fail).

    vllm serve models/tiny-llava --dtype float32 --max-model-len 512 \\
        --limit-mm-per-prompt '{"image": 2}' --port 8000 &
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --duration 300

Each worker thread loops over a mix: text chat, completion, chat with one or
two images (fresh and repeated, and the unusual-but-valid kinds), a share of
malformed requests (which must get a 4xx), and a share of clients that
disconnect mid-stream. An error is any answer other than the expected one: a
5xx, a 4xx for a good request, a 2xx for a bad one, a stream without
``[DONE]`` or with the wrong token count, or a dropped connection.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import requests

from vllm_hpu_mm.serving import sample_images as s


@dataclass
class Tally:
    """What the workers saw (shared, under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latency_s: dict[str, list[float]] = field(default_factory=dict)
    first_token_s: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    tokens: int = 0

    def add(self, kind: str, outcome: str, seconds: float, error: str = "") -> None:
        with self.lock:
            self.outcomes[f"{kind}:{outcome}"] += 1
            if outcome == "ok":
                self.latency_s.setdefault(kind, []).append(seconds)
            if error:
                self.errors.append(f"{kind}: {error}"[:300])


def _messages(urls: list[str], text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": u}} for u in urls
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _images(rng: random.Random, n: int) -> list[str]:
    unusual = list(s.unusual_valid().values())
    urls = []
    for _ in range(n):
        if rng.random() < 0.3:
            media_type, data = rng.choice(unusual)
            urls.append(s.data_url(data, media_type))
        else:  # a few repeated images (encoder cache hits), most fresh
            variant = rng.randrange(8) if rng.random() < 0.3 else rng.randrange(10**6)
            image = s.gradient_rgb(24 + variant % 40, 24 + variant % 17, variant)
            urls.append(s.data_url(s.encode(image)))
    return urls


BAD = [
    s.data_url(s.truncated_png()),
    s.data_url(s.png_with_header(20000, 20000)),
    s.data_url(s.png_with_header(0, 5)),
    s.data_url(s.SVG, "image/svg+xml"),
    "data:image/png;base64,",
]


def _request(rng: random.Random, model: str) -> tuple[str, str, dict[str, Any]]:
    """(kind, path, body) of one request of the mix."""
    max_tokens = rng.randint(4, 64)
    common = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.7]),
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    roll = rng.random()
    if roll < 0.05:
        body = {**common, "messages": _messages([rng.choice(BAD)], "What is it?")}
        return "bad", "/v1/chat/completions", body
    if roll < 0.10:
        body = {
            **common,
            "max_tokens": 400,
            "messages": _messages(_images(rng, 1), "Hi"),
        }
        return "disconnect", "/v1/chat/completions", body
    if roll < 0.30:
        return "completion", "/v1/completions", {**common, "prompt": "Once upon a"}
    n_images = rng.choice([0, 1, 1, 2])
    text = "Describe the picture. " * rng.randint(1, 8)
    body = {**common, "messages": _messages(_images(rng, n_images), text)}
    return f"chat-{n_images}img", "/v1/chat/completions", body


def _one(url: str, rng: random.Random, model: str, tally: Tally) -> None:
    kind, path, body = _request(rng, model)
    start = time.perf_counter()
    try:
        with requests.post(url + path, json=body, stream=True, timeout=300) as r:
            if kind == "bad":
                ok = 400 <= r.status_code < 500
                tally.add(kind, "ok" if ok else "error", 0.0, "" if ok else r.text)
                return
            if r.status_code != 200:
                tally.add(kind, "error", 0.0, f"HTTP {r.status_code}: {r.text}")
                return
            payloads, first = [], None
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                first = first or time.perf_counter()
                payloads.append(line[5:].strip())
                if kind == "disconnect" and len(payloads) >= 3:
                    tally.add(kind, "ok", time.perf_counter() - start)
                    return  # closing the connection aborts the request
    except requests.RequestException as exc:
        tally.add(kind, "error", 0.0, repr(exc))
        return
    elapsed = time.perf_counter() - start
    if not payloads or payloads[-1] != "[DONE]":
        tally.add(kind, "error", elapsed, f"stream without [DONE]: {payloads[-2:]}")
        return
    usage = json.loads(payloads[-2]).get("usage") or {}
    if usage.get("completion_tokens") != body["max_tokens"]:
        tally.add(kind, "error", elapsed, f"usage {usage} for {body['max_tokens']}")
        return
    with tally.lock:
        tally.tokens += int(usage["completion_tokens"])
        if first is not None:
            tally.first_token_s.append(first - start)
    tally.add(kind, "ok", elapsed)


def _percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    q = (
        statistics.quantiles(values, n=100, method="inclusive")
        if len(values) > 1
        else values * 99
    )
    return f"p50 {q[49]:.3f}  p90 {q[89]:.3f}  p99 {q[98]:.3f}  max {max(values):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server URL")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model = requests.get(args.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    tally = Tally()
    deadline = time.monotonic() + args.duration

    def worker(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        while time.monotonic() < deadline:
            _one(args.url, rng, model, tally)

    start = time.perf_counter()
    threads = [
        threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    healthy = requests.get(args.url + "/health", timeout=10).status_code == 200

    total = sum(tally.outcomes.values())
    n_errors = sum(v for k, v in tally.outcomes.items() if k.endswith(":error"))
    print(f"{total} requests in {wall:.0f} s, concurrency {args.concurrency}")
    print(f"errors: {n_errors}; server healthy after: {healthy}")
    for key, count in sorted(tally.outcomes.items()):
        print(f"  {key:24s} {count}")
    print(f"time to first token (s): {_percentiles(tally.first_token_s)}")
    for kind, values in sorted(tally.latency_s.items()):
        if kind not in ("bad", "disconnect"):
            print(f"latency {kind:12s} (s): {_percentiles(values)}")
    print(f"generated tokens/s: {tally.tokens / wall:.0f}")
    for line in tally.errors[:10]:
        print("  error:", line)
    return 1 if n_errors or not healthy else 0


if __name__ == "__main__":
    raise SystemExit(main())
