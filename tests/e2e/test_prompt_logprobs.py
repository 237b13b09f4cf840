"""Prompt logprobs against HF's log-softmax, across chunks and prefix-cache hits.

One engine with a 32-token step budget (prompts of up to 120 tokens are split
into several chunks, mixed with other requests' decodes) and prefix caching on.
HF's reference: ``log_softmax`` of the logits at every prompt position of the
float32 model; position ``p`` scores prompt token ``p + 1`` (vLLM's semantics:
the first prompt token has no logprob, ``None``).

vLLM's scheduler does not let a request with ``prompt_logprobs`` read the
prefix cache (every prompt position needs its logits), so a prompt that is
already cached gives the same full answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.e2e.test_llm_generate import _make_llm, _prompt_ids, _shutdown
from tests.hf_reference import load_hf_model

pytestmark = pytest.mark.e2e

LENGTHS = (2, 7, 31, 33, 64, 120)
TOP = 3
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> Iterator[Any]:
    engine = _make_llm(
        tiny_llama_dir,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    try:
        yield engine
    finally:
        _shutdown(engine)


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: str) -> list[list[int]]:
    return _prompt_ids(tiny_llama_dir, LENGTHS, seed=5)


def _hf_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[P, V] log-softmax of HF's logits at each prompt position."""
    model = load_hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _params(prompt_logprobs: int | None, max_tokens: int = 2) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs
    )


def _check(output: Any, prompt: list[int], hf: torch.Tensor, top: int) -> None:
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for p in range(1, len(prompt)):
        entry = got[p]
        token = prompt[p]
        want = hf[p - 1]
        assert abs(entry[token].logprob - want[token].item()) < ATOL, (p, entry)
        assert entry[token].rank == int((want > want[token]).sum()) + 1
        top_ids = want.topk(top).indices.tolist()
        for rank, tid in enumerate(top_ids, start=1):
            assert tid in entry, (p, tid, entry)
            assert abs(entry[tid].logprob - want[tid].item()) < ATOL
            assert entry[tid].rank == rank
        assert set(entry) <= set(top_ids) | {token}


def test_prompt_logprobs_match_hf_across_chunks(
    llm: Any, prompts: list[list[int]], tiny_llama_dir: str
) -> None:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], _params(TOP), use_tqdm=False
    )
    for out, prompt in zip(outs, prompts, strict=True):
        _check(out, prompt, _hf_logprobs(tiny_llama_dir, prompt), TOP)


def test_zero_means_the_prompt_token_only(
    llm: Any, prompts: list[list[int]], tiny_llama_dir: str
) -> None:
    prompt = prompts[4]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], _params(0), use_tqdm=False)
    hf = _hf_logprobs(tiny_llama_dir, prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert set(entry) == {prompt[p]}
        assert abs(entry[prompt[p]].logprob - hf[p - 1, prompt[p]].item()) < ATOL


def test_mixed_with_requests_without_prompt_logprobs(
    llm: Any, prompts: list[list[int]], tiny_llama_dir: str
) -> None:
    params = [
        _params(TOP if i % 2 else None, max_tokens=6) for i in range(len(prompts))
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    for i, (out, prompt) in enumerate(zip(outs, prompts, strict=True)):
        if i % 2:
            _check(out, prompt, _hf_logprobs(tiny_llama_dir, prompt), TOP)
        else:
            assert out.prompt_logprobs is None


def test_prefix_cached_prompt_gives_the_full_answer(
    llm: Any, prompts: list[list[int]], tiny_llama_dir: str
) -> None:
    prompt = prompts[5]
    # Fill the prefix cache with the prompt, then ask again with prompt logprobs,
    # and a third request sharing the first 64 tokens.
    llm.generate([{"prompt_token_ids": prompt}], _params(None), use_tqdm=False)
    shared = prompt[:64] + prompts[2]
    outs = llm.generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": shared}],
        _params(TOP),
        use_tqdm=False,
    )
    _check(outs[0], prompt, _hf_logprobs(tiny_llama_dir, prompt), TOP)
    _check(outs[1], shared, _hf_logprobs(tiny_llama_dir, shared), TOP)
