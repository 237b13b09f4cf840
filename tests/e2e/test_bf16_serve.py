"""``vllm serve`` in bfloat16 and graph mode for Llama, LLaVA and Mllama.

One server at a time (a module fixture parametrized by model: pytest stops one
before starting the next). Each serves concurrent text and image requests
after warmup; the answers are compared with HF transformers in bfloat16 up to
the first near-tie (``tests.hf_reference.compare_greedy_bf16``: HF's top-2
margin at most 3 bfloat16 spacings), and the plugin's compile counter on
``/metrics`` shows no compilation while serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.e2e import test_serve
from tests.e2e.test_serve import Server, serve
from tests.hf_reference import (
    Bf16Tally,
    compare_greedy_bf16,
    hf_greedy_steps,
    load_hf_tokenizer,
)
from tests.mllama_reference import hf_mllama_greedy_steps, tiny_mllama_dir
from tests.mm_reference import (
    hf_llava_chat_prompt,
    hf_llava_greedy_steps,
    make_image,
    tiny_llava_dir,
)

pytestmark = pytest.mark.e2e

MAX_NEW = 8
GRAPH_STARTUP_TIMEOUT_S = 900.0
QUESTION = "What is in the picture?"
BF16 = torch.bfloat16
BUCKETS = {
    "llama": "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8, 16]\n",
    "llava": "prefill_tokens: [32, 64]\ndecode_batch: [1, 4]\nblocks: [4, 16]\n",
    "mllama": "prefill_tokens: [16, 32]\ndecode_batch: [1, 2]\nblocks: [4, 8]\n",
}
STEP_TOKENS = {"llama": 64, "llava": 32, "mllama": 32}
MAX_SEQS = {"llama": 4, "llava": 4, "mllama": 2}


def _model_dir(name: str) -> str:
    from tests.conftest import _tiny_model_dir

    if name == "llama":
        return _tiny_model_dir("tiny-llama")
    return tiny_llava_dir() if name == "llava" else tiny_mllama_dir()


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("vllm serve (Llama, LLaVA, Mllama)")
    yield t
    t.report(request.config)


@pytest.fixture(scope="module", params=["llama", "llava", "mllama"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server]]:
    name = request.param
    tmp: Path = tmp_path_factory.mktemp(f"bf16_{name}")
    (tmp / "buckets.yaml").write_text(BUCKETS[name])
    plugin = {
        "hpu_mm": {
            "graph_mode": "compile",
            "bucketing": {"strategy": "explicit", "file": str(tmp / "buckets.yaml")},
            "warmup": {"progress_bar": False},
        }
    }
    # Warmup compiles every bucket with Inductor: on a loaded 2-core machine that
    # outlasts the 180 s start-up wait of the float32 (eager) servers.
    patch = pytest.MonkeyPatch()
    patch.setattr(test_serve, "STARTUP_TIMEOUT_S", GRAPH_STARTUP_TIMEOUT_S)
    request.addfinalizer(patch.undo)
    extra = (
        ["--limit-mm-per-prompt", json.dumps({"image": 2})] if name != "llama" else []
    )
    for srv in serve(
        _model_dir(name),
        tmp / "server.log",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        str(MAX_SEQS[name]),
        "--max-num-batched-tokens",
        str(STEP_TOKENS[name]),
        "--additional-config",
        json.dumps(plugin),
        *extra,
    ):
        yield name, srv


def _compiles(server: Server, phase: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm_hpu_mm:graph_compiles_total{") and (
            f'phase="{phase}"' in line
        ):
            total += float(line.split()[-1])
    return total


def _chat(server: Server, images: list[Any], text: str) -> dict[str, Any]:
    return server.greedy_image_chat(images, text, MAX_NEW)


def _completion(server: Server, prompt_ids: list[int]) -> dict[str, Any]:
    return server.greedy_completion(prompt_ids, MAX_NEW)


IMAGE_SETS: list[list[Any]] = [
    [make_image("gradient", (40, 24), 7)],
    [],
    [make_image("checkerboard", (24, 40), 8), make_image("solid", (64, 48), 9)],
    [make_image("stripes", (96, 30), 10)],
]


def _check_llama(server: Server, tally: Bf16Tally) -> None:
    tok = load_hf_tokenizer(server.model)
    texts = ["The quick brown fox", "Once upon a time, in a land far", "1 2 3 4 5 6"]
    prompts = [tok(t)["input_ids"] for t in texts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _completion(server, p), prompts))
    for prompt, answer in zip(prompts, answers, strict=True):
        got = answer["choices"][0]["token_ids"]
        want, logits = hf_greedy_steps(server.model, prompt, MAX_NEW, BF16)
        tally.add(f"llama {len(prompt)} tokens", compare_greedy_bf16(got, want, logits))


def _check_llava(server: Server, tally: Bf16Tally) -> None:
    with ThreadPoolExecutor(len(IMAGE_SETS)) as pool:
        answers = list(pool.map(lambda ims: _chat(server, ims, QUESTION), IMAGE_SETS))
    for images, answer in zip(IMAGE_SETS, answers, strict=True):
        # The chat template writes BOS itself: no special tokens added.
        prompt = hf_llava_chat_prompt(server.model, QUESTION, len(images))
        want, logits = hf_llava_greedy_steps(
            server.model, prompt, images, MAX_NEW, BF16, add_special_tokens=False
        )
        got = answer["choices"][0]["token_ids"]
        tally.add(f"llava {len(images)} images", compare_greedy_bf16(got, want, logits))


def _check_mllama(server: Server, tally: Bf16Tally) -> None:
    with ThreadPoolExecutor(len(IMAGE_SETS)) as pool:
        answers = list(pool.map(lambda ims: _chat(server, ims, QUESTION), IMAGE_SETS))
    for images, answer in zip(IMAGE_SETS, answers, strict=True):
        want, logits = hf_mllama_greedy_steps(
            server.model, answer["prompt_token_ids"], images, MAX_NEW, BF16
        )
        got = answer["choices"][0]["token_ids"]
        tally.add(
            f"mllama {len(images)} images", compare_greedy_bf16(got, want, logits)
        )


def test_bf16_serving_matches_hf_and_compiles_nothing(
    server: tuple[str, Server], tally: Bf16Tally
) -> None:
    name, srv = server
    assert _compiles(srv, "warmup") > 0
    before = _compiles(srv, "serving")
    {"llama": _check_llama, "llava": _check_llava, "mllama": _check_mllama}[name](
        srv, tally
    )
    assert _compiles(srv, "serving") == before, f"{name}: compiled while serving"
