"""LoRA without an engine: the step's adapter mapping in the padded row layout
(``worker.lora``) and the static-shape punica ops (``lora.punica``) against a
per-token reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hpu_mm.lora.punica import NO_SLOT, PunicaWrapperHPUMM, masked_lora, slots_of
from vllm_hpu_mm.worker.lora import step_lora_ids

# ---- the step mapping -------------------------------------------------------------


def test_step_ids_follow_padded_rows() -> None:
    # Two decodes (rows 0, 1), padding row 2, a prefill at rows 4..6, padding to 8.
    tokens, logits = step_lora_ids(
        [3, 0, 7], np.array([0, 1, 4]), np.array([1, 1, 3]), 8, 4
    )
    assert tokens.tolist() == [3, 0, 0, 0, 7, 7, 7, 0]
    assert logits.tolist() == [3, 0, 7, 0]  # the batch bucket's padding: none


def test_step_ids_refuse_rows_past_the_step() -> None:
    with pytest.raises(ValueError, match=r"rows \[6, 9\) past the step's 8 rows"):
        step_lora_ids([1], np.array([6]), np.array([3]), 8, 1)
    with pytest.raises(ValueError, match="2 requests, 1 logits rows"):
        step_lora_ids([1, 2], np.array([0, 1]), np.array([1, 1]), 2, 1)


def test_slots_of_maps_ids_to_slots() -> None:
    assert slots_of([0, 5, 9, 5], [9, None, 5]).tolist() == [NO_SLOT, 2, 0, 2]
    with pytest.raises(KeyError, match="LoRA id 4 is in no slot"):
        slots_of([4], [9, None, 5])


# ---- the ops --------------------------------------------------------------------


def _reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]):
    rows = []
    for t, s in enumerate(slots):
        rows.append(torch.zeros(b.shape[2]) if s < 0 else x[t] @ a[s, 0].T @ b[s, 0].T)
    return torch.stack(rows)


def test_masked_lora_matches_per_token_products() -> None:
    gen = torch.Generator().manual_seed(0)
    num_slots, rank, width, out = 3, 4, 10, 6
    a = torch.randn(num_slots, 1, rank, width, generator=gen)
    b = torch.randn(num_slots, 1, out, rank, generator=gen)
    x = torch.randn(7, width, generator=gen)
    slots = [0, 2, -1, 1, 1, -1, 0]
    got = masked_lora(x, a, b, torch.tensor(slots))
    torch.testing.assert_close(got, _reference(x, a, b, slots))
    assert got[2].abs().max() == 0 and got[5].abs().max() == 0  # base rows: exact 0


def _mapping(tokens: list[int], prompts: list[int]) -> SimpleNamespace:
    return SimpleNamespace(index_mapping=tuple(tokens), prompt_mapping=tuple(prompts))


def test_wrapper_selects_each_pass_rows() -> None:
    """A two-pass step: each pass's rows come to the front of the buffers and
    the ops read as many as the pass's input has."""
    wrapper = PunicaWrapperHPUMM(16, 4, "cpu")
    # LoRA ids 11 and 12 in slots 1 and 0; rows 0-1 decode, 2-5 a prefill.
    wrapper.update_metadata(
        _mapping([11, 0, 12, 12, 12, 0], [11, 0, 12, 0]), [12, 11], 3, 100
    )
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(2, 1, 4, 8, generator=gen)
    b = torch.randn(2, 1, 5, 4, generator=gen)
    for start, stop in ((0, 2), (2, 6)):
        wrapper.select_rows(start, stop)
        x = torch.randn(stop - start, 8, generator=gen)
        y = torch.ones(stop - start, 5)
        wrapper.add_lora_linear(y, x, (a,), (b,), 1.0, (5,))
        slots = [1, -1, 0, 0, 0, -1][start:stop]
        torch.testing.assert_close(y, 1 + _reference(x, a, b, slots))
    assert wrapper._embeddings_indices[:4].tolist() == [0, 0, 0, 0]  # slot 0, none
    logits_x = torch.randn(4, 8, generator=gen)
    y = torch.zeros(4, 5)
    wrapper.add_lora_logits(y, logits_x, a, b, 1.0)
    torch.testing.assert_close(y, _reference(logits_x, a, b, [1, -1, 0, -1]))


def test_merged_slices_and_scale() -> None:
    """A merged QKV projection (three output slices of one layer, as vLLM's
    ``MergedQKVParallelLinearWithLoRA`` passes them) with a scale: each slice
    gets its own A and B under each token's slot."""
    wrapper = PunicaWrapperHPUMM(8, 2, "cpu")
    gen = torch.Generator().manual_seed(2)
    a = tuple(torch.randn(2, 1, 4, 6, generator=gen) for _ in range(3))
    b = tuple(torch.randn(2, 1, n, 4, generator=gen) for n in (4, 2, 2))
    wrapper.update_metadata(_mapping([5, 0, 6], [5, 0, 6]), [5, 6], 3, 10)
    x = torch.randn(3, 6, generator=gen)
    y = torch.zeros(3, 8)
    wrapper.add_lora_linear(y, x, a, b, 0.5, (4, 2, 2))
    want = torch.cat(
        [0.5 * _reference(x, ai, bi, [0, -1, 1]) for ai, bi in zip(a, b, strict=True)],
        dim=1,
    )
    torch.testing.assert_close(y, want)
