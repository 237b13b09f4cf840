"""The bfloat16 comparison with HF: spacing of bfloat16 numbers, near-ties."""

from __future__ import annotations

import pytest
import torch

from tests.hf_reference import BF16_TIE_SPACINGS, bf16_spacing, compare_greedy_bf16


@pytest.mark.parametrize(
    ("x", "spacing"),
    [
        (16.0, 0.125),
        (31.9, 0.125),
        (-20.0, 0.125),
        (1.0, 2.0**-7),
        (5.0, 2.0**-5),
        (0.01, 2.0**-14),  # small logits of the tiny random models
        (0.0, 2.0**-133),
        (1e-40, 2.0**-133),  # subnormal: fixed spacing
    ],
)
def test_spacing_matches_bfloat16(x: float, spacing: float) -> None:
    assert bf16_spacing(x) == spacing


@pytest.mark.parametrize("x", [0.0123, 0.7, 3.3, 18.5, 300.0, -42.0])
def test_spacing_is_the_gap_to_the_next_bfloat16(x: float) -> None:
    # (Not powers of two, where the gaps below and above differ.)
    v = torch.tensor(x, dtype=torch.bfloat16)
    away = torch.tensor(float("inf") if x > 0 else float("-inf"), dtype=torch.bfloat16)
    assert abs(float(torch.nextafter(v, away) - v)) == bf16_spacing(float(v))


def _logits(rows: list[dict[int, float]], vocab: int = 8) -> torch.Tensor:
    out = torch.full((len(rows), vocab), -10.0)
    for i, row in enumerate(rows):
        for tok, val in row.items():
            out[i, tok] = val
    return out


def test_identical_sequences_match() -> None:
    logits = _logits([{1: 20.0, 2: 18.0}, {3: 20.0, 4: 19.0}])
    m = compare_greedy_bf16([1, 3], [1, 3], logits)
    assert m.ties == 0 and not m.needed_tolerance


def test_parting_at_a_near_tie_stops_the_comparison() -> None:
    # Step 1: 20.0 vs 19.875 is one spacing (0.125): a near-tie; after it the
    # tokens differ freely.
    logits = _logits([{1: 20.0}, {3: 20.0, 4: 19.875}, {5: 30.0}])
    m = compare_greedy_bf16([1, 4, 7], [1, 3, 5], logits)
    assert m.needed_tolerance and m.differs_at == 1 and m.margin_spacings == 1.0


def test_a_near_tie_where_both_agree_keeps_comparing() -> None:
    logits = _logits([{3: 20.0, 4: 19.875}, {5: 30.0, 6: 10.0}])
    with pytest.raises(AssertionError, match="step 1"):
        compare_greedy_bf16([3, 6], [3, 5], logits)


def test_difference_beyond_the_tolerance_fails() -> None:
    # 20.0 vs 19.5 is 4 spacings: not a near-tie.
    assert BF16_TIE_SPACINGS < 4
    logits = _logits([{3: 20.0, 4: 19.5}])
    with pytest.raises(AssertionError, match="not a near-tie"):
        compare_greedy_bf16([4], [3], logits)


def test_at_a_near_tie_the_token_must_be_one_of_the_tied() -> None:
    logits = _logits([{3: 20.0, 4: 19.875, 5: 12.0}])
    with pytest.raises(AssertionError, match="near-tie"):
        compare_greedy_bf16([5], [3], logits)


def test_small_logits_are_judged_in_their_own_spacing() -> None:
    # Around 0.01 the spacing is 2**-14: a margin of 0.001 is 16 spacings.
    logits = _logits([{3: 0.0101, 4: 0.0091}])
    with pytest.raises(AssertionError, match="not a near-tie"):
        compare_greedy_bf16([4], [3], logits)
