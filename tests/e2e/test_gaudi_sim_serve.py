"""``vllm serve`` on the simulated Gaudi (``vllm_hpu_mm.gaudi_sim``).

``VLLM_HPU_MM_DEVICE=hpu VLLM_HPU_MM_GAUDI_SIM=1``: every process of the server
(API server, engine core) loads the simulated Habana stack, so the engine
takes the Gaudi path (block size 128, attention traced into static bucketed
graphs compiled by the simulated ``hpu_backend``, FusedSDPA / FusedRMSNorm /
fused RoPE, KV cache sized from the simulated card's memory). Tiny Llama in
bfloat16 and graph mode serves, concurrently: greedy requests with
``logprobs`` and ``prompt_logprobs`` compared with HF transformers in bfloat16
up to the first near-tie (``tests.hf_reference.compare_greedy_bf16``), and a
JSON-schema structured-output request; nothing is compiled while serving,
neither by the plugin's graphs nor by vLLM's own ``torch.compile`` helpers
(the simulated backend logs every graph it compiles).
"""

from __future__ import annotations

import json
import re
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
from vllm_hpu_mm.gaudi_sim.compiler import COMPILE_LOG, INPUT_COPY_LOG

pytestmark = pytest.mark.e2e

MAX_NEW = 8
BUCKETS = "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8]\n"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WARMUP_DONE = "Warmup finished"
CARD_BYTES = 64 * 2**20  # a small card (the host backs it)
UTILIZATION = 0.8  # --gpu-memory-utilization
GRAPH_RESERVE = 0.2  # hpu_mm.memory.graph_reserve_fraction


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("vllm serve on the simulated Gaudi (Llama)")
    yield t
    t.report(request.config)


def serve_simulated(
    model_dir: str,
    tmp: Path,
    buckets: str,
    card_bytes: int,
    *args: str,
    plugin_extra: dict[str, Any] | None = None,
    max_model_len: int = 512,
) -> Iterator[Server]:
    """``vllm serve model_dir`` in bfloat16 graph mode on the simulated Gaudi
    (a card of ``card_bytes``), over the explicit bucket lists ``buckets`` (YAML
    text, written under ``tmp``); ``args`` go to ``vllm serve``,
    ``plugin_extra`` into ``hpu_mm``."""
    (tmp / "buckets.yaml").write_text(buckets)
    plugin = {
        "hpu_mm": {
            "graph_mode": "compile",
            "bucketing": {"strategy": "explicit", "file": str(tmp / "buckets.yaml")},
            "warmup": {"progress_bar": False},
            **(plugin_extra or {}),
        }
    }
    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_HPU_MM_DEVICE", "hpu")
    patch.setenv("VLLM_HPU_MM_GAUDI_SIM", "1")
    patch.setenv("VLLM_HPU_MM_GAUDI_SIM_MEMORY", str(card_bytes))
    patch.setattr(test_serve, "STARTUP_TIMEOUT_S", 600.0)
    try:
        yield from serve(
            model_dir,
            tmp / "server.log",
            "--dtype",
            "bfloat16",
            *args,
            "--additional-config",
            json.dumps(plugin),
            max_model_len=max_model_len,
        )
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    yield from serve_simulated(
        tiny_llama_dir,
        tmp_path_factory.mktemp("gaudi_sim"),
        BUCKETS,
        CARD_BYTES,
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--gpu-memory-utilization",
        str(UTILIZATION),
        plugin_extra={"memory": {"graph_reserve_fraction": GRAPH_RESERVE}},
        max_model_len=256,
    )


def _sim_compiles_after_warmup(server: Server) -> list[str]:
    lines = server.log_path.read_text(errors="replace").splitlines()
    done = [i for i, line in enumerate(lines) if WARMUP_DONE in line]
    assert done, "the server log has no warmup line"
    return [line for line in lines[done[-1] :] if COMPILE_LOG in line]


def _completion(server: Server, prompt: Any, **extra: Any) -> dict[str, Any]:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_the_server_runs_on_the_simulated_gaudi(server: Server) -> None:
    log = server.log_path.read_text(errors="replace")
    assert "simulated Gaudi" in log
    assert "block_size=128" in log  # Gaudi's KV block size
    assert "backend hpu_backend" in log
    assert "Memory: 0.06 GiB total" in log  # the KV cache sized from the card
    # Issue 28 item 4: no compiled graph copies a whole input (the KV caches
    # are written in place, as separate K and V tensors).
    assert "simulated hpu_backend compiled graph" in log
    assert INPUT_COPY_LOG not in log


def test_logprobs_structured_output_and_greedy_match_hf(
    server: Server, tally: Bf16Tally
) -> None:
    tok = load_hf_tokenizer(server.model)
    texts = ["The quick brown fox", "Once upon a time, in a land far", "1 2 3 4 5 6"]
    prompts = [tok(t)["input_ids"] for t in texts]

    def greedy(p: list[int]) -> dict[str, Any]:
        return _completion(server, p, ignore_eos=True, logprobs=2, prompt_logprobs=2)

    def constrained() -> dict[str, Any]:
        return _completion(
            server,
            "A person as JSON:",
            max_tokens=40,
            structured_outputs={"json": SCHEMA},
        )

    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        schema_future = pool.submit(constrained)
        answers = list(pool.map(greedy, prompts))
        schema_answer = schema_future.result()
    for prompt, answer in zip(prompts, answers, strict=True):
        choice = answer["choices"][0]
        got = choice["token_ids"]
        want, logits = hf_greedy_steps(server.model, prompt, MAX_NEW, torch.bfloat16)
        tally.add(f"{len(prompt)} tokens", compare_greedy_bf16(got, want, logits))
        top = choice["logprobs"]["top_logprobs"]
        assert len(top) == MAX_NEW and all(1 <= len(t) <= 3 for t in top)
        prompt_lps = answer["choices"][0]["prompt_logprobs"]
        assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
        assert all(entry for entry in prompt_lps[1:])
    text = schema_answer["choices"][0]["text"]
    finish = schema_answer["choices"][0]["finish_reason"]
    if finish == "stop":  # a complete document follows the schema
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    else:  # cut by max_tokens: still a prefix of a schema document
        assert text.lstrip().startswith("{"), text


def test_nothing_compiles_while_serving(server: Server) -> None:
    text = requests.get(server.url + "/metrics", timeout=10).text
    serving = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm_hpu_mm:graph_compiles_total{")
        and 'phase="serving"' in line
    ]
    assert sum(serving) == 0, serving
    assert _sim_compiles_after_warmup(server) == []
    assert COMPILE_LOG in server.log_path.read_text(errors="replace")  # at warmup


def _memory_line(server: Server) -> dict[str, int]:
    """The worker's KV-cache sizing figures, in bytes, from its log line."""
    log = server.log_path.read_text(errors="replace")
    found = re.search(
        r"bytes: total (\d+), in use (\d+), profiled peak (\d+), KV cache (\d+)", log
    )
    assert found, "no memory sizing line in the server log"
    keys = ("total", "in_use", "peak", "kv_cache")
    return dict(zip(keys, map(int, found.groups()), strict=True))


def _num_gpu_blocks(server: Server) -> int:
    text = requests.get(server.url + "/metrics", timeout=10).text
    found = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    assert found, "no num_gpu_blocks in vllm:cache_config_info"
    return int(found.group(1))


def test_kv_cache_is_sized_from_the_simulated_card(server: Server) -> None:
    """Issue 27 item 4: the KV cache takes the card's usable share
    (``--gpu-memory-utilization``) less the weights and the profiled peak,
    less the graph reserve (``graph_reserve_fraction`` of the rest); the block
    count is recomputed here from the model's shapes and the server's settings.

    Weights: the parameter count from config.json x 2 bytes (bfloat16). The
    card also holds a few non-weight tensors (vLLM's RoPE cos/sin cache, the
    step's input buffers): at most ``other`` bytes, read back from the worker's
    log line and checked. The profiled peak is read from the same line and
    checked between bounds from the profiled step's shapes (the largest
    prefill bucket, 64 tokens, over ``max_model_len`` 256 = 2 blocks of keys).
    Tolerance: the unknown non-weight bytes move the count by at most
    ``other x (1 - reserve) / block bytes`` blocks, all downwards."""
    cfg = json.loads((Path(server.model) / "config.json").read_text())
    hidden, inter, vocab = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    )
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    bf16, f32 = 2, 4
    per_layer = (
        hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v projections
        + heads * head_dim * hidden  # o projection
        + 3 * hidden * inter  # gate, up, down
        + 2 * hidden  # two RMSNorm weights
    )
    assert not cfg["tie_word_embeddings"]
    weights = (2 * vocab * hidden + layers * per_layer + hidden) * bf16  # + final norm
    block_bytes = layers * 2 * 128 * kv_heads * head_dim * bf16  # K and V, block 128
    rope = cfg["max_position_embeddings"] * head_dim * bf16  # cos/sin per position
    other = 2 * rope  # vLLM's cos/sin cache, + as much for buffers and small tensors

    got = _memory_line(server)
    assert got["total"] == CARD_BYTES
    assert weights <= got["in_use"] <= weights + other, (got, weights)

    # The peak: gate_up [T, 2I] and its activation [T, I] in bfloat16 are alive
    # together (a lower bound); every activation of one decoder layer alive at
    # once in float32, twice over (cast copies), plus the logits, bounds it above.
    t, keys, rows = 64, 2 * 128, 4  # tokens, keys of the tile, logits rows
    low = t * 3 * inter * bf16
    layer = (
        3 * t * hidden  # hidden, residual, normed
        + 2 * t * (heads + 2 * kv_heads) * head_dim  # qkv, then q, k, v roped
        + 2 * keys * (kv_heads + heads) * head_dim  # K, V gathered, GQA-repeated
        + 2 * heads * t * keys  # scores and probabilities
        + t * heads * head_dim
        + t * hidden  # attention out, o projection
        + t * 3 * inter
        + t * hidden  # gate_up, activation, down
    )
    high = 2 * (layer + rows * vocab) * f32
    assert low <= got["peak"] <= high, (got["peak"], low, high)

    rest = int(CARD_BYTES * UTILIZATION) - weights - got["peak"]
    most = int(rest * (1 - GRAPH_RESERVE)) // block_bytes
    least = int((rest - other) * (1 - GRAPH_RESERVE)) // block_bytes
    assert least <= _num_gpu_blocks(server) <= most, (least, most)
