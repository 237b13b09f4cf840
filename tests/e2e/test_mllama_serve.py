"""``vllm serve`` with the tiny Mllama and a cross-attention cache of 3 image
slots: chat with images compared with HF, and the slot budget at work.

The answer's token ids (``return_token_ids``) are compared with transformers'
greedy continuation of the same prompt ids and images
(``tests.mllama_reference``): one image, two images, text only.

One slot per possible image would be ``max_num_seqs (4) x 4 images = 16``; the
budget (``hpu_mm.memory.cross_attention_cache_gib``) holds 3. So:

- concurrent requests of 2 distinct images each cannot run side by side (2 x 2
  > 3): the scheduler admits one while the others wait, instead of the worker
  running out of slots (which stops the engine); every answer is still HF's
  greedy continuation, in float32;
- images seen before are evicted once newer ones need their slots (least
  recently used first) and are encoded again when they come back (the
  ``encoder_runs_total`` counter of ``/metrics`` counts them);
- a request with 4 images (within ``--limit-mm-per-prompt`` but more than the
  whole cache) is a 400 (the platform lowers the limit to the slots, so vLLM
  refuses it before processing its images), and the server goes on serving.

One server for both (they were two modules, each starting its own), on the
simulated Gaudi (``VLLM_HPU_MM_DEVICE=hpu VLLM_HPU_MM_GAUDI_SIM=1``): Gaudi's
path, graph mode over explicit buckets compiled by the simulated
``hpu_backend``, block size 128, the flat cross-attention layout and the
per-bucket encoder graphs, in float32 (Mllama takes PyTorch's SDPA, not
FusedSDPA's fast softmax, so HF's tokens are matched exactly); nothing is
compiled while serving.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.e2e import test_serve
from tests.e2e.test_gaudi_sim_serve import _sim_compiles_after_warmup
from tests.e2e.test_serve import Server, serve, server_compiles
from tests.mllama_reference import hf_mllama_greedy, mllama_chat, tiny_mllama_dir
from tests.mm_reference import make_image

pytestmark = pytest.mark.e2e

MAX_NEW = 6
# Tiny Mllama's slot: 2 layers x K,V x 96 rows x 2 KV heads x 16 x 4 bytes.
SLOT_BYTES = 2 * 2 * 96 * 2 * 16 * 4
SLOTS = 3
BUCKETS = "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [1, 2, 4, 8]\n"
BUDGET_GIB = (SLOTS + 0.5) * SLOT_BYTES / 2**30


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve_mllama")
    (tmp / "buckets.yaml").write_text(BUCKETS)
    plugin = {
        "graph_mode": "compile",
        "bucketing": {"strategy": "explicit", "file": str(tmp / "buckets.yaml")},
        "warmup": {"progress_bar": False},
        "memory": {"cross_attention_cache_gib": BUDGET_GIB},
    }
    patch = pytest.MonkeyPatch()
    # Gaudi's path on the simulated card (every process of the server).
    patch.setenv("VLLM_HPU_MM_DEVICE", "hpu")
    patch.setenv("VLLM_HPU_MM_GAUDI_SIM", "1")
    patch.setenv("VLLM_HPU_MM_GAUDI_SIM_MEMORY", "256M")
    patch.setattr(test_serve, "STARTUP_TIMEOUT_S", 600.0)
    try:
        yield from serve(
            tiny_mllama_dir(),
            tmp / "server.log",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--limit-mm-per-prompt",
            json.dumps({"image": 4}),
            "--additional-config",
            json.dumps({"hpu_mm": plugin}),
        )
    finally:
        patch.undo()


def _images(first: int, n: int) -> list[Any]:
    kinds = ["gradient", "checkerboard", "stripes", "solid"]
    return [
        make_image(kinds[i % 4], (32 + 8 * (i % 3), 40), i)
        for i in range(first, first + n)
    ]


def _encoder_runs(server: Server) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(
        r"^vllm_hpu_mm:encoder_runs_total(?:\{[^}]*\})? (\S+)$", text, re.M
    )
    assert match, text[-2000:]
    return float(match.group(1))


def _check_hf(response: Any, images: list[Any]) -> None:
    assert response.status_code == 200, response.text
    data = response.json()
    got = data["choices"][0]["token_ids"]
    want = hf_mllama_greedy(
        str(tiny_mllama_dir()), data["prompt_token_ids"], images, MAX_NEW
    )
    assert got == want


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
    response = mllama_chat(server, images, "What is in this picture?", MAX_NEW)
    _check_hf(response, images)
    assert len(response.json()["choices"][0]["token_ids"]) == MAX_NEW


def test_startup_log_gives_the_slots(server: Server) -> None:
    log = server.log_path.read_text(errors="replace")
    assert f"Mllama cross-attention cache: {SLOTS} image slots" in log, log[-3000:]
    assert "one slot per possible image would be 16 slots" in log
    assert "at most 3 images per prompt (--limit-mm-per-prompt gave 4)" in log


def test_concurrent_requests_wait_for_slots_and_match_hf(server: Server) -> None:
    jobs = [_images(2 * i, 2) for i in range(6)]  # 12 distinct images, 3 slots
    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(
            pool.map(
                lambda ims: mllama_chat(server, ims, "Describe both.", MAX_NEW), jobs
            )
        )
    for response, images in zip(responses, jobs, strict=True):
        _check_hf(response, images)


def test_evicted_images_are_encoded_again(server: Server) -> None:
    first, second = _images(20, 2), _images(22, 2)
    _check_hf(mllama_chat(server, first, "What is this?", MAX_NEW), first)
    runs = _encoder_runs(server)
    _check_hf(mllama_chat(server, first, "And now?", MAX_NEW), first)
    assert _encoder_runs(server) == runs  # still cached: no encode
    _check_hf(mllama_chat(server, second, "What is this?", MAX_NEW), second)
    _check_hf(mllama_chat(server, first, "Once more?", MAX_NEW), first)
    # 2 + 2 images > 3 slots: the least recently used of ``first`` made room
    # for ``second``, and is encoded again (with 16 slots nothing is).
    assert _encoder_runs(server) > runs + 2


def test_more_images_than_the_cache_is_a_400_and_serving_goes_on(
    server: Server,
) -> None:
    four = _images(30, 4)
    response = mllama_chat(server, four, "Four?", MAX_NEW)
    assert response.status_code == 400, response.text
    assert "At most 3 image(s)" in response.text
    _check_hf(mllama_chat(server, four[:3], "Three?", MAX_NEW), four[:3])


def test_the_server_runs_on_the_simulated_gaudi_and_compiles_nothing_serving(
    server: Server,
) -> None:
    log = server.log_path.read_text(errors="replace")
    assert "simulated Gaudi" in log and "block_size=128" in log
    assert "backend hpu_backend" in log
    assert _sim_compiles_after_warmup(server) == []
    compiles = server_compiles(server)
    assert compiles["warmup"] > 0 and compiles["serving"] == 0, compiles
