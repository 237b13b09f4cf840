"""The pure-PyTorch paged-attention kernels against a per-request reference.

The reference never reads the paged cache: each request owns its keys and values
as plain ``[seq_len, Hkv, D]`` tensors (position order), and attention is a
Python loop over queries in float64 with GQA done by repeating the kv heads.
The kernels, in turn, only see the paged cache (through the inputs the
metadata module builds once per step), so a wrong slot, block, tile, mask or
head mapping shows up as a numerical mismatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stacked_kv import (
    batched_decode_attention,
    causal_prefill_attention,
    decode_attention,
    prefill_attention,
    request_prefill_attention,
    write_kv,
)
from vllm_hpu_mm.attention.layout import (
    batched_decode_table,
    causal_blocks,
    flat_decode,
    prefill_context_blocks,
    prefill_tiles,
)
from vllm_hpu_mm.attention.metadata import build_prefill_requests

HEAD = 8
ATOL = 1e-5
RTOL = 1e-5
HEADS = [(4, 2), (4, 1), (4, 4)]  # (H, Hkv): GQA, MQA, MHA
HEAD_IDS = ["gqa", "mqa", "mha"]


# ----------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------


def visible(key_pos: int, query_pos: int, window: int | None) -> bool:
    """Causal + optional sliding window, as in vLLM (window includes the query)."""
    return key_pos <= query_pos and (window is None or key_pos > query_pos - window)


def reference_attention(
    query: torch.Tensor,  # [Tq, H, D]
    keys: torch.Tensor,  # [L, Hkv, D], position order
    values: torch.Tensor,  # [L, Hkv, D]
    positions: list[int],  # [Tq] absolute position of each query
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Softmax attention of one request in float64; returns [Tq, H, D]."""
    num_heads = query.shape[1]
    group = num_heads // keys.shape[1]
    k_rep = keys.double().repeat_interleave(group, dim=1)  # [L, H, D]
    v_rep = values.double().repeat_interleave(group, dim=1)
    out = torch.empty(query.shape, dtype=torch.float64)
    for t, q_pos in enumerate(positions):
        idx = [k for k in range(keys.shape[0]) if visible(k, q_pos, window)]
        assert idx, "a query always sees itself"
        for h in range(num_heads):
            scores = (k_rep[idx, h] @ query[t, h].double()) * scale
            weights = torch.softmax(scores, dim=0)
            out[t, h] = weights @ v_rep[idx, h]
    return out


# ----------------------------------------------------------------------------
# Scenario: requests, their true K/V and a paged cache holding them
# ----------------------------------------------------------------------------


@dataclass
class Req:
    prior: int  # positions already in the cache
    query_len: int  # tokens of this step
    block_ids: list[int]
    keys: torch.Tensor  # [seq_len, Hkv, D]
    values: torch.Tensor
    queries: torch.Tensor  # [query_len, H, D]

    @property
    def seq_len(self) -> int:
        return self.prior + self.query_len

    @property
    def positions(self) -> list[int]:
        return list(range(self.prior, self.seq_len))

    def slot(self, pos: int, block_size: int) -> int:
        return self.block_ids[pos // block_size] * block_size + pos % block_size


def make_scenario(
    specs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, list[Req]]:
    """A garbage-filled cache with each request's prior context written in.

    specs: (prior, query_len) per request. Blocks are random, non-contiguous and
    never block 0. The current tokens' K/V are *not* written (``write_kv``).
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil((p + q) / block_size) for p, q in specs]
    num_blocks = 1 + sum(needed) + 7  # spare blocks stay garbage
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD, generator=gen)
    cache = cache.to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    reqs = []
    for (prior, qlen), n in zip(specs, needed, strict=True):
        ids, perm = perm[:n], perm[n:]
        seq = prior + qlen
        req = Req(
            prior=prior,
            query_len=qlen,
            block_ids=ids,
            keys=torch.randn(seq, num_kv_heads, HEAD, generator=gen),
            values=torch.randn(seq, num_kv_heads, HEAD, generator=gen),
            queries=torch.randn(qlen, num_heads, HEAD, generator=gen),
        )
        for pos in range(prior):
            b, off = ids[pos // block_size], pos % block_size
            cache[0, b, off] = req.keys[pos]
            cache[1, b, off] = req.values[pos]
        reqs.append(req)
    assert 0 not in [b for r in reqs for b in r.block_ids]
    return cache, reqs


def write_step(cache: torch.Tensor, reqs: list[Req], pad_rows: int = 0) -> None:
    """Write the current tokens' K/V (plus pad_rows padding rows) via write_kv."""
    bs = cache.shape[2]
    slots = [r.slot(p, bs) for r in reqs for p in r.positions] + [0] * pad_rows
    keys = [r.keys[r.prior :] for r in reqs]
    values = [r.values[r.prior :] for r in reqs]
    pad = torch.full((pad_rows, *cache.shape[3:]), 1e3)
    write_kv(
        cache,
        torch.cat([*keys, pad]),
        torch.cat([*values, -pad]),
        torch.tensor(slots, dtype=torch.int64),
    )


def block_table_of(reqs: list[Req]) -> np.ndarray:
    width = max(len(r.block_ids) for r in reqs)
    table = np.zeros((len(reqs), width), np.int64)
    for i, r in enumerate(reqs):
        table[i, : len(r.block_ids)] = r.block_ids
    return table


def prefill_inputs(
    reqs: list[Req],
    block_size: int,
    pad_tokens: int = 0,
    pad_blocks: int = 0,
    tile: int = 128,
) -> dict[str, torch.Tensor]:
    """The prefill tiles of ``reqs``, padded by tokens and blocks per tile."""
    q = np.array([r.query_len for r in reqs], np.int64)
    seq = np.array([r.seq_len for r in reqs], np.int64)
    n_tok = int(q.sum()) + pad_tokens
    n_blk = prefill_context_blocks(q, seq, block_size, tile) + pad_blocks
    tiles = prefill_tiles(q, seq, block_table_of(reqs), block_size, n_tok, n_blk, tile)
    return {
        "tile_blocks": torch.from_numpy(tiles.blocks),
        "tile_mask": torch.from_numpy(tiles.mask),
        "tile_query_pos": torch.from_numpy(tiles.query_pos),
        "tile_key_pos": torch.from_numpy(tiles.key_pos),
    }


def flat_inputs(
    reqs: list[Req], block_size: int, pad_rows: int = 0, pad_blocks: int = 0
) -> dict[str, torch.Tensor]:
    seq = np.array([r.seq_len for r in reqs], np.int64)
    n_blk = int((-(-seq // block_size)).sum()) + pad_blocks
    f = flat_decode(seq, block_table_of(reqs), block_size, len(reqs) + pad_rows, n_blk)
    return {
        "block_list": torch.from_numpy(f.block_list),
        "block_req": torch.from_numpy(f.block_req),
        "block_bias": torch.from_numpy(f.block_bias),
        "block_key_pos": torch.from_numpy(f.block_key_pos),
        "block_mapping": torch.from_numpy(f.block_mapping),
        "seq_lens": torch.tensor([*seq.tolist(), *[0] * pad_rows]),
    }


def reference_for(reqs: list[Req], scale: float, window: int | None) -> torch.Tensor:
    return torch.cat(
        [
            reference_attention(r.queries, r.keys, r.values, r.positions, scale, window)
            for r in reqs
        ]
    )


# (prior context, query tokens): a fresh prompt, chunks with prior context
# (one starting mid-block, one on a block boundary), a one-token chunk and a
# long context.
PREFILL_SPECS = [(0, 7), (13, 6), (5, 1), (16, 4), (30, 9)]


# ----------------------------------------------------------------------------
# write_kv
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 16])
def test_write_kv_writes_exactly_the_given_slots(block_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, hkv = 9, 2
    cache = torch.randn(2, num_blocks, block_size, hkv, HEAD, generator=gen)
    before = cache.clone()
    real = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:11]
    real = real + block_size  # never in block 0
    n_pad = 3
    slots = torch.cat([real, torch.zeros(n_pad, dtype=torch.int64)])
    key = torch.randn(len(slots), hkv, HEAD, generator=gen)
    value = torch.randn(len(slots), hkv, HEAD, generator=gen)

    write_kv(cache, key, value, slots)

    flat = cache.view(2, -1, hkv, HEAD)
    flat_before = before.view(2, -1, hkv, HEAD)
    for row, s in enumerate(real.tolist()):
        assert torch.equal(flat[0, s], key[row])
        assert torch.equal(flat[1, s], value[row])
    # Every other slot outside block 0 is untouched.
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[real] = False
    untouched[:block_size] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])
    # Padding rows only reach slot 0 of the null block.
    assert torch.equal(flat[:, 1:block_size], flat_before[:, 1:block_size])
    pad_keys = key[len(real) :]
    assert any(torch.equal(flat[0, 0], k) for k in pad_keys)


def test_write_kv_casts_to_cache_dtype() -> None:
    cache = torch.zeros(2, 3, 4, 1, HEAD, dtype=torch.bfloat16)
    key = torch.randn(2, 1, HEAD)
    value = torch.randn(2, 1, HEAD)
    write_kv(cache, key, value, torch.tensor([5, 11]))
    assert torch.equal(cache[0, 1, 1], key[0].to(torch.bfloat16))
    assert torch.equal(cache[1, 2, 3], value[1].to(torch.bfloat16))
    assert cache.dtype == torch.bfloat16


def test_write_kv_then_cache_holds_each_requests_sequence() -> None:
    """After write_kv, every position of every request is at its slot."""
    bs = 4
    cache, reqs = make_scenario(PREFILL_SPECS, bs, 4, 2, seed=3)
    write_step(cache, reqs, pad_rows=2)
    for r in reqs:
        for pos in range(r.seq_len):
            b, off = r.block_ids[pos // bs], pos % bs
            assert torch.equal(cache[0, b, off], r.keys[pos])
            assert torch.equal(cache[1, b, off], r.values[pos])


# ----------------------------------------------------------------------------
# prefill_attention (tiles)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("tile", [128, 8, 5])
@pytest.mark.parametrize("window", [None, 5, 11])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_matches_reference(
    block_size: int, num_heads: int, num_kv_heads: int, window: int | None, tile: int
) -> None:
    cache, reqs = make_scenario(PREFILL_SPECS, block_size, num_heads, num_kv_heads)
    write_step(cache, reqs)
    scale = 1 / math.sqrt(HEAD)
    query = torch.cat([r.queries for r in reqs])
    out = prefill_attention(
        query,
        cache,
        **prefill_inputs(reqs, block_size, tile=tile),
        scale=scale,
        sliding_window=window,
    )
    expected = reference_for(reqs, scale, window)
    assert out.shape == query.shape
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window_tile", [128, 8, 3])
@pytest.mark.parametrize("pad_rows", [0, 5])
@pytest.mark.parametrize("window", [None, 5, 11])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_causal_prefill_matches_reference(
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    window: int | None,
    pad_rows: int,
    window_tile: int,
) -> None:
    """One fresh request (``causal`` form): its blocks gathered once, SDPA's
    causal mask; with a window, a banded mask or (rows above ``window_tile + W
    - 1``) row tiles over overlapping key windows; padding rows change
    nothing."""
    cache, reqs = make_scenario([(0, 23)], block_size, num_heads, num_kv_heads)
    write_step(cache, reqs, pad_rows=pad_rows)
    (req,) = reqs
    scale = 1 / math.sqrt(HEAD)
    pad = torch.full((pad_rows, num_heads, HEAD), 7.0)
    query = torch.cat([req.queries, pad])
    blocks = causal_blocks(
        np.array([req.seq_len]), block_table_of(reqs), block_size, query.shape[0]
    )
    out = causal_prefill_attention(
        query,
        cache,
        torch.from_numpy(blocks),
        scale,
        sliding_window=window,
        window_tile=window_tile,
    )
    assert out.shape == query.shape
    assert torch.isfinite(out).all()  # padding rows too
    expected = reference_for(reqs, scale, window)
    torch.testing.assert_close(out[:23].double(), expected, atol=ATOL, rtol=RTOL)


def test_causal_prefill_calls_sdpa_causal_without_a_mask() -> None:
    """The causal form hands the kernel ``is_causal`` (FusedSDPA's prompt form,
    whose kernels skip the masked half) and no mask; a window needs one."""
    cache, reqs = make_scenario([(0, 9)], 4, 4, 2)
    write_step(cache, reqs)
    blocks = torch.from_numpy(causal_blocks(np.array([9]), block_table_of(reqs), 4, 9))
    calls: list[tuple[bool, bool]] = []

    def sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa):  # type: ignore[no-untyped-def]
        calls.append((attn_mask is None, is_causal))
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip

    causal_prefill_attention(reqs[0].queries, cache, blocks, 0.3, sdpa=sdpa)
    causal_prefill_attention(
        reqs[0].queries, cache, blocks, 0.3, sliding_window=3, sdpa=sdpa
    )
    assert calls == [(True, True), (False, False)]


def per_request(
    query: torch.Tensor,
    cache: torch.Tensor,
    reqs: list[Req],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """request_prefill_attention over ``reqs``' rows (query may carry padding
    rows past them), its inputs built as the metadata builds them."""
    q = np.array([r.query_len for r in reqs], np.int64)
    seq = np.array([r.seq_len for r in reqs], np.int64)
    info = build_prefill_requests(q, seq, block_table_of(reqs), torch.device("cpu"))
    n = int(q.sum())
    keys = torch.cat([r.keys[r.prior :] for r in reqs])
    values = torch.cat([r.values[r.prior :] for r in reqs])
    pad = query.shape[0] - n
    keys = torch.cat([keys, torch.full((pad, *keys.shape[1:]), 1e3)])
    values = torch.cat([values, torch.full((pad, *values.shape[1:]), -1e3)])
    return request_prefill_attention(
        query, keys, values, cache, info.rows, info.block_table,
        info.masks_for(window), scale,
    )  # fmt: skip


@pytest.mark.parametrize("window", [None, 5, 11])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_per_request_prefill_matches_reference(
    block_size: int, num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    """Fresh prompts (own K/V, SDPA's causal mask) and chunks with prior
    context (their blocks, a bottom-right mask), with padding rows after."""
    cache, reqs = make_scenario(PREFILL_SPECS, block_size, num_heads, num_kv_heads)
    write_step(cache, reqs)
    scale = 1 / math.sqrt(HEAD)
    query = torch.cat([*(r.queries for r in reqs), torch.randn(3, num_heads, HEAD)])
    out = per_request(query, cache, reqs, scale, window)
    n = sum(r.query_len for r in reqs)
    torch.testing.assert_close(
        out[:n].double(), reference_for(reqs, scale, window), atol=ATOL, rtol=RTOL
    )
    assert (out[n:] == 0).all()


def test_per_request_prefill_masks_only_chunks_with_context() -> None:
    q = np.array([4, 3], np.int64)
    seq = np.array([4, 5], np.int64)  # a fresh prompt; a chunk after 2 tokens
    info = build_prefill_requests(
        q, seq, np.zeros((2, 2), np.int64), torch.device("cpu")
    )
    assert info.rows == ((0, 4, 4), (4, 3, 5))
    assert info.masks_for(None)[0] is None
    mask = info.masks_for(None)[1]
    assert mask is not None
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # A window of 2 keys: built once and kept for the step's other layers.
    fresh, chunk = info.masks_for(2)
    assert fresh is not None and chunk is not None
    assert fresh.int().tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1],
    ]  # fmt: skip
    assert chunk.int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert info.masks_for(2)[1] is chunk


@pytest.mark.parametrize("tile", [128, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_padding_changes_nothing(
    block_size: int, num_heads: int, num_kv_heads: int, window: int | None, tile: int
) -> None:
    scale = 0.3
    cache, reqs = make_scenario(PREFILL_SPECS, block_size, num_heads, num_kv_heads)
    write_step(cache, reqs)
    query = torch.cat([r.queries for r in reqs])
    plain = prefill_attention(
        query,
        cache,
        **prefill_inputs(reqs, block_size, tile=tile),
        scale=scale,
        sliding_window=window,
    )
    # Same step padded with 7 tokens and 3 blocks per tile; padding K/V (huge
    # values) land in the null block, which the padding blocks point at.
    cache_p, reqs_p = make_scenario(PREFILL_SPECS, block_size, num_heads, num_kv_heads)
    n_pad = 7
    write_step(cache_p, reqs_p, pad_rows=n_pad)
    pad_q = torch.randn(n_pad, num_heads, HEAD, generator=torch.Generator())
    query_p = torch.cat([query, pad_q])
    padded = prefill_attention(
        query_p,
        cache_p,
        **prefill_inputs(reqs_p, block_size, n_pad, pad_blocks=3, tile=tile),
        scale=scale,
        sliding_window=window,
    )
    n_real = query.shape[0]
    assert padded.shape == query_p.shape
    torch.testing.assert_close(padded[:n_real], plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        padded[:n_real].double(),
        reference_for(reqs, scale, window),
        atol=ATOL,
        rtol=RTOL,
    )
    assert torch.isfinite(padded[n_real:]).all()


def test_prefill_tokens_never_see_other_requests() -> None:
    """Two requests sharing nothing: changing one's K/V leaves the other alone."""
    bs = 4
    cache, reqs = make_scenario([(3, 5), (6, 4)], bs, 4, 2, seed=7)
    write_step(cache, reqs)
    query = torch.cat([r.queries for r in reqs])
    inputs = prefill_inputs(reqs, bs)
    out1 = prefill_attention(query, cache, **inputs, scale=0.5)
    for b in reqs[1].block_ids:
        cache[:, b] = torch.randn_like(cache[:, b]) * 10
    out2 = prefill_attention(query, cache, **inputs, scale=0.5)
    n0 = reqs[0].query_len
    torch.testing.assert_close(out1[:n0], out2[:n0], atol=0, rtol=0)
    assert not torch.allclose(out1[n0:], out2[n0:])


def test_prefill_tiles_read_only_their_own_requests_context() -> None:
    """Cost follows each request: with 4-row tiles, four 8-token prompts need 2
    blocks per tile, not the 8 blocks of the whole step's context."""
    bs = 4
    q = np.full(4, 8, np.int64)
    assert prefill_context_blocks(q, q, bs, tile=4) == 2  # a tile: blocks 0..1
    assert prefill_context_blocks(q, q, bs, tile=4) < int((q // bs).sum())
    # One tile over the whole step reads every request's blocks.
    assert prefill_context_blocks(q, q, bs, tile=32) == 8


def test_prefill_only_padding_tokens_is_finite() -> None:
    """A chunk whose rows are all padding still yields finite output."""
    bs = 4
    cache, _ = make_scenario([(0, 3)], bs, 4, 2)
    query = torch.randn(6, 4, HEAD)
    empty = np.zeros(0, np.int64)
    tiles = prefill_tiles(empty, empty, np.zeros((0, 1), np.int64), bs, 6, 2)
    out = prefill_attention(
        query,
        cache,
        torch.from_numpy(tiles.blocks),
        torch.from_numpy(tiles.mask),
        torch.from_numpy(tiles.query_pos),
        torch.from_numpy(tiles.key_pos),
        scale=0.5,
        sliding_window=3,
    )
    assert out.shape == query.shape
    assert torch.isfinite(out).all()


def test_prefill_takes_the_sdpa_callable() -> None:
    """The SDPA kernel is a parameter (a device's fused kernel plugs in)."""
    calls = []

    def sdpa(q, k, v, *, attn_mask, is_causal, scale, enable_gqa):  # type: ignore[no-untyped-def]
        assert is_causal is False  # the mask carries causality
        calls.append((tuple(q.shape), tuple(attn_mask.shape), enable_gqa))
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa
        )

    cache, reqs = make_scenario([(0, 6), (5, 3)], 4, 4, 2)
    write_step(cache, reqs)
    query = torch.cat([r.queries for r in reqs])
    prefill_attention(
        query, cache, **prefill_inputs(reqs, 4, tile=4), scale=0.5, sdpa=sdpa
    )
    # 9 rows in 3 tiles of 4; the middle tile reads 2 + 2 blocks (16 keys).
    assert calls == [((3, 4, 4, HEAD), (3, 1, 4, 16), True)]


# ----------------------------------------------------------------------------
# decode: flat and batched
# ----------------------------------------------------------------------------

# Context lengths (including the current token): one token, mid-block, block
# boundary, long ones.
DECODE_SEQ_LENS = [1, 6, 16, 17, 33, 40]


def decode_inputs(
    reqs: list[Req], block_size: int, width: int, pad_rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    seq = np.array([r.seq_len for r in reqs], np.int64)
    table = batched_decode_table(
        seq, block_table_of(reqs), block_size, len(reqs) + pad_rows, width
    )
    return torch.from_numpy(table), torch.tensor([*seq.tolist(), *[0] * pad_rows])


def _decode_scenario(
    block_size: int, num_heads: int, num_kv_heads: int, n_pad: int, seed: int = 5
) -> tuple[torch.Tensor, list[Req], torch.Tensor]:
    specs = [(s - 1, 1) for s in DECODE_SEQ_LENS]
    cache, reqs = make_scenario(specs, block_size, num_heads, num_kv_heads, seed=seed)
    write_step(cache, reqs, pad_rows=n_pad)
    query = torch.cat(
        [r.queries for r in reqs]
        + [torch.randn(n_pad, num_heads, HEAD, generator=torch.Generator())]
    )
    return cache, reqs, query


@pytest.mark.parametrize("window", [None, 5, 11])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_flat_decode_matches_reference(
    block_size: int, num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    n_pad = 3
    cache, reqs, query = _decode_scenario(block_size, num_heads, num_kv_heads, n_pad)
    scale = 1 / math.sqrt(HEAD)
    inputs = flat_inputs(reqs, block_size, pad_rows=n_pad, pad_blocks=5)
    out = decode_attention(query, cache, **inputs, scale=scale, sliding_window=window)
    n_real = len(reqs)
    assert out.shape == query.shape
    expected = reference_for(reqs, scale, window)
    torch.testing.assert_close(out[:n_real].double(), expected, atol=ATOL, rtol=RTOL)
    assert torch.isfinite(out).all()
    # Without padding rows or blocks: the same real rows.
    tight = flat_inputs(reqs, block_size)
    out2 = decode_attention(
        query[:n_real], cache, **tight, scale=scale, sliding_window=window
    )
    torch.testing.assert_close(out2, out[:n_real], atol=1e-6, rtol=1e-6)


def test_flat_decode_list_holds_only_real_blocks() -> None:
    """The flat list's length is the sum of each request's blocks, not
    batch x the longest request's blocks."""
    seq = np.array([1, 6, 16, 17, 33, 40], np.int64)
    table = np.arange(1, 6 * 10 + 1, dtype=np.int64).reshape(6, 10)
    f = flat_decode(seq, table, 4, 8, 40)
    real = int((-(-seq // 4)).sum())
    assert real == 1 + 2 + 4 + 5 + 9 + 10 < 6 * 10
    assert f.block_mapping[:, :real].sum(0).tolist() == [1.0] * real
    assert f.block_mapping[:, real:].sum() == 0  # padding blocks belong to none
    assert (f.block_bias[real:] < -1e29).all()
    assert f.block_list[:real].tolist() == [
        int(table[r, i]) for r, n in enumerate(-(-seq // 4)) for i in range(n)
    ]


@pytest.mark.parametrize("window", [None, 5, 11])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_batched_decode_matches_reference(
    block_size: int, num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    n_pad = 3
    cache, reqs, query = _decode_scenario(block_size, num_heads, num_kv_heads, n_pad)
    width = math.ceil(max(DECODE_SEQ_LENS) / block_size) + 2  # zero columns past end
    table, seq_lens = decode_inputs(reqs, block_size, width, pad_rows=n_pad)
    scale = 1 / math.sqrt(HEAD)
    out = batched_decode_attention(query, cache, table, seq_lens, scale, window)
    n_real = len(reqs)
    torch.testing.assert_close(
        out[:n_real].double(), reference_for(reqs, scale, window), atol=ATOL, rtol=RTOL
    )
    assert torch.isfinite(out[n_real:]).all()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_forms_equal_prefill_for_single_token_queries(
    block_size: int, num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    cache, reqs, query = _decode_scenario(block_size, num_heads, num_kv_heads, 0, 9)
    width = math.ceil(max(DECODE_SEQ_LENS) / block_size) + 1
    table, seq_lens = decode_inputs(reqs, block_size, width)
    batched = batched_decode_attention(query, cache, table, seq_lens, 0.4, window)
    flat = decode_attention(
        query, cache, **flat_inputs(reqs, block_size), scale=0.4, sliding_window=window
    )
    pre = prefill_attention(
        query,
        cache,
        **prefill_inputs(reqs, block_size, tile=2),
        scale=0.4,
        sliding_window=window,
    )
    torch.testing.assert_close(flat, pre, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(batched, pre, atol=1e-6, rtol=1e-6)


def test_decode_reads_through_the_block_list() -> None:
    """Swapping two requests' blocks swaps which context they read."""
    bs = 4
    cache, reqs = make_scenario([(8, 1), (8, 1)], bs, 2, 1, seed=11)
    write_step(cache, reqs)
    query = torch.cat([reqs[0].queries, reqs[0].queries])
    out = decode_attention(query, cache, **flat_inputs(reqs, bs), scale=0.5)
    ref0 = reference_attention(
        reqs[0].queries, reqs[0].keys, reqs[0].values, [8], 0.5, None
    )
    ref1 = reference_attention(
        reqs[0].queries, reqs[1].keys, reqs[1].values, [8], 0.5, None
    )
    torch.testing.assert_close(out[0:1].double(), ref0, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[1:2].double(), ref1, atol=ATOL, rtol=RTOL)


def test_flat_decode_in_bfloat16_stays_close() -> None:
    cache, reqs, query = _decode_scenario(16, 4, 2, 2)
    out = decode_attention(
        query.bfloat16(),
        cache.bfloat16(),
        **flat_inputs(reqs, 16, pad_rows=2, pad_blocks=2),
        scale=0.25,
    )
    assert out.dtype == torch.bfloat16
    expected = reference_for(reqs, 0.25, None)
    torch.testing.assert_close(
        out[: len(reqs)].double(), expected, atol=3e-2, rtol=3e-2
    )


# ----------------------------------------------------------------------------
# Property test: random mixes of decodes, chunks with context, prefix hits
# ----------------------------------------------------------------------------


@st.composite
def step_mix(draw: st.DrawFn) -> dict[str, object]:
    block_size = draw(st.sampled_from([2, 4, 8]))
    heads = draw(st.sampled_from(HEADS))
    n_dec = draw(st.integers(0, 4))
    n_pre = draw(st.integers(0 if n_dec else 1, 4))
    # decodes: context 1..30; prefills: prior context (chunk or prefix hit)
    # 0..25 plus a chunk of 2..12 tokens.
    decodes = [(draw(st.integers(0, 29)), 1) for _ in range(n_dec)]
    prefills = [
        (draw(st.integers(0, 25)), draw(st.integers(2, 12))) for _ in range(n_pre)
    ]
    return {
        "block_size": block_size,
        "heads": heads,
        "decodes": decodes,
        "prefills": prefills,
        "window": draw(st.sampled_from([None, 3, 9])),
        "tile": draw(st.sampled_from([3, 8, 64])),
        "pad_tokens": draw(st.integers(0, 5)),
        "pad_blocks": draw(st.integers(0, 3)),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=60, deadline=None)
@given(step_mix())
def test_random_step_mix_matches_reference(mix: dict) -> None:  # type: ignore[type-arg]
    bs, (h, hkv) = mix["block_size"], mix["heads"]
    window = mix["window"]
    specs = mix["decodes"] + mix["prefills"]
    cache, reqs = make_scenario(specs, bs, h, hkv, seed=mix["seed"])
    write_step(cache, reqs, pad_rows=mix["pad_tokens"])
    dec, pre = reqs[: len(mix["decodes"])], reqs[len(mix["decodes"]) :]
    scale = 0.35
    if dec:
        q = torch.cat([*(r.queries for r in dec), torch.randn(1, h, HEAD)])
        out = decode_attention(
            q,
            cache,
            **flat_inputs(dec, bs, 1, mix["pad_blocks"]),
            scale=scale,
            sliding_window=window,
        )
        torch.testing.assert_close(
            out[: len(dec)].double(),
            reference_for(dec, scale, window),
            atol=ATOL,
            rtol=RTOL,
        )
    if pre:
        q = torch.cat([r.queries for r in pre])
        q = torch.cat([q, torch.randn(mix["pad_tokens"], h, HEAD)])
        out = prefill_attention(
            q,
            cache,
            **prefill_inputs(
                pre, bs, mix["pad_tokens"], mix["pad_blocks"], mix["tile"]
            ),
            scale=scale,
            sliding_window=window,
        )
        n = sum(r.query_len for r in pre)
        expected = reference_for(pre, scale, window)
        torch.testing.assert_close(out[:n].double(), expected, atol=ATOL, rtol=RTOL)
        assert torch.isfinite(out).all()
        # The per-request form (attention outside any graph) agrees.
        out2 = per_request(q, cache, pre, scale, window)
        torch.testing.assert_close(out2[:n].double(), expected, atol=ATOL, rtol=RTOL)
