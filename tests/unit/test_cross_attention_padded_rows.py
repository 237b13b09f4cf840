"""Cross-attention over a cache that keeps the encoder's padding rows per tile.

The cache holds ``padded`` rows per tile (the encoder's layout, so nothing is
copied between the encoder and the cache), of which the kernels read only the
first ``patches``: the result equals the kernels on a cache with the padding rows
cut out, whatever the padding rows hold.
"""

from __future__ import annotations

import pytest
import torch

from tests.stacked_cross import cross_attention_decode, cross_attention_prefill

TILES, PATCHES, PADDED, H, HKV, D = 4, 5, 8, 4, 2, 8


def _caches(slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded cache with junk padding rows, the same cache without them)."""
    padded = torch.randn(2, slots, TILES, PADDED, HKV, D, generator=gen)
    padded[:, :, :, PATCHES:] = 1e4  # would dominate every softmax if read
    cut = padded[:, :, :, :PATCHES].reshape(2, slots, TILES * PATCHES, HKV, D)
    return padded.reshape(2, slots, TILES * PADDED, HKV, D), cut


@pytest.mark.parametrize("everything", [False, True])
def test_padding_rows_are_never_read(everything: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    padded, cut = _caches(6, gen)
    b, m, t, n = 3, 2, 5, 3
    dec_slots = torch.randint(1, 6, (b, m), generator=gen)
    pre_slots = torch.tensor([1, 4, 5])
    dec_mask = torch.rand(b, m, TILES, generator=gen) < 0.6
    pre_mask = torch.rand(t, n, TILES, generator=gen) < 0.6
    dec_mask[..., 0, 0] = pre_mask[..., 0, 0] = True
    if everything:  # tokens before the first image: every tile of every image
        dec_mask[:], pre_mask[:] = True, True
    q_dec = torch.randn(b, H, D, generator=gen)
    q_pre = torch.randn(t, H, D, generator=gen)
    got = cross_attention_decode(q_dec, padded, dec_slots, dec_mask, 0.3, PATCHES)
    want = cross_attention_decode(q_dec, cut, dec_slots, dec_mask, 0.3)
    torch.testing.assert_close(got, want)
    got = cross_attention_prefill(q_pre, padded, pre_slots, pre_mask, 0.3, PATCHES)
    want = cross_attention_prefill(q_pre, cut, pre_slots, pre_mask, 0.3)
    torch.testing.assert_close(got, want)
    # Without ``patches`` the junk rows are read, and the result differs.
    junk = cross_attention_prefill(q_pre, padded, pre_slots, pre_mask, 0.3)
    assert not torch.allclose(junk, want)
