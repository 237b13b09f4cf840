"""Placeholder maps: a hand-worked example, errors, and properties of random
batches against a naive per-position reference loop.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hpu_mm.multimodal.placeholders import (
    ItemPlacement,
    PlaceholderMap,
    RequestChunk,
    build_placeholder_maps,
    flat_source_rows,
    needed_items,
)

FAST = settings(max_examples=150, deadline=None)
T, F = True, False

# ----------------------------------------------------------------------------
# Hand-worked example. Token rows: 0 = decode request, 1 = decode padding (the
# scratch row), 2..9 = request A's chunk, 10..14 = request B's chunk.
#
#   req A: chunk positions [4, 12) at rows [2, 10)
#     image a  positions 1..4             -> only pos 4: emb row 3 -> token row 2
#     image b  positions 6..10, mask TFTTF -> pos 6, 8, 9: emb 0, 1, 2
#                                           -> token rows 4, 6, 7
#     image c  positions 14..16            -> after the chunk: nothing
#   req B: chunk positions [0, 5) at rows [10, 15)
#     audio x  positions 0..1              -> emb 0, 1 -> token rows 10, 11
#     image b  positions 2..6, mask TFTTF  -> pos 2, 4 (5 is past the chunk):
#                                           emb 0, 1 -> token rows 12, 14
# ----------------------------------------------------------------------------

MASK_B = (T, F, T, T, F)
A = RequestChunk(
    chunk_start=4,
    chunk_len=8,
    row_start=2,
    items=(
        ItemPlacement("a", "image", 1, 4),
        ItemPlacement("b", "image", 6, 5, MASK_B),
        ItemPlacement("c", "image", 14, 3),
    ),
)
B = RequestChunk(
    chunk_start=0,
    chunk_len=5,
    row_start=10,
    items=(
        ItemPlacement("x", "audio", 0, 2),
        ItemPlacement("b", "image", 2, 5, MASK_B),
    ),
)
DECODE = RequestChunk(chunk_start=30, chunk_len=1, row_start=0)


def test_hand_worked_example() -> None:
    maps = build_placeholder_maps([DECODE, A, B], scratch_row=1)
    assert set(maps) == {"image", "audio"}
    img = maps["image"]
    assert img.item_keys == ("a", "b")
    assert img.src_item.tolist() == [0, 1, 1, 1, 1, 1]
    assert img.src_row.tolist() == [3, 0, 1, 2, 0, 1]
    assert img.dst_row.tolist() == [2, 4, 6, 7, 12, 14]
    assert img.num_real == len(img) == 6
    aud = maps["audio"]
    assert aud.item_keys == ("x",)
    assert aud.src_item.tolist() == [0, 0]
    assert aud.src_row.tolist() == [0, 1]
    assert aud.dst_row.tolist() == [10, 11]
    for m in maps.values():
        for a in (m.src_item, m.src_row, m.dst_row):
            assert a.dtype == np.int64

    # Encoder outputs concatenated as [a (4 rows), b (3 rows)].
    assert flat_source_rows(img, {"a": 0, "b": 4}).tolist() == [3, 4, 5, 6, 4, 5]
    assert flat_source_rows(aud, {"x": 7, "unused": 0}).tolist() == [7, 8]

    assert list(needed_items([DECODE, A, B])) == ["a", "b", "x"]
    assert needed_items([A])["b"] is A.items[1]


def test_padding_points_at_scratch_row() -> None:
    maps = build_placeholder_maps([DECODE, A, B], scratch_row=1, pad_to=lambda n: 8)
    img = maps["image"]
    assert len(img) == 8 and img.num_real == 6
    assert img.dst_row.tolist() == [2, 4, 6, 7, 12, 14, 1, 1]
    assert img.src_item.tolist()[6:] == [0, 0]
    assert img.src_row.tolist()[6:] == [0, 0]
    assert flat_source_rows(img, {"a": 5, "b": 9}).tolist() == [
        8, 9, 10, 11, 9, 10, 0, 0,
    ]  # fmt: skip
    assert len(maps["audio"]) == 8 and maps["audio"].num_real == 2


def test_requested_modalities_are_always_present() -> None:
    maps = build_placeholder_maps(
        [DECODE], scratch_row=0, pad_to=lambda n: max(n, 4), modalities=["image"]
    )
    img = maps["image"]
    assert img.item_keys == () and img.num_real == 0
    assert img.dst_row.tolist() == [0, 0, 0, 0]
    assert flat_source_rows(img, {}).tolist() == [0, 0, 0, 0]
    assert build_placeholder_maps([DECODE], scratch_row=0) == {}
    assert build_placeholder_maps([], scratch_row=0) == {}


def test_item_placement_basics() -> None:
    it = ItemPlacement("k", "image", 2, 5, [0, 1, 0, 1, 1])  # type: ignore[arg-type]
    assert it.is_embed == (F, T, F, T, T)
    assert it.num_embeds == 3 and ItemPlacement("k", "image", 2, 5).num_embeds == 5
    assert it == ItemPlacement("k", "image", 2, 5, (F, T, F, T, T))
    assert hash(it) == hash(ItemPlacement("k", "image", 2, 5, (F, T, F, T, T)))
    # Positions 5, 6 -> local 3, 4 -> embedding rows 1, 2 (vLLM's docstring case).
    assert it.embed_rows_in(5, 7) == (1, 3)
    assert it.embed_rows_in(0, 3) == (0, 0)  # only the hole at position 2
    assert it.embed_rows_in(0, 100) == (0, 3)
    assert it.embed_rows_in(7, 100) == (3, 3)
    assert it.embed_positions(0, 3).tolist() == [3, 5, 6]
    rng = SimpleNamespace(offset=2, length=5, is_embed=np.array(MASK_B))
    assert ItemPlacement.from_range("k", "image", rng).is_embed == MASK_B
    plain = SimpleNamespace(offset=3, length=4, is_embed=None)
    assert ItemPlacement.from_range("k", "image", plain).is_embed is None


def test_is_embed_length_mismatch_names_both_lengths() -> None:
    with pytest.raises(ValueError, match=r"is_embed has 3 entries.*length is 5"):
        ItemPlacement("k", "image", 0, 5, (T, F, T))


def test_invalid_placements_and_chunks() -> None:
    with pytest.raises(ValueError, match="length must be >= 1, got 0"):
        ItemPlacement("k", "image", 0, 0)
    with pytest.raises(ValueError, match="offset must be >= 0, got -1"):
        ItemPlacement("k", "image", -1, 2)
    with pytest.raises(ValueError, match="overlap"):
        RequestChunk(
            0,
            4,
            0,
            (ItemPlacement("p", "image", 3, 4), ItemPlacement("q", "image", 0, 4)),
        )
    with pytest.raises(ValueError, match=">= 0"):
        RequestChunk(0, -1, 0)


def test_pad_to_smaller_than_entries() -> None:
    with pytest.raises(ValueError, match=r"pad_to\(6\) returned 4"):
        build_placeholder_maps([A, B], scratch_row=0, pad_to=lambda n: n - 2)


def test_batch_level_errors() -> None:
    # Padding would overwrite a real placeholder row.
    with pytest.raises(ValueError, match="scratch_row 4"):
        build_placeholder_maps([A], scratch_row=4, pad_to=lambda n: n + 1)
    build_placeholder_maps([A], scratch_row=4)  # no padding: harmless
    with pytest.raises(ValueError, match="overlap"):
        build_placeholder_maps([A, RequestChunk(0, 3, 9)], scratch_row=0)
    # One key, two encoder-output sizes.
    clash = RequestChunk(0, 4, 20, (ItemPlacement("b", "image", 0, 4),))
    with pytest.raises(ValueError, match="3 embedding rows"):
        build_placeholder_maps([A, clash], scratch_row=0)
    with pytest.raises(ValueError, match="3 embedding rows"):
        needed_items([A, clash])
    img = build_placeholder_maps([A], scratch_row=0)["image"]
    with pytest.raises(KeyError, match="'b'"):
        flat_source_rows(img, {"a": 0})
    with pytest.raises(ValueError, match="int64"):
        PlaceholderMap((), np.zeros(1, np.int32), np.zeros(1), np.zeros(1, np.int64), 0)


# ----------------------------------------------------------------------------
# Properties of random batches
# ----------------------------------------------------------------------------

MODALITIES = ["image", "audio"]


@st.composite
def items_of_prompt(draw: st.DrawFn, shared_keys: bool) -> tuple[int, list]:
    """(prompt length, non-overlapping items in prompt order)."""
    items: list[ItemPlacement] = []
    pos = draw(st.integers(0, 4))
    for j in range(draw(st.integers(0, 4))):
        length = draw(st.integers(1, 8))
        mask = draw(
            st.none() | st.lists(st.booleans(), min_size=length, max_size=length)
        )
        modality = draw(st.sampled_from(MODALITIES))
        n_emb = length if mask is None else sum(mask)
        # Keys shared only between items of one modality and size.
        tag = draw(st.integers(0, 1)) if shared_keys else f"{id(items)}-{j}"
        key = f"{modality}-{n_emb}-{tag}"
        items.append(
            ItemPlacement(
                key, modality, pos, length, None if mask is None else tuple(mask)
            )
        )
        pos += length + draw(st.integers(0, 3))
    return pos + draw(st.integers(0, 3)), items


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[RequestChunk], int, int]:
    """(chunks, scratch row, padding) with gaps between the chunks' rows."""
    chunks = []
    row = draw(st.integers(0, 3))
    for _ in range(draw(st.integers(0, 4))):
        n_pos, items = draw(items_of_prompt(shared_keys=True))
        start = draw(st.integers(0, n_pos))
        length = draw(st.integers(0, n_pos - start))
        chunks.append(RequestChunk(start, length, row, tuple(items)))
        row += length + draw(st.integers(0, 3))
    scratch = row + draw(st.integers(0, 2))
    return chunks, scratch, draw(st.integers(0, 5))


def reference(chunks: list[RequestChunk]) -> dict[str, list[tuple[str, int, int]]]:
    """Per modality, (key, embedding row, token row) of every entry, one
    position at a time."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for ch in chunks:
        for it in ch.items:
            mask = it.is_embed or (True,) * it.length
            for p in range(ch.chunk_start, ch.chunk_start + ch.chunk_len):
                j = p - it.offset
                if 0 <= j < it.length and mask[j]:
                    k = sum(mask[:j])
                    row = ch.row_start + p - ch.chunk_start
                    out.setdefault(it.modality, []).append((it.key, k, row))
    return out


def entries(m: PlaceholderMap) -> list[tuple[str, int, int]]:
    return [
        (m.item_keys[i], r, d)
        for i, r, d in zip(
            m.src_item[: m.num_real].tolist(),
            m.src_row[: m.num_real].tolist(),
            m.dst_row[: m.num_real].tolist(),
            strict=True,
        )
    ]


@FAST
@given(batches())
def test_random_batches_match_reference(batch: tuple) -> None:
    chunks, scratch, extra = batch
    maps = build_placeholder_maps(
        chunks, scratch_row=scratch, pad_to=lambda n: n + extra
    )
    want = reference(chunks)
    assert set(maps) == set(want)
    sizes: dict[str, int] = {}
    for ch in chunks:
        for it in ch.items:
            sizes[it.key] = it.num_embeds
    for modality, m in maps.items():
        got = entries(m)
        assert got == want[modality]
        # Keys: distinct, first-use order, each used.
        assert list(m.item_keys) == list(dict.fromkeys(k for k, _, _ in got))
        assert len(m) == m.num_real + extra
        assert np.all(m.dst_row[m.num_real :] == scratch)
        assert np.all(m.src_item[m.num_real :] == 0)
        assert np.all(m.src_row[m.num_real :] == 0)
        # Real destinations are distinct rows inside their requests' chunks.
        assert len(set(m.dst_row[: m.num_real].tolist())) == m.num_real
        # Global source rows into the concatenated encoder outputs.
        offsets, total = {}, 0
        for k in m.item_keys:
            offsets[k] = total
            total += sizes[k]
        flat = flat_source_rows(m, offsets)
        assert flat.tolist() == [offsets[k] + r for k, r, _ in got] + [0] * extra
        assert np.all(flat < max(total, 1))
    # needed_items: exactly the keys with an entry, first-use order.
    want_keys = list(dict.fromkeys(k for es in want.values() for k, _, _ in es))
    assert sorted(needed_items(chunks)) == sorted(want_keys)
    for m in maps.values():
        assert set(m.item_keys) <= set(needed_items(chunks))


@FAST
@given(items_of_prompt(shared_keys=False), st.data())
def test_chunks_of_one_request_cover_each_embedding_row_once(
    prompt: tuple[int, list], data: st.DataObject
) -> None:
    n_pos, items = prompt
    cuts = sorted(data.draw(st.lists(st.integers(0, n_pos), max_size=6)))
    bounds = [0, *cuts, n_pos]
    got_rows: dict[str, list[int]] = {it.key: [] for it in items}
    got_pos: dict[str, list[int]] = {it.key: [] for it in items}
    for start, end in itertools.pairwise(bounds):
        row_start = data.draw(st.integers(0, 5))
        ch = RequestChunk(start, end - start, row_start, tuple(items))
        maps = build_placeholder_maps([ch], scratch_row=row_start + end - start)
        needed = needed_items([ch])
        for m in maps.values():
            for key, k, row in entries(m):
                got_rows[key].append(k)
                got_pos[key].append(row - row_start + start)
                assert key in needed
    for it in items:
        assert got_rows[it.key] == list(range(it.num_embeds))
        mask = it.is_embed or (True,) * it.length
        want_pos = [it.offset + j for j in range(it.length) if mask[j]]
        assert got_pos[it.key] == want_pos
        # Consecutive chunks give consecutive embedding-row ranges.
        ranges = [it.embed_rows_in(a, b) for a, b in itertools.pairwise(bounds)]
        assert [r[0] for r in ranges[1:]] == [r[1] for r in ranges[:-1]]
        assert ranges[0][0] == 0 and ranges[-1][1] == it.num_embeds


def test_items_outside_the_chunk_or_only_at_holes_are_not_needed() -> None:
    before = ItemPlacement("before", "image", 0, 3)  # positions 0..2
    holes = ItemPlacement("holes", "image", 4, 4, (F, F, T, T))  # embeds at 6, 7
    after = ItemPlacement("after", "image", 10, 2)  # positions 10, 11
    ch = RequestChunk(
        chunk_start=3, chunk_len=3, row_start=0, items=(before, holes, after)
    )
    assert needed_items([ch]) == {}
    assert build_placeholder_maps([ch], scratch_row=9) == {}
    # One more position reaches the first embedding of "holes" only.
    ch2 = RequestChunk(3, 4, 0, (before, holes, after))
    assert list(needed_items([ch2])) == ["holes"]
    m = build_placeholder_maps([ch2], scratch_row=9)["image"]
    assert entries(m) == [("holes", 0, 3)]
