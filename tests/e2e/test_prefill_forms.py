"""One-request prefill forms on the simulated Gaudi (``vllm serve``).

A prefill part of one request above one 128-row tile runs in a form of its own
(``attention.layout.PrefillForm``, ``bucketing.prefill_one_request``): a fresh
prompt through FusedSDPA's causal mode (``causal``), a later chunk with its
context gathered once, as one tile (``request``). The other modules serve with
token budgets of at most 64 rows, so only here do these forms run end to end:
the simulated Habana stack (``VLLM_HPU_MM_GAUDI_SIM``), Gaudi's block size 128,
a 256-token budget, tiny Llama in bfloat16. Prompts are sent one at a time, so
each step's prefill part is one request: a fresh 200-token prompt (``causal``)
and a 400-token one chunked at 256 (``causal``, then 144 rows after 256 tokens
of context: ``request``). Greedy output is compared with HF transformers in
bfloat16 up to the first near-tie; warmup prepared every shape (nothing
compiles while serving); the server's ``prefill_form_steps`` counter shows
which forms ran.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import requests
import torch

from tests.e2e.test_gaudi_sim_serve import serve_simulated
from tests.e2e.test_serve import Server, server_compiles
from tests.hf_reference import Bf16Tally, compare_greedy_bf16, hf_greedy_steps

pytestmark = pytest.mark.e2e

MAX_NEW = 6
BUCKETS = "prefill_tokens: [16, 64, 256]\ndecode_batch: [1, 2]\nblocks: [2, 4, 8]\n"
CARD_BYTES = 96 * 2**20  # a small card (the host backs it)


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("one-request prefill forms on the simulated Gaudi (Llama)")
    yield t
    t.report(request.config)


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    yield from serve_simulated(
        tiny_llama_dir,
        tmp_path_factory.mktemp("prefill_forms"),
        BUCKETS,
        CARD_BYTES,
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "256",
        "--no-enable-prefix-caching",
    )


def _form_steps(server: Server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm_hpu_mm:prefill_form_steps_total{"):
            form = line.split('form="')[1].split('"')[0]
            out[form] = out.get(form, 0.0) + float(line.split()[-1])
    return out


def test_fresh_and_chunked_prompts_run_their_forms_and_match_hf(
    server: Server, tally: Bf16Tally
) -> None:
    log = server.log_path.read_text(errors="replace")
    assert "simulated Gaudi" in log and "block_size=128" in log
    rng = random.Random(3)
    before = _form_steps(server)
    for n in (200, 400):
        prompt = [rng.randrange(5, 600) for _ in range(n)]
        got = server.greedy_completion(prompt, MAX_NEW)["choices"][0]["token_ids"]
        want, logits = hf_greedy_steps(server.model, prompt, MAX_NEW, torch.bfloat16)
        tally.add(f"{n} tokens", compare_greedy_bf16(got, want, logits))
    after = _form_steps(server)
    ran = {f: after.get(f, 0.0) - before.get(f, 0.0) for f in after}
    # 200 fresh; 400 as 256 fresh + 144 after context; decode steps have none
    assert ran.get("causal") == 2, ran
    assert ran.get("request") == 1, ran
    assert server_compiles(server)["serving"] == 0
