"""Encoder runs and items are counted by tensor-parallel rank 0 only."""

from __future__ import annotations

import pytest
from vllm.distributed import parallel_state

from vllm_hpu_mm import metrics


def test_single_process_counts() -> None:
    assert not parallel_state.model_parallel_is_initialized()
    assert metrics.counts_items_here()


@pytest.mark.parametrize(("rank", "counts"), [(0, True), (1, False), (3, False)])
def test_only_rank_zero_counts(
    monkeypatch: pytest.MonkeyPatch, rank: int, counts: bool
) -> None:
    # Every rank runs the encoders on the same items (LLaVA, Qwen, Mllama):
    # counting on each would report TP x the runs per item.
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
    assert metrics.counts_items_here() is counts
