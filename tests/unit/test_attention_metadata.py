"""build_metadata and friends: a hand-worked example, padding, errors, properties,
and the metadata driving the kernels end to end against a per-request reference.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpu_kernels.attention import PAD_QUERY_POS, kv_cache_of_stacked
from vllm_hpu_mm.attention.backend import HpuMMAttentionImpl
from vllm_hpu_mm.attention.metadata import (
    DynamicAttentionMetadata,
    FlatDecodeInputs,
    PrefillCausalInputs,
    PrefillRequests,
    PrefillTileInputs,
    StaticAttentionMetadata,
    StepShape,
    build_metadata,
    check_fits,
    count_leading_decodes,
    exact_shape,
    split_metadata,
    token_row_of_real_tokens,
)

CPU = torch.device("cpu")
FIELDS = ["num_decodes", "decode_blocks", "num_prefill_tokens", "prefill_blocks"]


def i64(*xs: object) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# ----------------------------------------------------------------------------
# Hand-worked example (block size 4)
#
#   req  kind     computed  query  seq  blocks      tokens' positions -> slots
#   A    decode   5         1      6    [7, 3]      5 -> 3*4+1 = 13
#   B    decode   3         1      4    [5]         3 -> 5*4+3 = 23
#   C    prefill  3         4      7    [2, 9]      3,4,5,6 -> 11,36,37,38
#   D    prefill  0         2      2    [4]         0,1 -> 16,17
#
# The block table is wider than needed and holds junk (99) past each request's
# blocks: it must never leak into the metadata.
# ----------------------------------------------------------------------------

BS = 4
Q = np.array([1, 1, 4, 2], np.int64)
SEQ = np.array([6, 4, 7, 2], np.int64)
TABLE = np.array([[7, 3, 99], [5, 99, 99], [2, 9, 99], [4, 99, 99]], np.int64)
SLOTS = np.array([13, 23, 11, 36, 37, 38, 16, 17], np.int64)
# Flat decode: A's 2 blocks + B's 1; one prefill tile: C's 2 blocks + D's 1.
EXACT = StepShape(
    num_decodes=2, decode_blocks=3, num_prefill_tokens=6, prefill_blocks=3
)
# Batched decode: the table is as wide as the longest decode (2 blocks).
EXACT_BATCHED = StepShape(2, 2, 6, 3)
PAD = PAD_QUERY_POS
INT_FIELDS = [
    "slot_mapping",
    "decode.seq_lens",
    "decode.block_list",
    "decode.block_req",
    "decode.block_key_pos",
    "prefill.blocks",
    "prefill.query_pos",
    "prefill.key_pos",
]


def field_of(md: object, path: str) -> torch.Tensor:
    for name in path.split("."):
        md = getattr(md, name)
    assert isinstance(md, torch.Tensor), path
    return md


def attended(mask_row: torch.Tensor) -> list[int]:
    return mask_row.nonzero().flatten().tolist()


def test_count_leading_decodes() -> None:
    assert count_leading_decodes(Q) == 2
    assert count_leading_decodes(np.array([1, 1, 1])) == 3
    assert count_leading_decodes(np.array([3, 1, 1])) == 0
    assert count_leading_decodes(np.array([1, 5, 1])) == 1
    assert count_leading_decodes(np.array([], np.int64)) == 0


def test_exact_shape_hand_worked() -> None:
    assert exact_shape(Q, SEQ, BS) == EXACT
    assert exact_shape(Q, SEQ, BS, "batched") == EXACT_BATCHED
    assert EXACT.num_tokens == 8
    # Tiles of 4 rows: C's rows (one tile, 2 blocks), then D's (1 block).
    assert exact_shape(Q, SEQ, BS, tile=4) == StepShape(2, 3, 6, 2)


def test_build_metadata_hand_worked_exact() -> None:
    md = build_metadata(Q, SEQ, TABLE, SLOTS, BS, EXACT, CPU)
    assert md.num_decodes == 2
    assert md.num_prefill_tokens == 6
    assert isinstance(md, StaticAttentionMetadata)
    assert torch.equal(md.slot_mapping, i64(13, 23, 11, 36, 37, 38, 16, 17))
    assert torch.equal(md.decode.seq_lens, i64(6, 4))
    assert torch.equal(md.decode.block_list, i64(7, 3, 5))
    assert torch.equal(md.decode.block_req, i64(0, 0, 1))
    assert md.decode.block_mapping.tolist() == [[1, 1, 0], [0, 0, 1]]
    assert (md.decode.block_bias == 0).tolist() == [
        [True] * 4,
        [True, True, False, False],  # A: positions 4, 5 of 6
        [True] * 4,
    ]
    assert md.decode.block_key_pos.tolist() == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
    ]
    assert torch.equal(md.prefill.blocks, i64(2, 9, 4)[None])
    assert md.prefill.query_pos.tolist() == [[3, 4, 5, 6, 0, 1]]
    assert md.prefill.key_pos.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    mask = md.prefill.mask[0]
    assert [attended(mask[r]) for r in range(6)] == [
        [0, 1, 2, 3],
        [0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3, 4, 5, 6],
        [8],
        [8, 9],
    ]
    for name in INT_FIELDS:
        assert field_of(md, name).dtype == torch.int64, name
    assert md.decode.block_bias.dtype == md.decode.block_mapping.dtype == torch.float32
    assert md.prefill.mask.dtype == torch.bool


def test_build_metadata_hand_worked_padded() -> None:
    shape = StepShape(
        num_decodes=4, decode_blocks=5, num_prefill_tokens=8, prefill_blocks=5
    )
    md = build_metadata(Q, SEQ, TABLE, SLOTS, BS, shape, CPU)
    assert md.num_decodes == 4
    assert md.num_prefill_tokens == 8
    # Decode rows 0..1 real, 2..3 pad; prefill rows 4..9 real, 10..11 pad.
    assert torch.equal(md.slot_mapping, i64(13, 23, 0, 0, 11, 36, 37, 38, 16, 17, 0, 0))
    assert torch.equal(md.decode.seq_lens, i64(6, 4, 0, 0))
    assert torch.equal(md.decode.block_list, i64(7, 3, 5, 0, 0))
    assert torch.equal(md.decode.block_req, i64(0, 0, 1, 3, 3))
    assert md.decode.block_mapping[:, 3:].sum() == 0  # padding blocks: no row
    assert (md.decode.block_bias[3:] < -1e29).all()
    assert torch.equal(md.prefill.blocks, i64(2, 9, 4, 0, 0)[None])
    assert md.prefill.query_pos.tolist() == [[3, 4, 5, 6, 0, 1, PAD, PAD]]
    mask = md.prefill.mask[0]
    assert mask.shape == (8, 20)
    assert attended(mask[6]) == attended(mask[7]) == [0]  # padding rows: key 0
    assert attended(mask[5]) == [8, 9]
    rows = token_row_of_real_tokens(Q, shape)
    assert rows.tolist() == [0, 1, 4, 5, 6, 7, 8, 9]

    # The dynamic plan's: the real decode rows over a table of their real width
    # (the bucket's 4 rows and 3 columns are padding), prefill per request.
    dyn = build_metadata(
        Q, SEQ, TABLE, SLOTS, BS, StepShape(4, 3, 8, 5), CPU, kind="dynamic"
    )
    assert isinstance(dyn, DynamicAttentionMetadata)
    assert (dyn.num_decodes, dyn.num_prefill_tokens, dyn.real_decodes) == (4, 8, 2)
    assert torch.equal(dyn.decode_block_table, torch.tensor([[7, 3], [5, 0]]))
    assert torch.equal(dyn.decode_seq_lens, i64(6, 4))
    assert torch.equal(dyn.slot_mapping, md.slot_mapping)
    assert isinstance(dyn.prefill, PrefillRequests)
    assert dyn.prefill.rows == ((0, 4, 7), (4, 2, 2))


def test_decode_first_layout_trailing_single_token_request_is_a_prefill() -> None:
    """Only the leading one-token requests are decode rows."""
    q = np.array([1, 3, 1], np.int64)
    seq = np.array([5, 3, 9], np.int64)
    table = np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]], np.int64)
    slots = np.array([2 * 4 + 0, 12, 13, 14, 6 * 4 + 0], np.int64)
    shape = exact_shape(q, seq, 4)
    # The tile shows request 1's block and request 2's three.
    assert shape == StepShape(1, 2, 4, 4)
    md = build_metadata(q, seq, table, slots, 4, shape, CPU)
    assert torch.equal(md.decode.seq_lens, i64(5))
    assert torch.equal(md.decode.block_list, i64(1, 2))
    assert md.prefill.query_pos.tolist() == [[0, 1, 2, 8]]
    assert torch.equal(md.prefill.blocks, i64(3, 4, 5, 6)[None])
    assert attended(md.prefill.mask[0, 3]) == list(range(4, 13))
    assert torch.equal(md.slot_mapping, torch.from_numpy(slots))


def test_only_decodes_and_only_prefills() -> None:
    q = np.array([1, 1], np.int64)
    seq = np.array([3, 9], np.int64)
    table = np.array([[4, 0, 0], [5, 6, 7]], np.int64)
    slots = np.array([4 * 4 + 2, 7 * 4 + 0], np.int64)
    md = build_metadata(q, seq, table, slots, 4, StepShape(2, 4, 0, 0), CPU)
    assert torch.equal(md.decode.block_list, i64(4, 5, 6, 7))
    assert md.prefill is None  # no prefill rows: no tiles at all

    q = np.array([2, 3], np.int64)
    seq = np.array([2, 5], np.int64)
    slots = np.array([16, 17, 22, 23, 24], np.int64)
    md = build_metadata(q, seq, table, slots, 4, StepShape(0, 0, 5, 3), CPU)
    assert md.decode is None  # no decode rows: no decode inputs at all
    assert md.prefill.query_pos.tolist() == [[0, 1, 2, 3, 4]]
    assert torch.equal(md.prefill.blocks, i64(4, 5, 6)[None])


def test_split_metadata_gives_each_part_its_own_rows() -> None:
    shape = StepShape(4, 5, 8, 5)
    md = build_metadata(Q, SEQ, TABLE, SLOTS, BS, shape, CPU)
    dec, pre = split_metadata(md)
    assert (dec.num_decodes, dec.num_prefill_tokens) == (4, 0)
    assert (pre.num_decodes, pre.num_prefill_tokens) == (0, 8)
    assert torch.equal(dec.slot_mapping, md.slot_mapping[:4])
    assert torch.equal(pre.slot_mapping, md.slot_mapping[4:])
    assert torch.equal(dec.decode.block_list, md.decode.block_list)
    assert dec.prefill is None and pre.decode is None
    assert pre.prefill is md.prefill


@pytest.mark.parametrize("name", FIELDS)
def test_shape_too_small_names_the_field(name: str) -> None:
    small = StepShape(**{f: getattr(EXACT, f) for f in FIELDS} | {name: 0})
    assert getattr(small, name) < getattr(EXACT, name)
    with pytest.raises(ValueError) as info:
        build_metadata(Q, SEQ, TABLE, SLOTS, BS, small, CPU)
    # The bucket's repr names every field; the rest of the message must name
    # the offending one.
    msg = str(info.value).replace(repr(small), "")
    assert name in msg
    for other in FIELDS:
        if other != name and other not in name:
            assert other not in msg, msg


# ----------------------------------------------------------------------------
# Property tests on random batches (decodes first)
# ----------------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> dict:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    n_dec = draw(st.integers(0, 4))
    n_pre = draw(st.integers(0 if n_dec else 1, 4))
    seq_lens, query_lens = [], []
    for _ in range(n_dec):
        seq_lens.append(draw(st.integers(1, 40)))
        query_lens.append(1)
    for i in range(n_pre):
        # The first prefill right after the decodes must not look like one.
        lo = 2 if (i == 0 and n_dec) else 1
        seq = draw(st.integers(lo, 40))
        query_lens.append(draw(st.integers(lo, seq)))
        seq_lens.append(seq)
    blocks = [math.ceil(s / bs) for s in seq_lens]
    ids = draw(st.permutations(range(1, sum(blocks) + 20)))
    block_ids, k = [], 0
    for n in blocks:
        block_ids.append(list(ids[k : k + n]))
        k += n
    extra = draw(st.integers(0, 3))
    width = max(blocks) + extra
    junk = draw(st.sampled_from([0, 1000]))
    table = np.full((len(blocks), width), junk, np.int64)
    for r, b in enumerate(block_ids):
        table[r, : len(b)] = b
    pads = [draw(st.integers(0, 3)) for _ in FIELDS]
    return {
        "tile": draw(st.sampled_from([3, 8, 128])),
        "bs": bs,
        "query_lens": np.array(query_lens, np.int64),
        "seq_lens": np.array(seq_lens, np.int64),
        "block_ids": block_ids,
        "table": table,
        "pads": pads,
    }


def reference_tokens(b: dict) -> list[tuple[int, int, int]]:
    """(request, position, slot) of every real token, in batch order."""
    out = []
    for r, (q, s) in enumerate(zip(b["query_lens"], b["seq_lens"], strict=True)):
        for pos in range(int(s - q), int(s)):
            blk = b["block_ids"][r][pos // b["bs"]]
            out.append((r, pos, blk * b["bs"] + pos % b["bs"]))
    return out


def padded_shape(b: dict) -> StepShape:
    real = exact_shape(b["query_lens"], b["seq_lens"], b["bs"], tile=b["tile"])
    padded = [getattr(real, f) + p for f, p in zip(FIELDS, b["pads"], strict=True)]
    if padded[2] and not padded[3]:  # prefill rows (even padding) read >= 1 block
        padded[3] = 1
    return StepShape(*padded)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_properties_of_random_batches(b: dict) -> None:
    bs, q, seq, tile = b["bs"], b["query_lens"], b["seq_lens"], b["tile"]
    n_dec = count_leading_decodes(q)
    tokens = reference_tokens(b)
    slots_in = np.array([s for _, _, s in tokens], np.int64)
    shape = padded_shape(b)
    md = build_metadata(q, seq, b["table"], slots_in, bs, shape, CPU, tile=tile)

    # token_row_of_real_tokens: strictly increasing injection into the rows,
    # decode tokens into decode rows, prefill tokens into prefill rows.
    rows = token_row_of_real_tokens(q, shape)
    assert rows.shape == (len(tokens),)
    assert np.all(np.diff(rows) > 0)
    assert rows[:n_dec].tolist() == list(range(n_dec))
    assert np.all(rows[n_dec:] >= shape.num_decodes)

    # Slots: every real token's slot at its row; every other row the null slot 0.
    slot_map = md.slot_mapping.numpy()
    assert slot_map.shape == (shape.num_tokens,)
    for row, (_, _, slot) in zip(rows, tokens, strict=True):
        assert slot_map[row] == slot
    pad_rows = np.setdiff1d(np.arange(shape.num_tokens), rows)
    assert np.all(slot_map[pad_rows] == 0)

    # Flat decode: each decode row's real blocks, in order, exactly once; the
    # visible keys are its positions 0..seq-1; padding blocks belong to no row.
    if shape.num_decodes == 0:
        assert md.decode is None and n_dec == 0
    else:
        check_flat_decode(md.decode, shape, b, n_dec)
    if shape.num_prefill_tokens == 0:
        assert md.prefill is None
    else:
        check_tiles(md.prefill, shape, b, tokens[n_dec:])


def check_flat_decode(
    decode: FlatDecodeInputs, shape: StepShape, b: dict, n_dec: int
) -> None:
    seq = b["seq_lens"]
    blist = decode.block_list.numpy()
    breq = decode.block_req.numpy()
    mapping = decode.block_mapping.numpy()
    visible = decode.block_bias.numpy() == 0
    kpos = decode.block_key_pos.numpy()
    assert blist.shape == (shape.decode_blocks,)
    k = 0
    for r in range(n_dec):
        ids = b["block_ids"][r]
        assert blist[k : k + len(ids)].tolist() == ids
        assert np.all(breq[k : k + len(ids)] == r)
        assert np.all(mapping[r, k : k + len(ids)] == 1)
        assert sorted(kpos[k : k + len(ids)][visible[k : k + len(ids)]]) == list(
            range(int(seq[r]))
        )
        k += len(ids)
    assert np.all(blist[k:] == 0)
    assert not visible[k:].any()
    assert mapping.sum() == k  # one row per real block, none for padding


def check_tiles(tiles: PrefillTileInputs, shape: StepShape, b: dict, pre: list) -> None:
    """Every real row sees exactly its request's positions 0..pos (through
    the blocks the tile reads), padding rows key 0 only."""
    bs = b["bs"]
    nt, tq = tiles.query_pos.shape
    assert nt * tq >= shape.num_prefill_tokens
    tblocks = tiles.blocks.numpy()
    mask = tiles.mask.numpy()
    tkpos = tiles.key_pos.numpy()
    for i in range(nt * tq):
        t, j = divmod(i, tq)
        keys = np.flatnonzero(mask[t, j])
        if i >= len(pre):
            assert keys.tolist() == [0]
            continue
        r, pos, _ = pre[i]
        assert tiles.query_pos[t, j] == pos
        assert sorted(tkpos[t, keys].tolist()) == list(range(pos + 1))
        # Each visible key lies in one of the request's own blocks.
        for key in keys:
            blk = tblocks[t, key // bs]
            assert blk == b["block_ids"][r][tkpos[t, key] // bs]


# ----------------------------------------------------------------------------
# Metadata + kernels end to end, against a per-request reference
# ----------------------------------------------------------------------------


def reference_attention(
    query: torch.Tensor,  # [Tq, H, D]
    keys: torch.Tensor,  # [L, Hkv, D], position order
    values: torch.Tensor,
    positions: list[int],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    group = query.shape[1] // keys.shape[1]
    k_rep = keys.double().repeat_interleave(group, dim=1)
    v_rep = values.double().repeat_interleave(group, dim=1)
    out = torch.empty(query.shape, dtype=torch.float64)
    for t, qp in enumerate(positions):
        idx = [
            k
            for k in range(keys.shape[0])
            if k <= qp and (window is None or k > qp - window)
        ]
        for h in range(query.shape[1]):
            w = torch.softmax((k_rep[idx, h] @ query[t, h].double()) * scale, dim=0)
            out[t, h] = w @ v_rep[idx, h]
    return out


# (computed, query) per request, decodes first: several prefill requests
# (tiles), one fresh prompt (``causal`` above one 4-row tile), one chunk after
# context (``request``).
STEP_SPECS = {
    "several": [(4, 1), (20, 1), (0, 1), (0, 9), (7, 5), (33, 2)],
    "fresh": [(4, 1), (20, 1), (0, 1), (0, 9)],
    "chunk": [(4, 1), (20, 1), (0, 1), (7, 5)],
}


@pytest.mark.parametrize(
    ("step", "bucket_form"),
    [
        ("several", "tiles"),
        ("fresh", "causal"),
        ("fresh", "request"),
        ("fresh", "tiles"),
        ("chunk", "request"),
        ("chunk", "tiles"),
    ],
)
@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block_size", [4, 16])
def test_metadata_drives_the_backend_like_the_reference(
    block_size: int, window: int | None, kind: str, step: str, bucket_form: str
) -> None:
    """A mixed step (decodes + chunked prefills), padded, through the backend's
    forward (K/V write, decode and prefill kernels). Static: flat decode and
    the prefill part in the bucket's form (``tiles``; one request's rows as
    one tile, ``request``; a fresh prompt's causal SDPA, ``causal``) over the
    whole bucket (as a traced graph runs it), whole and split into two passes;
    dynamic: the real decode rows and blocks only and the prefill requests one
    by one (eager attention off Gaudi)."""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head = 4, 2, 8
    scale = 0.35
    specs = STEP_SPECS[step]
    q = np.array([n for _, n in specs], np.int64)
    seq = np.array([c + n for c, n in specs], np.int64)
    blocks = [math.ceil(s / block_size) for s in seq]
    num_blocks = sum(blocks) + 5
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_ids = []
    for n in blocks:
        block_ids.append(perm[:n])
        perm = perm[n:]
    table = np.zeros((len(specs), max(blocks)), np.int64)
    for r, ids in enumerate(block_ids):
        table[r, : len(ids)] = ids

    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head, generator=gen)
    keys = [torch.randn(int(s), num_kv_heads, head, generator=gen) for s in seq]
    values = [torch.randn(int(s), num_kv_heads, head, generator=gen) for s in seq]
    queries = [torch.randn(int(n), num_heads, head, generator=gen) for n in q]
    for r, (c, _) in enumerate(specs):  # prior context
        for p in range(c):
            b, o = block_ids[r][p // block_size], p % block_size
            cache[0, b, o], cache[1, b, o] = keys[r][p], values[r][p]
    slots = np.array(
        [
            block_ids[r][p // block_size] * block_size + p % block_size
            for r, (c, n) in enumerate(specs)
            for p in range(c, c + n)
        ],
        np.int64,
    )

    form = "flat" if kind == "static" else "batched"
    real = exact_shape(q, seq, block_size, form, tile=4)  # type: ignore[arg-type]
    assert real.prefill_form == {"several": "tiles", "fresh": "causal"}.get(
        step, "request"
    )
    shape = StepShape(
        real.num_decodes + 2,
        real.decode_blocks + 1,
        real.num_prefill_tokens + 3,
        0 if bucket_form == "causal" else real.prefill_blocks + 2,
        bucket_form,  # type: ignore[arg-type]
    )
    md = build_metadata(
        q,
        seq,
        table,
        slots,
        block_size,
        shape,
        CPU,
        kind=kind,  # type: ignore[arg-type]
        tile=4,
    )
    rows = token_row_of_real_tokens(q, shape)

    n_rows = shape.num_tokens
    query = torch.randn(n_rows, num_heads, head, generator=gen)
    key = torch.randn(n_rows, num_kv_heads, head, generator=gen) * 100
    value = torch.randn(n_rows, num_kv_heads, head, generator=gen) * 100
    k = 0
    for r, (c, n) in enumerate(specs):
        idx = torch.from_numpy(rows[k : k + n])
        query[idx] = queries[r]
        key[idx] = keys[r][c:]
        value[idx] = values[r][c:]
        k += n

    impl = HpuMMAttentionImpl(
        num_heads, head, scale, num_kv_heads, sliding_window=window
    )
    whole = impl.forward(
        None,
        query,
        key,
        value,
        kv_cache_of_stacked(cache.clone()),
        md,
        torch.empty_like(query),  # type: ignore[arg-type]
    )
    assert torch.isfinite(whole).all()
    if kind == "dynamic":  # padding decode rows computed nothing
        assert isinstance(md, DynamicAttentionMetadata)
        assert md.real_decodes == real.num_decodes
        assert md.decode_block_table.shape == (real.num_decodes, real.decode_blocks)
        assert (whole[real.num_decodes : md.num_decodes] == 0).all()
    else:  # the same step as two passes (decode rows, then prefill rows)
        assert isinstance(md, StaticAttentionMetadata)
        if bucket_form == "causal":
            assert isinstance(md.prefill, PrefillCausalInputs)
            assert md.prefill.blocks.shape == (
                1,
                -(-shape.num_prefill_tokens // block_size),
            )
        else:
            assert isinstance(md.prefill, PrefillTileInputs)
            n_pre = shape.num_prefill_tokens
            tiles = 1 if bucket_form == "request" else -(-n_pre // 4)
            assert md.prefill.mask.shape[0] == tiles
        split_cache = kv_cache_of_stacked(cache.clone())
        dec, pre = split_metadata(md)
        nd = md.num_decodes
        parts = [
            impl.forward(
                None,
                query[s],
                key[s],
                value[s],
                split_cache,
                m,
                torch.empty_like(query[s]),
            )  # type: ignore[arg-type]
            for s, m in ((slice(0, nd), dec), (slice(nd, None), pre))
        ]
        # Real rows agree (padding rows read the null block, which both runs'
        # padding rows write in a different order).
        real_rows = torch.from_numpy(rows)
        torch.testing.assert_close(
            torch.cat(parts)[real_rows], whole[real_rows], atol=1e-6, rtol=1e-6
        )
    k = 0
    for r, (c, n) in enumerate(specs):
        want = reference_attention(
            queries[r], keys[r], values[r], list(range(c, c + n)), scale, window
        )
        got = whole[torch.from_numpy(rows[k : k + n])].double()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        k += n


def test_traced_decode_runs_the_whole_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static metadata (attention traced into a graph) gives the kernels
    the bucket's rows and blocks, never the step's real counts (host ints a
    graph would guard on); the dynamic metadata (eager, off Gaudi) the real
    ones, with the same real rows."""
    from vllm_hpu_mm.attention import backend

    seen: list[tuple[str, int, int]] = []  # (kernel, rows, blocks) per call
    for name in ("decode_attention", "batched_decode_attention"):
        kernel = getattr(backend, name)

        def spy(
            query: torch.Tensor,
            cache: object,
            blocks: torch.Tensor,
            *a: object,
            _k: object = kernel,
            _name: str = name,
            **kw: object,
        ) -> torch.Tensor:
            width = blocks.shape[0] if _name == "decode_attention" else blocks.shape[-1]
            seen.append((_name, query.shape[0], width))
            return _k(query, cache, blocks, *a, **kw)  # type: ignore[operator]

        monkeypatch.setattr(backend, name, spy)
    q, seq = Q[:2], SEQ[:2]
    shape = StepShape(4, 8, 0, 0)
    static = build_metadata(q, seq, TABLE[:2], SLOTS[:2], BS, shape, CPU)
    dynamic = build_metadata(
        q, seq, TABLE[:2], SLOTS[:2], BS, shape, CPU, kind="dynamic"
    )
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 12, BS, 2, 8, generator=gen)
    query = torch.randn(4, 4, 8, generator=gen)
    key, value = torch.randn(2, 4, 2, 8, generator=gen)
    impl = HpuMMAttentionImpl(4, 8, 0.3, 2)

    def run(c: torch.Tensor, m: object) -> torch.Tensor:
        return impl.forward(None, query, key, value, c, m, torch.zeros_like(query))  # type: ignore[arg-type]

    eager = run(kv_cache_of_stacked(cache.clone()), dynamic)
    traced = torch.compile(run, backend="eager", fullgraph=True)(
        kv_cache_of_stacked(cache.clone()), static
    )
    # Dynamic: A's and B's rows over A's 2 columns; static: the whole bucket.
    assert seen == [("batched_decode_attention", 2, 2), ("decode_attention", 4, 8)]
    torch.testing.assert_close(traced[:2], eager[:2], atol=1e-6, rtol=1e-6)
    assert (eager[2:] == 0).all()  # eager: padding rows computed nothing
    # Other real counts in the same bucket: the same graph (no guard on them).
    monkeypatch.undo()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(run, backend=counter, fullgraph=True)
    one = build_metadata(Q[:1], SEQ[:1], TABLE[:1], SLOTS[:1], BS, shape, CPU)
    compiled(kv_cache_of_stacked(cache.clone()), static)
    compiled(kv_cache_of_stacked(cache.clone()), one)
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------
# Prefill forms: which a step takes, which bucket runs it
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "seq", "spans", "form"),
    [
        ([9], [9], None, "causal"),  # a fresh prompt above one tile
        ([9], [15], None, "request"),  # a chunk after context
        ([4], [4], None, "tiles"),  # fits one tile anyway
        ([5, 4], [5, 4], None, "tiles"),  # two requests
        ([1, 1, 9], [6, 3, 9], None, "causal"),  # decodes do not count
        ([9], [9], [(0, 0)] * 9, "causal"),  # spans given, none active
        ([9], [9], [(0, 0)] * 3 + [(3, 6)] * 3 + [(0, 0)] * 3, "request"),
    ],
)
def test_natural_prefill_form(
    query: list[int], seq: list[int], spans: list[tuple[int, int]] | None, form: str
) -> None:
    s = None if spans is None else np.array(spans, np.int64)
    q, sl = np.array(query, np.int64), np.array(seq, np.int64)
    assert exact_shape(q, sl, BS, tile=4, spans=s).prefill_form == form


def test_buckets_run_their_forms_and_the_causal_bucket_only_fresh_prompts() -> None:
    q, fresh, chunk = np.array([9]), np.array([9]), np.array([15])
    causal = exact_shape(q, fresh, BS, tile=4)
    request = exact_shape(q, chunk, BS, tile=4)
    assert (causal.prefill_blocks, request.prefill_blocks) == (3, 4)
    for real in (causal, request):
        check_fits(real, dataclasses.replace(real, prefill_form="tiles"))
        check_fits(real, dataclasses.replace(real, prefill_form="request"))
    # the causal bucket gathers its rows' blocks: no block axis
    check_fits(causal, StepShape(0, 0, 12, 0, "causal"))
    with pytest.raises(
        ValueError, match="'request' prefill part cannot run in a 'causal'"
    ):
        check_fits(request, StepShape(0, 0, 12, 0, "causal"))
    tiles = dataclasses.replace(request, prefill_form="tiles")
    with pytest.raises(ValueError, match="'tiles' prefill part cannot run"):
        check_fits(tiles, dataclasses.replace(request, prefill_form="request"))


def test_shape_policy_keeps_the_form_or_tiles_every_part() -> None:
    from vllm_hpu_mm.bucketing.buckets import Limits, default_buckets
    from vllm_hpu_mm.worker.shapes import ShapePolicy

    buckets = default_buckets(Limits(8, 512, 512, 16), "exponential")
    causal = exact_shape(np.array([300]), np.array([300]), 16)
    request = exact_shape(np.array([300]), np.array([400]), 16)
    on, off = ShapePolicy(buckets), ShapePolicy(buckets, prefill_forms=False)
    assert on(causal, 1)[0] == StepShape(0, 0, 512, 0, "causal")
    assert on(request, 1)[0].prefill_form == "request"
    assert on(request, 1)[0].prefill_blocks >= request.prefill_blocks
    assert {off(s, 1)[0].prefill_form for s in (causal, request)} == {"tiles"}


def test_a_causal_step_pads_records_and_falls_back_on_no_block_axis() -> None:
    """A fresh 500-token prompt at block 16 reads 32 blocks, above an explicit
    block list ending at 16: its causal bucket has no block axis, so nothing
    falls back and the recorder sees 0 blocks (the planner skips them)."""
    from vllm_hpu_mm.bucketing.buckets import BucketSet
    from vllm_hpu_mm.worker.shapes import ShapePolicy

    recorded: list[tuple[int, ...]] = []

    class Recorder:
        def record(self, *sizes: int) -> None:
            recorded.append(sizes)

    buckets = BucketSet((64, 512), (1, 4), (4, 8, 16))
    policy = ShapePolicy(buckets, recorder=Recorder())  # type: ignore[arg-type]
    exact = exact_shape(np.array([500]), np.array([500]), 16)
    assert (exact.prefill_form, exact.prefill_blocks) == ("causal", 32)
    assert policy(exact, 1)[0] == StepShape(0, 0, 512, 0, "causal")
    assert policy.bucketer is not None and policy.bucketer.fallback_count == 0
    assert recorded == [(1, 0, 0, 500, 0)]


def test_one_request_forms_only_where_attention_is_traced() -> None:
    from vllm_hpu_mm.config import BucketingConfig, HpuMMConfig
    from vllm_hpu_mm.plan import build_plan, one_request_forms

    on, off = BucketingConfig(), BucketingConfig(prefill_one_request=False)
    static = build_plan(HpuMMConfig(execution="static"), "cpu", False)
    dynamic = build_plan(HpuMMConfig(execution="dynamic"), "hpu", False)
    assert one_request_forms(static, on)
    assert not one_request_forms(static, off)
    assert dynamic.opaque_attention and not one_request_forms(dynamic, on)
