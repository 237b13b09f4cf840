"""Data parallelism: ``vllm serve --data-parallel-size 2`` on the CPU.

vLLM starts two engine cores (each with its own worker and KV cache), a DP
coordinator and an API server per engine behind one port; the engines step in
lockstep waves (an idle engine runs the worker's dummy batch while the other
serves). Concurrent requests are spread over both engines; every answer is HF's
greedy continuation, and vLLM's own per-engine counters on ``/metrics`` show
both engines finished requests.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.e2e import test_serve
from tests.e2e.test_serve import Server, _completion, serve
from tests.hf_reference import hf_greedy, load_hf_tokenizer

pytestmark = pytest.mark.e2e

MAX_NEW = 6
TEXTS = [
    "The quick brown fox",
    "Once upon a time",
    "1 2 3 4 5",
    "Hello there, how are",
    "In the beginning",
    "A B C D E F",
    "The weather today is",
    "She opened the door and",
]


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    # Two engine cores start one after the other on a 2-core machine.
    patch = pytest.MonkeyPatch()
    patch.setattr(test_serve, "STARTUP_TIMEOUT_S", 2 * test_serve.STARTUP_TIMEOUT_S)
    try:
        yield from serve(
            tiny_llama_dir,
            tmp_path_factory.mktemp("dp") / "server.log",
            "--data-parallel-size",
            "2",
            "--max-num-seqs",
            "4",
        )
    finally:
        patch.undo()


def _complete(server: Server, prompt: list[int]) -> list[int]:
    answer = _completion(server, prompt, max_tokens=MAX_NEW)
    return list(answer["choices"][0]["token_ids"])


def _finished_per_engine(server: Server) -> dict[str, float]:
    """vLLM's ``vllm:request_success_total`` summed per ``engine`` label."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine:
                key = engine.group(1)
                out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


def test_two_engines_serve_hf_greedy_answers(
    server: Server, tiny_llama_dir: str
) -> None:
    tok = load_hf_tokenizer(tiny_llama_dir)
    prompts: list[Any] = [tok(t)["input_ids"] for t in TEXTS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _complete(server, p), prompts))
    assert got == hf_greedy(tiny_llama_dir, prompts, MAX_NEW)
    finished = _finished_per_engine(server)
    assert sorted(finished) == ["0", "1"], finished
    assert all(n > 0 for n in finished.values()), f"an idle engine: {finished}"
    assert sum(finished.values()) == len(prompts)
