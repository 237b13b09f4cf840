"""Prompt logprobs of prompt tokens the head cannot produce (Mllama's
``<|image|>`` id is the text vocabulary's size)."""

from __future__ import annotations

import math

import torch

from vllm_hpu_mm.worker.sampling import _gather_prompt_logprobs


def test_a_token_past_the_head_gets_minus_inf_and_the_others_are_vllms() -> None:
    torch.manual_seed(0)
    scores = torch.log_softmax(torch.randn(4, 10), dim=-1)
    targets = torch.tensor([3, 10, 7, 12])  # 10 and 12: past the 10 outputs
    ids, lps, ranks = _gather_prompt_logprobs(scores, 2, targets)
    assert ids[:, 0].tolist() == [3, 10, 7, 12]
    for row in (0, 2):
        t = int(targets[row])
        assert lps[row, 0] == scores[row, t]
        assert int(ranks[row]) == int((scores[row] >= scores[row, t]).sum())
    for row in (1, 3):
        assert math.isinf(float(lps[row, 0])) and float(lps[row, 0]) < 0
        assert int(ranks[row]) == 10
    # the top-k columns are the row's best tokens whatever the target
    assert torch.equal(ids[:, 1:], scores.topk(2, dim=-1).indices)
