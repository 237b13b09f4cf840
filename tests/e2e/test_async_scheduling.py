"""Async scheduling (``--async-scheduling``, vLLM's default): same outputs as
synchronous steps.

Under async scheduling vLLM schedules step N+1 before it reads step N's
output, and the runner feeds step N's sampled tokens to step N+1 from the
device (placeholders on the host until they are read, worker/async_output.py).
A wrong placeholder would show as a wrong input token (greedy output leaves
HF's), as a wrong penalty or ``min_tokens`` count (sampled output leaves the
synchronous engine's), or as a grammar violation.

Two engines, one after the other, on the same requests (32-token step budget,
so prompts are chunked and decodes share steps with prefill chunks): async,
then synchronous. Every case is compared between the two; greedy is compared
with HF too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.test_llm_generate import (
    MIXED_LENGTHS,
    _assert_same_tokens,
    _engine,
    _generate,
    _prompt_ids,
)
from tests.hf_reference import hf_greedy, load_hf_tokenizer

pytestmark = pytest.mark.e2e

MAX_NEW = 12
REGEX = r"(cat|dog)-[0-9]{3}"


def _cases() -> dict[str, Callable[[int], Any]]:
    """Sampling parameters per case, by prompt index."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return {
        "greedy": lambda i: SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True
        ),
        # Penalties read every output token: a placeholder left unresolved
        # would count as token -1.
        "penalties": lambda i: SamplingParams(
            temperature=1.0,
            seed=100 + i,
            max_tokens=MAX_NEW,
            ignore_eos=True,
            repetition_penalty=1.5,
            presence_penalty=0.8,
            frequency_penalty=0.4,
        ),
        "min_tokens_logprobs": lambda i: SamplingParams(
            temperature=0.8,
            seed=200 + i,
            min_tokens=6,
            max_tokens=MAX_NEW,
            logprobs=3,
            prompt_logprobs=2,
        ),
        # Constrained and free requests in one batch.
        "regex_mixed": lambda i: SamplingParams(
            temperature=0.0,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex=REGEX)
            if i % 2 == 0
            else None,
        ),
    }


def _run_all(llm: Any, prompts: list[list[int]]) -> dict[str, list[Any]]:
    out = {}
    for name, params_for in _cases().items():
        params = [params_for(i) for i in range(len(prompts))]
        out[name] = _generate(llm, prompts, params)
    return out


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: str) -> list[list[int]]:
    return _prompt_ids(tiny_llama_dir, MIXED_LENGTHS, seed=11)


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: str, prompts: list[list[int]]) -> dict[str, Any]:
    """Outputs of each engine, and the scheduling mode each one ran."""
    runs: dict[str, Any] = {}
    for mode, flag in (("async", True), ("sync", False)):
        for llm in _engine(
            tiny_llama_dir,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            async_scheduling=flag,
            structured_outputs_config={"backend": "xgrammar"},
        ):
            runs[f"{mode}_flag"] = (
                llm.llm_engine.vllm_config.scheduler_config.async_scheduling
            )
            runs[mode] = _run_all(llm, prompts)
    return runs


def test_each_engine_ran_its_mode(runs: dict[str, Any]) -> None:
    assert runs["async_flag"] is True and runs["sync_flag"] is False


def test_greedy_matches_hf(
    runs: dict[str, Any], prompts: list[list[int]], tiny_llama_dir: str
) -> None:
    want = hf_greedy(tiny_llama_dir, prompts, MAX_NEW)
    got = [list(o.outputs[0].token_ids) for o in runs["async"]["greedy"]]
    _assert_same_tokens(got, want, prompts)


@pytest.mark.parametrize(
    "case", ["greedy", "penalties", "min_tokens_logprobs", "regex_mixed"]
)
def test_async_equals_sync(runs: dict[str, Any], case: str) -> None:
    for i, (a, s) in enumerate(
        zip(runs["async"][case], runs["sync"][case], strict=True)
    ):
        assert list(a.outputs[0].token_ids) == list(s.outputs[0].token_ids), (case, i)
        assert a.outputs[0].text == s.outputs[0].text, (case, i)


def test_min_tokens_held(runs: dict[str, Any]) -> None:
    for out in runs["async"]["min_tokens_logprobs"]:
        assert len(out.outputs[0].token_ids) >= 6


def test_logprobs_equal_sync(runs: dict[str, Any]) -> None:
    for a, s in zip(
        runs["async"]["min_tokens_logprobs"],
        runs["sync"]["min_tokens_logprobs"],
        strict=True,
    ):
        assert a.prompt_logprobs is not None and s.prompt_logprobs is not None
        assert len(a.prompt_logprobs) == len(s.prompt_logprobs)
        for got, want in zip(a.prompt_logprobs[1:], s.prompt_logprobs[1:], strict=True):
            assert got.keys() == want.keys()
            for tok in got:
                assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-5)
        for got, want in zip(a.outputs[0].logprobs, s.outputs[0].logprobs, strict=True):
            assert got.keys() == want.keys()


def test_regex_holds_and_free_rows_are_free(
    runs: dict[str, Any], tiny_llama_dir: str
) -> None:
    # The tokens are decoded alone: the prompts end in random byte tokens, and
    # vLLM's incremental detokenizer lets an unfinished UTF-8 sequence of the
    # prompt run into ``text`` (the synchronous engine shows the same).
    tok = load_hf_tokenizer(tiny_llama_dir)
    outs = runs["async"]["regex_mixed"]
    for i, out in enumerate(outs):
        text = tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        if i % 2 == 0:
            assert re.fullmatch(REGEX, text), text
    free = [list(o.outputs[0].token_ids) for o in outs[1::2]]
    greedy = [list(o.outputs[0].token_ids) for o in runs["async"]["greedy"][1::2]]
    # A free greedy row follows the greedy run for its first MAX_NEW tokens
    # (it stops at EOS, so it may be shorter).
    for f, g in zip(free, greedy, strict=True):
        n = min(len(f), len(g))
        assert f[:n] == g[:n]
