"""M-RoPE positions of a step (``worker.mrope``): chunks, prefix hits, decode."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hpu_mm.worker.mrope import (
    MRopePositions,
    compute_mrope,
    gather_mrope,
    request_positions,
)


def _entry(num_text_before: int, grid_hw: tuple[int, int], num_text_after: int):
    """Positions as Qwen2-VL lays them out: text, an image grid, text."""
    h, w = grid_hw
    text = np.broadcast_to(np.arange(num_text_before), (3, num_text_before))
    hh, ww = np.indices((h, w)).reshape(2, -1)
    image = np.stack([np.zeros(h * w, np.int64), hh, ww]) + num_text_before
    after_start = image.max() + 1
    after = np.broadcast_to(
        np.arange(num_text_after) + after_start, (3, num_text_after)
    )
    prompt = np.concatenate([text, image, after], axis=1).astype(np.int64)
    delta = int(prompt.max()) + 1 - prompt.shape[1]
    return MRopePositions(prompt, delta)


def test_prompt_then_generated_tokens() -> None:
    e = _entry(2, (2, 3), 1)  # 2 text, 6 image tokens, 1 text: 9 prompt tokens
    assert e.prompt.shape == (3, 9)
    # image at 2 + (row, col): its last token [2, 3, 4]; the text after it 5
    assert e.delta == 6 - 9
    got = request_positions(e, 7, 11)  # 2 prompt tokens, then 2 generated
    assert got.tolist() == [[2, 5, 6, 7], [3, 5, 6, 7], [4, 5, 6, 7]]


def test_gather_is_batch_order_of_each_requests_window() -> None:
    a, b = _entry(1, (2, 2), 2), _entry(3, (1, 2), 0)
    starts = np.array([6, 0])  # a decodes its first generated token; b prefills
    lens = np.array([1, 3])
    got = gather_mrope([a, b], starts, lens)
    assert got.shape == (3, 4)
    np.testing.assert_array_equal(got[:, :1], request_positions(a, 6, 7))
    np.testing.assert_array_equal(got[:, 1:], b.prompt[:, :3])
    assert gather_mrope([], np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (
        3,
        0,
    )


@given(
    before=st.integers(0, 5),
    grid=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    after=st.integers(0, 5),
    generated=st.integers(0, 6),
    cuts=st.lists(st.integers(0, 40), max_size=4),
)
def test_chunks_concatenate_to_the_whole(before, grid, after, generated, cuts) -> None:
    # However a request's tokens are cut into steps (chunked prefill, a prefix
    # hit starting mid-prompt, decode one at a time), the pieces are the whole.
    e = _entry(before, grid, after)
    total = e.prompt.shape[1] + generated
    bounds = sorted({0, total, *(c % (total + 1) for c in cuts)})
    pieces = [request_positions(e, a, b) for a, b in itertools.pairwise(bounds)]
    whole = request_positions(e, 0, total)
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole)
    np.testing.assert_array_equal(whole[:, : e.prompt.shape[1]], e.prompt)
    tail = whole[:, e.prompt.shape[1] :]
    assert (tail == tail[0]).all()  # generated tokens: one value in every channel
    if generated and e.prompt.shape[1]:
        assert tail[0, 0] == e.prompt.max() + 1  # continues after the prompt


class _Feature:
    def __init__(self, modality: str) -> None:
        self.modality = modality


class _Model:
    """Answers like ``SupportsMRoPE.get_mrope_input_positions``."""

    def __init__(self, positions: np.ndarray, delta: int) -> None:
        self.positions, self.delta = positions, delta
        self.seen: list[str] = []

    def get_mrope_input_positions(self, tokens, features):
        self.seen = [f.modality for f in features]
        import torch

        return torch.from_numpy(self.positions), self.delta


def test_compute_mrope_uses_the_model_and_checks_the_shape() -> None:
    model = _Model(np.zeros((3, 4), np.int64), -2)
    got = compute_mrope(
        model, [1, 2, 3, 4], [_Feature("image"), _Feature("prompt_embeds")]
    )
    assert got.delta == -2 and got.prompt.shape == (3, 4)
    assert model.seen == ["image"]  # passthrough embeddings are text positions
    with pytest.raises(ValueError, match=r"expected \[channels, 5\]"):
        compute_mrope(model, [1, 2, 3, 4, 5], [])
