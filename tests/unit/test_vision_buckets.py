"""Patch buckets of a dynamic-resolution vision tower (``worker.vision_buckets``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hpu_mm.worker.vision_buckets import group_items, padding_grid, patch_buckets


def test_buckets_double_from_four_merged_tokens_to_the_budget() -> None:
    assert patch_buckets(256, 4) == (16, 32, 64, 128, 256)
    assert patch_buckets(100, 4) == (16, 32, 64, 100)
    assert patch_buckets(2, 4) == (4,)  # at least one merged token
    assert patch_buckets(1001, 4)[-1] == 1004  # rounded up to whole tokens
    assert patch_buckets(256, 4, min_patches=30) == (32, 64, 128, 256)
    # A bucket file's list, in whole merged tokens, whatever the budget.
    assert patch_buckets(256, 4, explicit=[100, 10, 1000, 12]) == (12, 100, 1000)


@given(real=st.integers(0, 64), extra=st.integers(0, 64), merge=st.sampled_from([1, 2]))
def test_padding_grid_fills_the_bucket_with_whole_merged_tokens(
    real, extra, merge
) -> None:
    unit = merge * merge
    n, bucket = real * unit, (real + extra) * unit
    grid = padding_grid(n, bucket, merge)
    if extra == 0:
        assert grid is None
        return
    assert grid is not None
    t, h, w = grid
    assert t == 1 and h % merge == 0 and w % merge == 0  # a valid image grid
    assert n + t * h * w == bucket


def test_padding_grid_refuses_what_no_image_can_fill() -> None:
    with pytest.raises(ValueError, match="multiples of 4"):
        padding_grid(16, 18, 2)
    with pytest.raises(ValueError, match="16 <= 12"):
        padding_grid(16, 12, 2)


@given(patches=st.lists(st.integers(1, 50), max_size=8), limit=st.integers(1, 64))
def test_groups_keep_order_and_fit(patches, limit) -> None:
    runs = group_items(patches, limit)
    assert [i for run in runs for i in run] == list(range(len(patches)))
    for run in runs:
        total = sum(patches[i] for i in run)
        assert total <= limit or len(run) == 1  # only a lone item may overflow
    # Greedy: the next run's first item would not have fitted the run before.
    for a, b in itertools.pairwise(runs):
        assert sum(patches[i] for i in a) + patches[b[0]] > limit
