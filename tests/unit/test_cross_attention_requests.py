"""Per-request prefill cross-attention (``cross_attention_requests``) and the
host-side rows it reads (``cross_request``) against a float64 loop and against
the flat static-shape kernel, over random steps of several requests.

A step packs prefill requests one after the other (some chunks start past the
prompt's beginning), each with its own images (consecutive groups, partial tiles,
rows before the first image); rows past the last request are padding. The cache
keeps the encoder's padding rows per tile, set to a value that would dominate
every softmax if read.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stacked_cross import (
    cross_attention_prefill,
    cross_attention_requests,
)
from vllm_hpu_mm.worker.cross_attention import RequestImage, cross_request, tile_mask

TILES, PATCHES, PADDED, D = 4, 3, 5, 8
ROWS = TILES * PADDED
CPU = torch.device("cpu")


def _cache(slots: int, hkv: int, gen: torch.Generator) -> torch.Tensor:
    cache = torch.randn(2, slots, TILES, PADDED, hkv, D, generator=gen)
    cache[:, :, :, PATCHES:] = 1e4  # padding rows: never read
    return cache.reshape(2, slots, ROWS, hkv, D)


def _step(seed: int, num_requests: int, pad: int):
    """(requests as (images, slots, positions), [rows, images, tiles] masks)."""
    rng = np.random.default_rng(seed)
    reqs, next_slot = [], 1
    for _ in range(num_requests):
        n = int(rng.integers(1, 4))
        offsets = sorted(rng.choice(np.arange(1, 12), n, replace=False).tolist())
        images = [
            RequestImage(key=f"k{next_slot + i}", offset=o, num_tiles=int(t))
            for i, (o, t) in enumerate(
                zip(offsets, rng.integers(1, TILES + 1, n), strict=True)
            )
        ]
        slots = list(range(next_slot, next_slot + n))
        next_slot += n
        start = int(rng.integers(0, 8))  # tokens computed before this chunk
        positions = start + np.arange(int(rng.integers(1, 10)))
        reqs.append((images, slots, positions))
    masks = [tile_mask(images, pos, TILES)[0] for images, _, pos in reqs]
    rows = sum(len(p) for _, _, p in reqs) + pad
    return reqs, masks, rows, next_slot


def _reference(query, cache, reqs, masks, scale):
    """Loop over (request, row, head) in float64; padding rows stay zero."""
    t, h, _ = query.shape
    group = h // cache.shape[3]
    c64 = cache.double().reshape(2, -1, TILES, PADDED, cache.shape[3], D)
    out = torch.zeros(t, h, D, dtype=torch.float64)
    row = 0
    for (_, slots, positions), mask in zip(reqs, masks, strict=True):
        for i in range(len(positions)):
            for head in range(h):
                keys, values = [], []
                for m, slot in enumerate(slots):
                    for tile in range(TILES):
                        if mask[i, m, tile]:
                            keys.append(c64[0, slot, tile, :PATCHES, head // group])
                            values.append(c64[1, slot, tile, :PATCHES, head // group])
                k, v = torch.cat(keys), torch.cat(values)
                probs = torch.softmax(k @ query[row + i, head].double() * scale, 0)
                out[row + i, head] = probs @ v
        row += len(positions)
    return out


def _requests(reqs, masks):
    out, row = [], 0
    for (_, slots, positions), mask in zip(reqs, masks, strict=True):
        out.append(cross_request(row, slots, mask, ROWS, PATCHES, CPU))
        row += len(positions)
    return out


def _flat(query, cache, reqs, masks, scale):
    """The same step through the flat kernel: every row over every image."""
    cols = [s for _, slots, _ in reqs for s in slots]
    flat_mask = np.zeros((query.shape[0], len(cols), TILES), bool)
    row = col = 0
    for (_, slots, positions), mask in zip(reqs, masks, strict=True):
        flat_mask[row : row + len(positions), col : col + len(slots)] = mask
        row, col = row + len(positions), col + len(slots)
    return cross_attention_prefill(
        query, cache, torch.tensor(cols), torch.from_numpy(flat_mask), scale, PATCHES
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_requests=st.integers(1, 4),
    pad=st.integers(0, 3),
    heads=st.sampled_from([(4, 2), (4, 1), (4, 4), (8, 2)]),
)
def test_matches_reference_and_flat_kernel(seed, num_requests, pad, heads) -> None:
    h, hkv = heads
    reqs, masks, rows, num_slots = _step(seed, num_requests, pad)
    gen = torch.Generator().manual_seed(seed)
    cache = _cache(num_slots, hkv, gen)
    query = torch.randn(rows, h, D, generator=gen)
    scale = 0.41
    got = cross_attention_requests(query, cache, _requests(reqs, masks), scale)
    assert got.shape == query.shape and got.dtype == query.dtype
    want = _reference(query, cache, reqs, masks, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    real = rows - pad  # the flat kernel's padding rows are only finite
    flat = _flat(query, cache, reqs, masks, scale)
    torch.testing.assert_close(got[:real], flat[:real])
    if pad:
        assert not got[real:].any()


def test_key_rows_and_mask() -> None:
    """Every tile's real rows of each image, image-major; no mask where every
    row reads every key; a mask that widens the tile mask to rows otherwise."""
    full = np.ones((2, 1, TILES), bool)
    r = cross_request(3, [2], full, ROWS, PATCHES, CPU)
    assert (r.start, r.length, r.mask) == (3, 2, None)
    want = [2 * ROWS + t * PADDED + p for t in range(TILES) for p in range(PATCHES)]
    assert r.key_rows.tolist() == want
    two = np.ones((2, 2, TILES), bool)
    two[1, 0] = False  # row 1 reads only the second image
    two[:, 1, 3] = False  # whose last tile is padding
    r = cross_request(0, [5, 1], two, ROWS, PATCHES, CPU)
    assert r.key_rows.tolist()[: TILES * PATCHES] == [
        5 * ROWS + t * PADDED + p for t in range(TILES) for p in range(PATCHES)
    ]
    assert r.mask is not None and r.mask.shape == (2, 2 * TILES * PATCHES)
    np.testing.assert_array_equal(
        r.mask.numpy(), np.repeat(two.reshape(2, -1), PATCHES, axis=1)
    )


def test_rows_before_the_first_image_read_every_tile() -> None:
    """A chunk of rows before the request's image (masked-out rows) reads every
    tile, padding tiles included, as transformers does; rows after read only
    the image's real tiles."""
    images = [RequestImage(key="a", offset=4, num_tiles=1)]
    mask, masked_out = tile_mask(images, np.arange(2, 7), TILES)
    assert masked_out.tolist() == [True, True, False, False, False]
    r = cross_request(0, [1], mask, ROWS, PATCHES, CPU)
    assert r.mask is not None
    assert r.mask[:2].all() and r.mask[2:, :PATCHES].all()
    assert not r.mask[2:, PATCHES:].any()


def test_bfloat16_is_close_to_reference() -> None:
    reqs, masks, rows, num_slots = _step(11, 3, 1)
    gen = torch.Generator().manual_seed(3)
    cache = _cache(num_slots, 2, gen).to(torch.bfloat16)
    query = torch.randn(rows, 4, D, generator=gen).to(torch.bfloat16)
    got = cross_attention_requests(query, cache, _requests(reqs, masks), 0.35)
    assert got.dtype == torch.bfloat16
    want = _reference(query, cache, reqs, masks, 0.35)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("empty", [True, False])
def test_no_requests_gives_zeros(empty: bool) -> None:
    query = torch.randn(4, 4, D)
    cache = _cache(2, 2, torch.Generator().manual_seed(0))
    reqs = (
        []
        if empty
        else [cross_request(0, [1], np.ones((1, 1, TILES), bool), ROWS, PATCHES, CPU)]
    )
    got = cross_attention_requests(query, cache, reqs, 0.3)
    assert not got[1:].any()
    assert got[0].any() != empty
