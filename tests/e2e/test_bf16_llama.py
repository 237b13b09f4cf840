"""Llama in bfloat16 through ``vllm.LLM`` in graph mode, compared with HF
transformers in bfloat16 (the same checkpoint loaded with ``dtype=bfloat16``).

Greedy outputs must equal HF's token for token except at a near-tie: a step
where HF's top-2 logit margin is at most ``BF16_TIE_SPACINGS`` (3) bfloat16
spacings of the top logit (``tests.hf_reference.compare_greedy_bf16``); there
the plugin must pick one of the tied tokens, and a sequence that parts from HF
there is not compared further. The module prints how many cases needed it.
Serving a mixed batch (short and long prompts, chunked prefill, decode)
compiles nothing after warmup.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.graph_config import compiled_with_buckets
from tests.hf_reference import Bf16Tally, compare_greedy_bf16, hf_greedy_steps
from tests.mm_reference import engine_lifetime, greedy_generate
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 12


def _serving_compiles() -> float:
    return _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"})


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("Llama, vllm.LLM")
    yield t
    t.report(request.config)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "llama",
        "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8, 16, 32]\n",
    )
    yield from engine_lifetime(
        LLM(
            model=tiny_llama_dir,
            dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            enable_chunked_prefill=True,
            seed=0,
            additional_config=hpu_mm,
        )
    )


def test_bf16_mixed_batch_matches_hf_and_compiles_nothing(
    llm: Any, tiny_llama_dir: str, tally: Bf16Tally
) -> None:
    assert llm.llm_engine.model_config.dtype == torch.bfloat16
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    compiles_before = _serving_compiles()
    rng = random.Random(13)
    prompts = [
        [rng.randrange(5, 500) for _ in range(n)] for n in (3, 9, 17, 33, 70, 120, 5)
    ]
    outs = greedy_generate(llm, [{"prompt_token_ids": p} for p in prompts], MAX_NEW)
    for prompt, out in zip(prompts, outs, strict=True):
        hf_tokens, hf_logits = hf_greedy_steps(
            tiny_llama_dir, prompt, MAX_NEW, torch.bfloat16
        )
        match = compare_greedy_bf16(
            list(out.outputs[0].token_ids), hf_tokens, hf_logits
        )
        tally.add(f"prompt of {len(prompt)} tokens", match)
    assert _serving_compiles() == compiles_before
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
