"""vLLM's logits processors on the plugin's persistent batch.

One engine with a custom processor (``--logits-processors``, defined in
``tests/e2e/custom_logitsprocs.py``) besides vLLM's built-ins (min_p,
logit_bias, min_tokens), and the sampler's own options (penalties,
allowed_token_ids, bad_words). Requests of different lengths run together,
so rows are freed and the persistent batch moves requests between rows while
the processors hold per-row state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.e2e.test_llm_generate import _make_llm, _prompt_ids, _shutdown
from tests.hf_reference import load_hf_model

pytestmark = pytest.mark.e2e

CUSTOM = "tests.e2e.custom_logitsprocs:ForceTokenProcessor"
LENGTHS = (5, 17, 40, 9, 70, 3)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> Iterator[Any]:
    engine = _make_llm(
        tiny_llama_dir,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        logits_processors=[CUSTOM],
    )
    try:
        yield engine
    finally:
        _shutdown(engine)


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: str) -> list[list[int]]:
    return _prompt_ids(tiny_llama_dir, LENGTHS, seed=3)


def _params(**kwargs: Any) -> Any:
    from vllm import SamplingParams

    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(**kwargs)


def _run(llm: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def test_logit_bias_follows_each_request(llm: Any, prompts: list[list[int]]) -> None:
    """Each request biases its own token; different lengths make rows move."""
    params = [
        _params(logit_bias={100 + i: 100.0}, max_tokens=2 + 3 * i)
        for i in range(len(prompts))
    ]
    got = _run(llm, prompts, params)
    for i, tokens in enumerate(got):
        assert tokens == [100 + i] * (2 + 3 * i)


def test_custom_processor_mixed_with_free_requests(
    llm: Any, prompts: list[list[int]]
) -> None:
    free = _run(llm, prompts, _params())
    params = [
        _params(extra_args={"force_token": 200 + i}, max_tokens=4 + 2 * i)
        if i % 2
        else _params()
        for i in range(len(prompts))
    ]
    got = _run(llm, prompts, params)
    for i, tokens in enumerate(got):
        if i % 2:
            assert tokens == [200 + i] * (4 + 2 * i)
        else:
            assert tokens == free[i]


def test_custom_processor_rejects_bad_argument(llm: Any) -> None:
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="force_token must be an int"):
        llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}],
            _params(extra_args={"force_token": "x"}),
            use_tqdm=False,
        )


def test_min_tokens_holds_back_stop_tokens(llm: Any, prompts: list[list[int]]) -> None:
    free = _run(llm, prompts, _params(max_tokens=16))
    for prompt, tokens in zip(prompts, free, strict=True):
        stop = tokens[1]
        first = tokens.index(stop)  # the free run stops right after this
        (short,) = _run(llm, [prompt], _params(max_tokens=16, stop_token_ids=[stop]))
        assert short == tokens[: first + 1]
        (held,) = _run(
            llm,
            [prompt],
            _params(max_tokens=16, stop_token_ids=[stop], min_tokens=first + 4),
        )
        assert len(held) >= first + 4
        assert stop not in held[: first + 4]
        assert held[-1] == stop or len(held) == 16


def test_min_p_one_is_greedy(llm: Any, prompts: list[list[int]]) -> None:
    greedy = _run(llm, prompts, _params())
    sampled = _run(llm, prompts, _params(temperature=1.0, min_p=1.0, seed=7))
    assert sampled == greedy
    plain = _run(llm, prompts, _params(temperature=1.0, seed=7))
    assert plain != greedy  # the premise: without min_p, sampling differs


def test_allowed_token_ids(llm: Any, prompts: list[list[int]]) -> None:
    allowed = [50, 51, 52]
    got = _run(llm, prompts, _params(allowed_token_ids=allowed))
    assert all(set(t) <= set(allowed) for t in got)


def test_bad_words(llm: Any, prompts: list[list[int]], tiny_llama_dir: str) -> None:
    """vLLM's rule: a bad word's token sequences (with and without a leading
    space) may not be completed; a one-token sequence is never produced."""
    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(tiny_llama_dir)
    free = _run(llm, prompts, _params())
    checked = 0
    for prompt, tokens in zip(prompts, free, strict=True):
        word = tok.decode([tokens[0]]).strip()
        probe = SamplingParams(bad_words=[word])
        probe.update_from_tokenizer(tok)
        banned = {ids[0] for ids in probe.bad_words_token_ids or [] if len(ids) == 1}
        (got,) = _run(llm, [prompt], _params(bad_words=[word]))
        assert not banned & set(got), (word, banned, got)
        if tokens[0] in banned:
            checked += 1
            assert got[0] != tokens[0]
    assert checked, "no prompt's first token was a one-token bad word"


@pytest.mark.parametrize(
    "penalty", [{"repetition_penalty": 1.5}, {"repetition_penalty": 0.7}]
)
def test_repetition_penalty_matches_hf(
    llm: Any, prompts: list[list[int]], tiny_llama_dir: str, penalty: dict[str, float]
) -> None:
    """vLLM's and HF's repetition penalty are the same rule (divide positive,
    multiply negative logits of tokens seen in prompt or output)."""
    got = _run(llm, prompts, _params(**penalty))
    model = load_hf_model(tiny_llama_dir)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=penalty["repetition_penalty"],
            )
        assert tokens == out[0, len(prompt) :].tolist()


def test_presence_and_frequency_penalties_follow_vllm_rule(
    llm: Any, prompts: list[list[int]], tiny_llama_dir: str
) -> None:
    """OpenAI's rule as vLLM applies it: logits minus frequency x count minus
    presence x (count > 0), counted over the output tokens only."""
    pres, freq = 0.8, 0.6
    got = _run(llm, prompts, _params(presence_penalty=pres, frequency_penalty=freq))
    model = load_hf_model(tiny_llama_dir)
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = list(prompt)
        want: list[int] = []
        for _ in range(12):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(
                torch.tensor(want, dtype=torch.int64), minlength=logits.numel()
            )[: logits.numel()].float()
            logits = logits - freq * counts - pres * (counts > 0).float()
            nxt = int(logits.argmax())
            want.append(nxt)
            ids.append(nxt)
        assert tokens == want


def test_seeded_sampling_does_not_depend_on_chunking(
    llm: Any, tiny_llama_dir: str
) -> None:
    """A 200-token prompt runs in 4 chunks (64-token budget); asked again, the
    prefix cache leaves one chunk. A seeded request draws the same tokens both
    times: discarded partial-prefill draws do not advance its generator."""
    (prompt,) = _prompt_ids(tiny_llama_dir, (200,), seed=11)
    params = _params(temperature=1.0, seed=123, max_tokens=8)
    first = _run(llm, [prompt], params)
    again = _run(llm, [prompt], params)
    assert first == again
    other = _run(llm, [prompt], _params(temperature=1.0, seed=124, max_tokens=8))
    assert other != first  # the premise: the seed matters
