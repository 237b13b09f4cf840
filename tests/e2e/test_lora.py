"""LoRA adapters (``--enable-lora``), written by PEFT's ``save_pretrained``
with random non-zero A and B on every attention and MLP projection of the
language model, greedy tokens identical to HF + PEFT in float32, three adapters
and the base model in one batch. Two engines: tiny LLaVA through ``vllm.LLM``
on the static plan (Gaudi's path: every LoRA slot applied at the padded rank,
warmed up, no compilation while serving), and tiny Llama through ``vllm serve``
with ``--lora-modules`` and the runtime load and unload endpoints.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e.test_serve import Server, serve
from tests.graph_config import compiled_with_buckets
from tests.hf_reference import hf_greedy
from tests.lora_adapters import peft_greedy, peft_vlm_greedy, write_adapter
from tests.mm_reference import (
    engine_lifetime,
    hf_llava_inputs,
    llava_prompt,
    make_image,
    tiny_llava_dir,
)
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 8
RANK = 8


def _adapters(base: str, root: Path, language_prefix: str | None = None) -> list[str]:
    return [
        write_adapter(
            base, str(root / f"a{i}"), seed=10 + i, rank=RANK,
            language_prefix=language_prefix,
        )
        for i in range(3)
    ]  # fmt: skip


# ---- LLaVA through vllm.LLM, static plan -------------------------------------------


@pytest.fixture(scope="module")
def llava_adapters(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("llava-lora")
    return _adapters(tiny_llava_dir(), root, language_prefix="language_model")


@pytest.fixture(scope="module")
def llava(
    llava_adapters: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "llava-lora",
        "prefill_tokens: [32, 64]\ndecode_batch: [4]\nblocks: [16, 32]\n",
        execution="static",
    )
    engine = LLM(
        model=tiny_llava_dir(),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        seed=0,
        limit_mm_per_prompt={"image": 1},
        enable_lora=True,
        max_loras=3,
        max_lora_rank=RANK,
        additional_config=hpu_mm,
    )
    yield from engine_lifetime(engine)


def test_llava_three_adapters_and_base_in_one_batch(
    llava: Any, llava_adapters: list[str]
) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    base = tiny_llava_dir()
    cases = [
        (llava_prompt(1), [make_image("gradient", (40, 24), 1)]),
        (llava_prompt(0, "Say something."), []),
        (llava_prompt(1, "What is it?"), [make_image("stripes", (32, 32), 2)]),
        (llava_prompt(0, "Count to ten, please."), []),
    ]
    # Request i: the base model, then adapters a0, a1, a2.
    adapters: list[str | None] = [None, *llava_adapters]
    loras = [
        None if path is None else LoRARequest(f"a{i}", i, path)
        for i, path in enumerate(adapters)
    ]
    inputs = [
        {"prompt": text, "multi_modal_data": {"image": images[0]}}
        if images
        else {"prompt": text}
        for text, images in cases
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llava.generate(inputs, params, lora_request=loras, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    hf_inputs = [hf_llava_inputs(base, text, images) for text, images in cases]
    want = [
        peft_vlm_greedy(base, path, hf_in, MAX_NEW)
        for path, hf_in in zip(adapters, hf_inputs, strict=True)
    ]
    assert got == want
    # The adapters change the answer: without them HF says otherwise.
    plain = [peft_vlm_greedy(base, None, hf_in, MAX_NEW) for hf_in in hf_inputs[1:]]
    assert all(g != p for g, p in zip(got[1:], plain, strict=True)), (got, plain)
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0


# ---- Llama through vllm serve -------------------------------------------------------


@pytest.fixture(scope="module")
def llama_adapters(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> list[str]:
    return _adapters(tiny_llama_dir, tmp_path_factory.mktemp("llama-lora"))


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: str,
    llama_adapters: list[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    """``vllm serve`` with a0 and a1 from ``--lora-modules``; a2 is loaded at
    run time (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
    old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        yield from serve(
            tiny_llama_dir,
            tmp_path_factory.mktemp("lora-serve") / "server.log",
            "--enable-lora",
            "--max-loras", "3",
            "--max-lora-rank", str(RANK),
            "--lora-modules",
            f"a0={llama_adapters[0]}",
            f"a1={llama_adapters[1]}",
        )  # fmt: skip
    finally:
        if old is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old


def _complete(server: Server, model: str, prompt: list[int]) -> requests.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return server.post("/v1/completions", body)  # type: ignore[no-any-return]


def _models(server: Server) -> list[str]:
    response = requests.get(server.url + "/v1/models", timeout=10)
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


def test_serve_adapters_loaded_at_run_time_and_unloaded(
    server: Server, tiny_llama_dir: str, llama_adapters: list[str]
) -> None:
    assert {"a0", "a1"} <= set(_models(server)), _models(server)
    loaded = server.post(
        "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": llama_adapters[2]}
    )
    assert loaded.status_code == 200, loaded.text
    assert "a2" in _models(server)

    rng = random.Random(3)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (9, 31, 4, 17)]
    models = [server.model, "a0", "a1", "a2"]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:  # one batch
        responses = list(
            pool.map(
                lambda mp: _complete(server, *mp), zip(models, prompts, strict=True)
            )
        )
    for r in responses:
        assert r.status_code == 200, r.text
    got = [r.json()["choices"][0]["token_ids"] for r in responses]
    want = hf_greedy(tiny_llama_dir, prompts[:1], MAX_NEW) + [
        peft_greedy(tiny_llama_dir, path, [p], MAX_NEW)[0]
        for path, p in zip(llama_adapters, prompts[1:], strict=True)
    ]
    assert got == want
    assert hf_greedy(tiny_llama_dir, prompts[1:], MAX_NEW) != got[1:]

    unloaded = server.post("/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert unloaded.status_code == 200, unloaded.text
    assert "a1" not in _models(server)
    gone = _complete(server, "a1", prompts[2])
    assert gone.status_code == 404, gone.text
    # The others still serve, the same tokens as before.
    again = _complete(server, "a2", prompts[3])
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["token_ids"] == want[3]
