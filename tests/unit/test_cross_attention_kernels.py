"""Cross-attention kernels against a naive per-token, per-head loop in float64.

The reference walks every (token, query head), maps the query head to its KV
head (``h // (H / Hkv)``), gathers the rows of the tiles the token reads from
each of its image slots and takes a plain softmax. Rows that read nothing are
only required to stay finite (the caller discards them).
"""

from __future__ import annotations

import pytest
import torch

from tests.stacked_cross import cross_attention_decode, cross_attention_prefill

TILES, PATCHES, D = 4, 3, 8
ROWS = TILES * PATCHES


def _cache(slots: int, hkv: int, gen: torch.Generator, dtype=torch.float32):
    return torch.randn(2, slots, ROWS, hkv, D, generator=gen).to(dtype)


def reference(
    query: torch.Tensor,  # [Q, H, D]
    cache: torch.Tensor,  # [2, S, rows, Hkv, D]
    slots: torch.Tensor,  # [Q, M]: the slots each token reads
    tile_mask: torch.Tensor,  # [Q, M, tiles]
    scale: float,
) -> torch.Tensor:
    q64, c64 = query.double(), cache.double()
    num_q, h = query.shape[:2]
    group = h // cache.shape[3]
    out = torch.zeros(num_q, h, D, dtype=torch.float64)
    for t in range(num_q):
        for head in range(h):
            kvh = head // group
            keys, values = [], []
            for m, slot in enumerate(slots[t].tolist()):
                for tile in range(TILES):
                    if tile_mask[t, m, tile]:
                        rows = slice(tile * PATCHES, (tile + 1) * PATCHES)
                        keys.append(c64[0, slot, rows, kvh])
                        values.append(c64[1, slot, rows, kvh])
            if not keys:
                continue
            k, v = torch.cat(keys), torch.cat(values)
            probs = torch.softmax(k @ q64[t, head] * scale, dim=0)
            out[t, head] = probs @ v
    return out


def _random_mask(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(shape, generator=gen) < 0.6
    mask[..., 0, 0] = True  # every token reads something (all-masked: own test)
    return mask


HEADS = [(4, 2), (4, 1), (4, 4), (8, 2)]


@pytest.mark.parametrize(("h", "hkv"), HEADS)
def test_decode_matches_reference(h: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(h * 10 + hkv)
    b, m, s = 5, 3, 7
    cache = _cache(s, hkv, gen)
    query = torch.randn(b, h, D, generator=gen)
    slots = torch.randint(0, s, (b, m), generator=gen)
    slots[0] = torch.tensor([2, 2, 5])  # one slot read twice by a token
    mask = _random_mask((b, m, TILES), gen)
    scale = D**-0.5
    got = cross_attention_decode(query, cache, slots, mask, scale)
    assert got.shape == (b, h, D) and got.dtype == query.dtype
    want = reference(query, cache, slots, mask, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("h", "hkv"), HEADS)
def test_prefill_matches_reference(h: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(100 + h * 10 + hkv)
    t, n, s = 9, 4, 6
    cache = _cache(s, hkv, gen)
    query = torch.randn(t, h, D, generator=gen)
    slots = torch.tensor([3, 1, 4, 0])  # the last is a padding column (null slot)
    mask = _random_mask((t, n, TILES), gen)
    mask[:, 3] = False  # no token reads the padding column
    # Two "requests": tokens 0..4 read columns 0-1, tokens 5..8 read column 2.
    mask[:5, 2] = False
    mask[5:, :2] = False
    mask[5:, 2, 0] = True
    scale = 0.37
    got = cross_attention_prefill(query, cache, slots, mask, scale)
    assert got.shape == (t, h, D) and got.dtype == query.dtype
    want = reference(query, cache, slots.expand(t, n), mask, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bfloat16_cache_is_close_to_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    b, m, s, h, hkv = 3, 2, 4, 4, 2
    cache = _cache(s, hkv, gen, torch.bfloat16)
    query = torch.randn(b, h, D, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([[1, 2], [3, 0], [2, 2]])
    mask = _random_mask((b, m, TILES), gen)
    got = cross_attention_decode(query, cache, slots, mask, D**-0.5)
    assert got.dtype == torch.bfloat16
    want = reference(query, cache, slots, mask, D**-0.5)
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(("h", "hkv"), [(4, 2), (8, 2), (6, 3)])
def test_gqa_query_head_reads_kv_head_h_over_group(h: int, hkv: int) -> None:
    """Every value of KV head j is j: query head h must return h // (H / Hkv)."""
    cache = torch.zeros(2, 3, ROWS, hkv, D)
    cache[0] = torch.randn(3, ROWS, hkv, D)
    cache[1] = torch.arange(hkv, dtype=torch.float32).view(1, 1, hkv, 1)
    query = torch.randn(2, h, D)
    mask = torch.ones(2, 2, TILES, dtype=torch.bool)
    want = (torch.arange(h) // (h // hkv)).float().view(1, h, 1).expand(2, h, D)
    dec = cross_attention_decode(
        query, cache, torch.tensor([[1, 2], [2, 1]]), mask, 1.0
    )
    torch.testing.assert_close(dec, want)
    pre = cross_attention_prefill(query, cache, torch.tensor([1, 2]), mask, 1.0)
    torch.testing.assert_close(pre, want)


def test_masked_tiles_are_ignored() -> None:
    """Changing what masked tiles (and unread slots) hold changes nothing."""
    gen = torch.Generator().manual_seed(3)
    h, hkv, s = 4, 2, 5
    cache = _cache(s, hkv, gen)
    query = torch.randn(4, h, D, generator=gen)
    dec_slots = torch.tensor([[1, 2], [3, 1], [2, 0], [4, 4]])
    dec_mask = torch.zeros(4, 2, TILES, dtype=torch.bool)
    dec_mask[0, 0, :2] = True  # slot 1 tiles 0-1
    dec_mask[1, 1, :2] = True  # slot 1 tiles 0-1
    dec_mask[2, 0, :2] = True  # slot 2 tiles 0-1
    dec_mask[3, 1, 0] = True  # slot 4 tile 0
    pre_slots = torch.tensor([1, 2])
    pre_mask = torch.zeros(4, 2, TILES, dtype=torch.bool)
    pre_mask[:2, 0, :2] = True
    pre_mask[2:, 1, :2] = True
    pre_mask[3, 1, 0] = True
    before_dec = cross_attention_decode(query, cache, dec_slots, dec_mask, 0.5)
    before_pre = cross_attention_prefill(query, cache, pre_slots, pre_mask, 0.5)
    # Rows of tiles 2-3 of every slot, tile 1 of slot 4, and slots 0 and 3 are
    # never read: fill them with large garbage.
    junk = cache.clone()
    junk[:, :, 2 * PATCHES :] = 1e4 * torch.randn(
        2, s, 2 * PATCHES, hkv, D, generator=gen
    )
    junk[:, 4, PATCHES : 2 * PATCHES] = -3e4
    junk[:, 0] = 5e4
    junk[:, 3] = -5e4
    after_dec = cross_attention_decode(query, junk, dec_slots, dec_mask, 0.5)
    after_pre = cross_attention_prefill(query, junk, pre_slots, pre_mask, 0.5)
    torch.testing.assert_close(after_dec, before_dec, atol=0, rtol=0)
    torch.testing.assert_close(after_pre, before_pre, atol=0, rtol=0)
    # And the garbage really is where the unmasked tiles would read it.
    dec_mask[0, 0, 2] = True
    assert not torch.allclose(
        cross_attention_decode(query, junk, dec_slots, dec_mask, 0.5)[0], before_dec[0]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_masked_rows_stay_finite(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    h, hkv = 4, 2
    cache = _cache(4, hkv, gen, dtype) * 50
    query = (torch.randn(3, h, D, generator=gen) * 50).to(dtype)
    dec_mask = torch.zeros(3, 2, TILES, dtype=torch.bool)
    dec_mask[1, 0, 1] = True  # one live row between two dead ones
    dec = cross_attention_decode(
        query, cache, torch.zeros(3, 2, dtype=torch.long), dec_mask, 1.0
    )
    assert torch.isfinite(dec).all()
    pre_mask = torch.zeros(3, 2, TILES, dtype=torch.bool)
    pre = cross_attention_prefill(query, cache, torch.tensor([1, 0]), pre_mask, 1.0)
    assert torch.isfinite(pre).all()
    # The live row is unaffected by its dead neighbours.
    want = reference(
        query[1:2], cache, torch.zeros(1, 2, dtype=torch.long), dec_mask[1:2], 1.0
    )
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(dec[1:2].double(), want, atol=tol * 50, rtol=tol)
