"""Sampled tokens kept on the device between steps (worker/async_output.py)."""

from __future__ import annotations

import numpy as np
import torch
from vllm.sampling_params import SamplingParams

from vllm_hpu_mm.worker.async_output import PLACEHOLDER, AsyncStepOutput, PendingTokens
from vllm_hpu_mm.worker.requests import RequestState


def state(req_id: str, prompt: list[int], outputs: list[int]) -> RequestState:
    return RequestState(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(),
        generator=None,
        block_ids=[0],
        num_computed_tokens=len(prompt) + len(outputs),
        output_token_ids=list(outputs),
    )


def test_placeholders_then_resolve() -> None:
    a, b, c = state("a", [1, 2], [7]), state("b", [3], []), state("c", [4, 5, 6], [])
    tokens = PendingTokens.start(
        torch.tensor([11, 12, 13]), [a, b, c], [True, False, True]
    )
    # Lengths are right at once (the scheduler counts the placeholder too)...
    assert a.output_token_ids == [7, PLACEHOLDER]
    assert b.output_token_ids == []  # a partial prefill gets no token
    assert c.output_token_ids == [PLACEHOLDER]
    assert (a.num_tokens, c.num_tokens) == (4, 4)
    # ...and the values arrive on resolve, once.
    np.testing.assert_array_equal(tokens.resolve(), [11, 12, 13])
    assert a.output_token_ids == [7, 11] and c.output_token_ids == [13]
    a.output_token_ids[-1] = 99
    tokens.resolve()
    assert a.output_token_ids == [7, 99]


def test_resolve_skips_a_trimmed_request() -> None:
    a = state("a", [1], [5])
    tokens = PendingTokens.start(torch.tensor([8]), [a], [True])
    del a.output_token_ids[1:]  # the scheduler dropped it (preempted)
    tokens.resolve()
    assert a.output_token_ids == [5]


def test_scatter_into_writes_each_placeholder_row() -> None:
    # Rows of the last step: a (decode), b (partial prefill), c (last chunk).
    a, b, c = state("a", [1, 2], [7]), state("b", [3, 3, 3], []), state("c", [4], [])
    tokens = PendingTokens.start(
        torch.tensor([21, 22, 23]), [a, b, c], [True, False, True]
    )
    # Next step, batch order c, b, a: c decodes its placeholder (position 1),
    # b's next chunk has no placeholder, a decodes (position 3).
    req_ids = ["c", "b", "a"]
    starts = np.array([1, 1, 3])  # num_computed_tokens
    query_lens = np.array([1, 2, 1])
    row_starts = np.array([0, 2, 1])  # token rows in the padded layout
    input_ids = torch.full((8,), -1, dtype=torch.int64)
    input_ids[2:4] = torch.tensor([3, 3])
    written = tokens.scatter_into(input_ids, req_ids, row_starts, starts, query_lens)
    assert written == 2
    assert input_ids.tolist() == [23, 21, 3, 3, -1, -1, -1, -1]


def test_scatter_into_a_chunk_that_holds_the_placeholder() -> None:
    # A resumed request recomputes from position 0: its placeholder (position
    # 3) is the last token of a 4-token chunk starting at token row 5.
    a = state("a", [1, 2, 3], [])
    tokens = PendingTokens.start(torch.tensor([42]), [a], [True])
    input_ids = torch.zeros(10, dtype=torch.int64)
    tokens.scatter_into(input_ids, ["a"], np.array([5]), np.array([0]), np.array([4]))
    assert input_ids[8].item() == 42 and int(input_ids.sum()) == 42


def test_async_step_output_builds_on_demand() -> None:
    calls: list[int] = []

    def build() -> object:
        calls.append(1)
        return "output"

    out = AsyncStepOutput(build)  # type: ignore[arg-type]
    assert calls == []
    assert out.get_output() == "output" and calls == [1]
    assert out.get_kv_connector_output() is None
