"""Offline ``vllm.LLM`` on the plugin: greedy parity with HF, and sampling options.

One engine per configuration, shared by the tests of a class (an engine start
costs seconds; a class-scoped engine is shut down before the next one starts):

- ``TestChunkedPrefill``: a 32-token step budget, so long prompts are split into
  several chunks and decodes of short prompts share steps with prefill chunks;
- ``TestDefaultBudget``: the default budget; greedy parity plus sampling options;
- ``TestSlidingWindow``: tiny-mistral (window 16) on prompts of 40-100 tokens.
"""

from __future__ import annotations

import gc
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_reference import hf_greedy, hf_greedy_logprobs, load_hf_tokenizer

pytestmark = pytest.mark.e2e

MAX_NEW = 16
FIRST_ORDINARY_ID = 6  # ids below are the tokenizer's special tokens
TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Write a poem about the sea, the wind and a small wooden boat, please.",
    "Paris is the capital of France and Rome is the capital of Italy; what is "
    "the capital of Spain? Think about it and answer in one sentence.",
    "Our team meets every Tuesday to review progress. ",
    "Memory is divided into blocks, and each block holds a few tokens. ",
]
MIXED_LENGTHS = (3, 11, 29, 57, 88, 120)


def _prompt_ids(model_dir: str, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """One prompt per length: tokenized text, topped up with seeded random ids."""
    tok = load_hf_tokenizer(model_dir)
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i, length in enumerate(lengths):
        ids = tok(TEXTS[i % len(TEXTS)])["input_ids"][:length]
        extra = torch.randint(
            FIRST_ORDINARY_ID, len(tok), (length - len(ids),), generator=gen
        )
        prompts.append(ids + extra.tolist())
    return prompts


def _make_llm(model_dir: str, **kwargs: Any) -> Any:
    from vllm import LLM

    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 512,
        "enforce_eager": True,
        "seed": 0,
    }
    return LLM(model=model_dir, **(settings | kwargs))


def _shutdown(llm: Any) -> None:
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    del llm
    gc.collect()


def _engine(model_dir: str, **kwargs: Any) -> Iterator[Any]:
    llm = _make_llm(model_dir, **kwargs)
    try:
        yield llm
    finally:
        _shutdown(llm)


def _generate(llm: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    """``llm.generate`` on token-id prompts; one RequestOutput per prompt."""
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    return outputs


def _first_token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _vllm_greedy(
    llm: Any, prompts: list[list[int]], max_tokens: int = MAX_NEW
) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return _first_token_ids(_generate(llm, prompts, params))


def _assert_same_tokens(
    got: list[list[int]], want: list[list[int]], prompts: list[list[int]]
) -> None:
    """Token-identical outputs, else name each prompt and its first divergence."""
    problems = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            same = [a == b for a, b in zip(g, w, strict=False)]
            first = same.index(False) if False in same else len(same)
            problems.append(
                f"prompt {i} (len {len(prompts[i])}): first difference at output "
                f"token {first}\n  vllm: {g}\n  hf:   {w}"
            )
    assert not problems, "vLLM greedy != HF greedy:\n" + "\n".join(problems)


def test_platform_is_plugin() -> None:
    """vLLM resolved its platform to this plugin (the package is installed)."""
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    assert platform_cls.__module__.startswith("vllm_hpu_mm."), platform_cls


class TestChunkedPrefill:
    """Small step budget: chunked prefills mixed with decodes."""

    @pytest.fixture(scope="class")
    def record(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp("record") / "steps.jsonl"

    @pytest.fixture(scope="class")
    def llm(self, tiny_llama_dir: str, record: Path) -> Iterator[Any]:
        yield from _engine(
            tiny_llama_dir,
            enable_chunked_prefill=True,
            max_num_batched_tokens=32,
            max_num_seqs=8,
            additional_config={"hpu_mm": {"bucketing": {"record_steps": str(record)}}},
        )

    def test_greedy_matches_hf(self, llm: Any, tiny_llama_dir: str) -> None:
        prompts = _prompt_ids(tiny_llama_dir, MIXED_LENGTHS, seed=1)
        got = _vllm_greedy(llm, prompts)
        _assert_same_tokens(got, hf_greedy(tiny_llama_dir, prompts, MAX_NEW), prompts)

    def test_more_prompts_than_max_num_seqs(
        self, llm: Any, tiny_llama_dir: str
    ) -> None:
        """12 prompts with max_num_seqs=8: requests queue and join mid-flight."""
        lengths = (5, 40, 9, 70, 17, 33, 3, 100, 24, 61, 12, 48)
        prompts = _prompt_ids(tiny_llama_dir, lengths, seed=2)
        got = _vllm_greedy(llm, prompts, max_tokens=8)
        _assert_same_tokens(got, hf_greedy(tiny_llama_dir, prompts, 8), prompts)

    def test_served_steps_are_recorded_for_the_planner(
        self, llm: Any, record: Path
    ) -> None:
        """bucketing.record_steps: one line a served step, exact sizes. Prompts
        of seeded random ids share no cached block with earlier ones, so the
        recorded rows are every prompt token plus one decode row per new token
        after the first."""
        before = record.read_text().splitlines() if record.exists() else []
        gen = torch.Generator().manual_seed(11)
        lengths = (45, 7, 30)
        prompts = [
            torch.randint(FIRST_ORDINARY_ID, 200, (n,), generator=gen).tolist()
            for n in lengths
        ]
        _vllm_greedy(llm, prompts, max_tokens=5)
        steps = [json.loads(x) for x in record.read_text().splitlines()[len(before) :]]
        rows = sum(s["prefill_tokens"] + s["num_decodes"] for s in steps)
        assert rows == sum(lengths) + 4 * len(lengths)
        assert all(0 < s["num_reqs"] <= 8 for s in steps)
        assert all(s["prefill_tokens"] + s["num_decodes"] <= 32 for s in steps)


class TestPreemption:
    """A KV cache too small for the batch: vLLM preempts running requests
    (their blocks freed, recomputed later), so decode rows leave and come back
    with new blocks and recomputed K/V; outputs stay HF's. The dense decode
    cache is off here: it is built only when it fits in the paged cache, and a
    paged cache holding max_num_seqs x max_model_len tokens all but never preempts
    (its own preemption handling is tested in tests/unit/test_decode_cache.py)."""

    @pytest.fixture(scope="class")
    def llm(self, tiny_llama_dir: str) -> Iterator[Any]:
        # 20 blocks of 16 tokens (2 layers x K, V x 2 heads x 16 x 4 bytes a
        # token) hold 320 tokens: the six prompts' 308 plus 40 new tokens
        # each do not fit at once.
        yield from _engine(
            tiny_llama_dir,
            max_model_len=192,
            max_num_seqs=8,
            kv_cache_memory_bytes=20 * 16 * 2 * 2 * 2 * 16 * 4,
            disable_log_stats=False,  # for the preemption counter
        )

    def test_preempted_requests_match_hf(self, llm: Any, tiny_llama_dir: str) -> None:
        prompts = _prompt_ids(tiny_llama_dir, MIXED_LENGTHS, seed=3)
        got = _vllm_greedy(llm, prompts, max_tokens=40)
        preemptions = sum(
            getattr(m, "value", 0)
            for m in llm.get_metrics()
            if m.name == "vllm:num_preemptions"
        )
        assert preemptions > 0, "the KV cache was meant to be too small"
        _assert_same_tokens(got, hf_greedy(tiny_llama_dir, prompts, 40), prompts)


class TestDefaultBudget:
    """Default scheduler budget: greedy parity and the sampling options."""

    @pytest.fixture(scope="class")
    def llm(self, tiny_llama_dir: str) -> Iterator[Any]:
        yield from _engine(tiny_llama_dir)

    @pytest.fixture(scope="class")
    def prompts(self, tiny_llama_dir: str) -> list[list[int]]:
        return _prompt_ids(tiny_llama_dir, MIXED_LENGTHS, seed=1)

    def test_greedy_matches_hf(
        self, llm: Any, tiny_llama_dir: str, prompts: list[list[int]]
    ) -> None:
        got = _vllm_greedy(llm, prompts)
        _assert_same_tokens(got, hf_greedy(tiny_llama_dir, prompts, MAX_NEW), prompts)

    def test_greedy_alone_equals_batched(
        self, llm: Any, prompts: list[list[int]]
    ) -> None:
        batched = _vllm_greedy(llm, prompts)
        alone = [_vllm_greedy(llm, [p])[0] for p in prompts[:3]]
        _assert_same_tokens(alone, batched[:3], prompts[:3])

    def test_seed_reproducible(self, llm: Any, prompts: list[list[int]]) -> None:
        from vllm import SamplingParams

        def sample(seed: int) -> list[list[int]]:
            params = SamplingParams(
                temperature=1.0, seed=seed, max_tokens=MAX_NEW, ignore_eos=True
            )
            return _first_token_ids(_generate(llm, prompts, params))

        first, again, other = sample(1234), sample(1234), sample(4321)
        assert first == again, "same seed gave different samples"
        assert first != other, "different seeds gave identical samples for all prompts"
        greedy = _vllm_greedy(llm, prompts)
        assert first != greedy, "temperature 1.0 sampled exactly the greedy tokens"

    def test_same_seed_in_one_batch(self, llm: Any, prompts: list[list[int]]) -> None:
        """Two seeded requests in one batch do not share a random stream."""
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=1.0, seed=7, max_tokens=MAX_NEW, ignore_eos=True
        )
        outs = _generate(llm, [prompts[2], prompts[2]], params)
        alone = _generate(llm, [prompts[2]], params)
        ids = _first_token_ids([*outs, *alone])
        assert ids[0] == ids[1] == ids[2], ids

    @pytest.mark.parametrize(
        "option", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "top_p=1e-6"]
    )
    def test_truncation_equals_greedy(
        self, llm: Any, prompts: list[list[int]], option: dict[str, Any]
    ) -> None:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=1.0, seed=5, max_tokens=MAX_NEW, ignore_eos=True, **option
        )
        got = _first_token_ids(_generate(llm, prompts, params))
        _assert_same_tokens(got, _vllm_greedy(llm, prompts), prompts)

    def test_logprobs_match_hf(
        self, llm: Any, tiny_llama_dir: str, prompts: list[list[int]]
    ) -> None:
        from vllm import SamplingParams

        k = 3
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=k
        )
        outputs = _generate(llm, prompts, params)
        hf_logprobs = hf_greedy_logprobs(tiny_llama_dir, prompts, MAX_NEW)
        for i, (out, ref) in enumerate(zip(outputs, hf_logprobs, strict=True)):
            completion = out.outputs[0]
            assert completion.logprobs is not None
            assert len(completion.logprobs) == MAX_NEW
            for step, (token, entry) in enumerate(
                zip(completion.token_ids, completion.logprobs, strict=True)
            ):
                where = f"prompt {i} step {step}"
                assert k <= len(entry) <= k + 1, (where, entry)
                assert token in entry, (where, token, entry)
                ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
                assert ranked[0][0] == token, (where, "top logprob is not greedy")
                probs = sum(math.exp(lp.logprob) for lp in entry.values())
                assert probs <= 1.0 + 1e-5, (where, probs)
                ref_top = torch.topk(ref[step], k)
                assert [t for t, _ in ranked[:k]] == ref_top.indices.tolist(), where
                for tid, lp in entry.items():
                    want = ref[step, tid].item()
                    assert lp.logprob == pytest.approx(want, abs=1e-4), (where, tid)
                    assert lp.rank == int((ref[step] > want).sum()) + 1, (where, tid)

    def test_stop_string(self, llm: Any, prompts: list[list[int]]) -> None:
        from vllm import SamplingParams

        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        [full] = _generate(llm, [prompts[1]], greedy)
        text = full.outputs[0].text
        stop = _pick_stop_string(text)
        cut = text.index(stop)
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop]
        )
        [out] = _generate(llm, [prompts[1]], params)
        completion = out.outputs[0]
        assert completion.text == text[:cut], (stop, text, completion.text)
        assert completion.finish_reason == "stop"
        assert completion.stop_reason == stop
        assert len(completion.token_ids) < MAX_NEW

    def test_max_tokens(self, llm: Any, prompts: list[list[int]]) -> None:
        from vllm import SamplingParams

        for ignore_eos in (True, False):
            params = SamplingParams(
                temperature=1.0, max_tokens=5, ignore_eos=ignore_eos
            )
            for out in _generate(llm, prompts, params):
                completion = out.outputs[0]
                if ignore_eos:
                    assert len(completion.token_ids) == 5
                    assert completion.finish_reason == "length"
                else:
                    assert 1 <= len(completion.token_ids) <= 5

    def test_n_2(self, llm: Any, prompts: list[list[int]]) -> None:
        from vllm import SamplingParams

        params = SamplingParams(
            n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True
        )
        outputs = _generate(llm, prompts[:4], params)
        pairs = []
        for out in outputs:
            assert len(out.outputs) == 2
            assert sorted(c.index for c in out.outputs) == [0, 1]
            assert all(len(c.token_ids) == 8 for c in out.outputs)
            pairs.append([list(c.token_ids) for c in out.outputs])
        assert any(a != b for a, b in pairs), "n=2 gave identical samples everywhere"
        # Greedy rejects n > 1; top_k=1 makes both samples the greedy tokens.
        greedy = SamplingParams(
            n=2, temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True
        )
        want = _vllm_greedy(llm, prompts[:4], max_tokens=8)
        for out, w in zip(_generate(llm, prompts[:4], greedy), want, strict=True):
            assert [list(c.token_ids) for c in out.outputs] == [w, w]


def _pick_stop_string(text: str) -> str:
    """A short ASCII word-ish substring whose first occurrence is after index 0."""
    for match in re.finditer(r"[A-Za-z]{2}", text):
        start = match.start()
        stop = match.group()
        if start > 0 and text.index(stop) == start:
            return stop
    pytest.fail(f"no usable stop string in greedy output {text!r}")


class TestSlidingWindow:
    """tiny-mistral, window 16: prompts much longer than the window."""

    @pytest.fixture(scope="class")
    def llm(self, tiny_mistral_dir: str) -> Iterator[Any]:
        yield from _engine(tiny_mistral_dir)

    def test_greedy_matches_hf(self, llm: Any, tiny_mistral_dir: str) -> None:
        prompts = _prompt_ids(tiny_mistral_dir, (40, 57, 75, 100, 9), seed=3)
        want = hf_greedy(tiny_mistral_dir, prompts, MAX_NEW)
        # The window must matter for these prompts, else this test proves nothing.
        full = hf_greedy(tiny_mistral_dir, prompts, MAX_NEW, no_sliding_window=True)
        assert all(w != f for w, f in zip(want, full, strict=True))
        _assert_same_tokens(_vllm_greedy(llm, prompts), want, prompts)
