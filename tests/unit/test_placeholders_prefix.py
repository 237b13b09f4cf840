"""Placeholder maps when a request's first computed position is not 0.

With prefix caching a request's first step starts at ``num_computed_tokens``
(a multiple of the block size) that may fall inside an image's placeholder
range: the cached blocks hold the K/V of the image's first positions, and the
step must merge only the rows of the uncached rest, starting at the right
embedding row. An item wholly inside the cached prefix is not read at all.

The pure maps (``build_placeholder_maps``, ``needed_items``) are checked by
hand and against a per-position reference over random cache boundaries and
chunkings; the runner's merge (``MultimodalInputs.embed``) is checked on a
tiny stand-in model whose "encoder output" row k of item X is a vector that
names (X, k), so a merged row says where it came from.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hpu_mm.multimodal.placeholders import (
    ItemPlacement,
    RequestChunk,
    build_placeholder_maps,
    needed_items,
)

T, F = True, False
BLOCK = 16


def _entries(chunks: list[RequestChunk]) -> list[tuple[str, int, int]]:
    """Real entries of every modality as (item key, embedding row, token row)."""
    out = []
    for m in build_placeholder_maps(chunks, scratch_row=10_000).values():
        for i in range(m.num_real):
            out.append(
                (m.item_keys[m.src_item[i]], int(m.src_row[i]), int(m.dst_row[i]))
            )
    return sorted(out)


# ---- by hand ------------------------------------------------------------------


def test_first_step_starts_inside_an_image() -> None:
    """Image at positions [7, 23) (as in the tiny LLaVA's prompt), 16 cached
    tokens: the first step merges embedding rows 9..15 into its first 7 rows."""
    image = ItemPlacement("img", "image", 7, 16)
    step = RequestChunk(chunk_start=16, chunk_len=24, row_start=0, items=(image,))
    assert list(needed_items([step])) == ["img"]
    assert _entries([step]) == [("img", 9 + i, i) for i in range(7)]


def test_item_wholly_in_the_cached_prefix_is_not_read() -> None:
    """Cached prefix 32 covers image a ([7, 23)) and stops inside image b
    ([28, 36)); a is neither needed nor merged."""
    a = ItemPlacement("a", "image", 7, 16)
    b = ItemPlacement("b", "image", 28, 8)
    step = RequestChunk(chunk_start=32, chunk_len=17, row_start=3, items=(a, b))
    assert list(needed_items([step])) == ["b"]
    assert _entries([step]) == [("b", 4 + i, 3 + i) for i in range(4)]


def test_full_hit_recomputes_only_the_last_token() -> None:
    """A prompt ending in an image, wholly cached but for its last token
    (vLLM recomputes it for the logits): one row, the image's last one, at a
    decode row of the batch."""
    image = ItemPlacement("img", "image", 40, 8)  # prompt of 48 tokens
    step = RequestChunk(chunk_start=47, chunk_len=1, row_start=0, items=(image,))
    assert _entries([step]) == [("img", 7, 0)]


def test_boundary_inside_an_item_with_is_embed_holes() -> None:
    """is_embed F T T F T T T F over positions 12..19; 16 cached: positions
    16, 17, 18 are embedding rows 2, 3, 4 (the hole at 15 is cached, the one
    at 19 takes nothing)."""
    mask = (F, T, T, F, T, T, T, F)
    image = ItemPlacement("img", "image", 12, 8, mask)
    step = RequestChunk(chunk_start=16, chunk_len=8, row_start=5, items=(image,))
    assert _entries([step]) == [("img", 2, 5), ("img", 3, 6), ("img", 4, 7)]
    # Starting on the hole at 15 changes nothing but the rows' offset.
    step = RequestChunk(chunk_start=15, chunk_len=9, row_start=5, items=(image,))
    assert _entries([step]) == [("img", 2, 6), ("img", 3, 7), ("img", 4, 8)]


def test_cached_and_cold_requests_share_an_image_in_one_step() -> None:
    """Request 1 starts at 16 inside the image, request 2 (cold) holds the
    same image at [3, 19): one key, each request's own rows."""
    r1 = RequestChunk(16, 10, 0, (ItemPlacement("img", "image", 7, 16),))
    r2 = RequestChunk(0, 24, 10, (ItemPlacement("img", "image", 3, 16),))
    maps = build_placeholder_maps([r1, r2], scratch_row=100)
    assert maps["image"].item_keys == ("img",)
    want = [("img", 9 + i, i) for i in range(7)]
    want += [("img", k, 10 + 3 + k) for k in range(16)]
    assert _entries([r1, r2]) == sorted(want)


# ---- properties ----------------------------------------------------------------


@st.composite
def prompts_with_a_cached_prefix(
    draw: st.DrawFn,
) -> tuple[list[ItemPlacement], int, list[int], int]:
    """Items of one prompt, a cached prefix (whole blocks, below the prompt's
    length) and the chunk lengths that cover the rest of the prompt."""
    items = []
    pos = draw(st.integers(0, 20))
    for j in range(draw(st.integers(1, 4))):
        length = draw(st.integers(1, 40))
        mask = draw(
            st.none() | st.lists(st.booleans(), min_size=length, max_size=length)
        )
        embed = None if mask is None else tuple(mask)
        items.append(ItemPlacement(f"item{j}", "image", pos, length, embed))
        pos += length + draw(st.integers(0, 20))
    prompt_len = pos + draw(st.integers(1, 10))
    cached = BLOCK * draw(st.integers(0, (prompt_len - 1) // BLOCK))
    chunks, start = [], cached
    while start < prompt_len:
        n = draw(st.integers(1, prompt_len - start))
        chunks.append(n)
        start += n
    return items, cached, chunks, draw(st.integers(0, 7))


@settings(max_examples=200, deadline=None)
@given(prompts_with_a_cached_prefix())
def test_steps_after_a_cached_prefix_merge_each_uncached_row_once(
    case: tuple[list[ItemPlacement], int, list[int], int],
) -> None:
    """Over all steps of a request that starts at the cached prefix, every
    embedding row whose position is uncached is merged exactly once, at its
    position's token row; rows of cached positions never are; an item is
    needed in a step iff the step merges one of its rows."""
    items, cached, lengths, row_start = case
    got: list[tuple[str, int, int]] = []  # (key, embedding row, position)
    start = cached
    for n in lengths:
        step = RequestChunk(start, n, row_start, tuple(items))
        entries = _entries([step])
        got += [(k, r, start + dst - row_start) for k, r, dst in entries]
        assert set(needed_items([step])) == {k for k, _, _ in entries}
        start += n
    want = [
        (it.key, k, int(p))
        for it in items
        for k, p in enumerate(it.embed_positions(0, it.num_embeds))
        if p >= cached
    ]
    assert sorted(got) == sorted(want)


# ---- the runner's merge ----------------------------------------------------------

HIDDEN = 4


class _TinyMM(torch.nn.Module):
    """Stands in for a multimodal model: text embedding of token t is
    [t, 0, 0, 0]; the encoder output row k of item number i is [-1, i, k, 0]."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(input_ids.shape[0], HIDDEN)
        out[:, 0] = input_ids.float()
        return out

    def embed_multimodal(self, **kwargs: Any) -> list[torch.Tensor]:
        raise AssertionError("the test fills the encoder cache itself")


def _encoder_output(item: int, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, HIDDEN)
    out[:, 0] = -1
    out[:, 1] = item
    out[:, 2] = torch.arange(rows)
    return out


def _state(req_id: str, prompt_len: int, computed: int, images: list[Any]) -> Any:
    from vllm_hpu_mm.worker.requests import RequestState

    return RequestState(
        req_id=req_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=None,  # type: ignore[arg-type]
        generator=None,
        block_ids=list(range(1, -(-prompt_len // BLOCK) + 1)),
        num_computed_tokens=computed,
        mm_features=images,
    )


def _image(key: str, offset: int, length: int) -> Any:
    """Shaped like vLLM's MultiModalFeatureSpec (the fields the runner reads)."""
    rng = SimpleNamespace(offset=offset, length=length, is_embed=None)
    return SimpleNamespace(identifier=key, modality="image", mm_position=rng)


@pytest.mark.parametrize("computed", [0, 16, 32])
def test_runner_merges_the_uncached_rows_of_a_cut_image(computed: int) -> None:
    """A 49-token prompt, image at [7, 23) and a second image at [30, 46),
    first step after ``computed`` cached tokens, next to a decode request.
    Each token row holds the text embedding or exactly the encoder row its
    position takes."""
    from vllm_hpu_mm.config import HpuMMConfig
    from vllm_hpu_mm.multimodal.placeholders import request_chunks
    from vllm_hpu_mm.plan import build_plan
    from vllm_hpu_mm.worker.graphs import GraphRunner
    from vllm_hpu_mm.worker.inputs import build_step, step_passes
    from vllm_hpu_mm.worker.multimodal import MultimodalInputs

    model = _TinyMM()
    eager = HpuMMConfig(graph_mode="eager")
    mm = MultimodalInputs(
        model,
        torch.device("cpu"),
        GraphRunner(model, build_plan(eager, "cpu", False), "inductor"),
        1,
        hidden=HIDDEN,
        store_rows=40,
    )
    mm.store.put("b", _encoder_output(2, 16))  # store rows 1..16
    mm.store.put("a", _encoder_output(1, 16))  # store rows 17..32
    decode = _state("dec", 20, 19, [])
    prefill = _state("pre", 49, computed, [_image("a", 7, 16), _image("b", 30, 16)])
    query = np.array([1, 49 - computed], np.int64)
    batch = build_step(
        ["dec", "pre"],
        [decode, prefill],
        query,
        lambda s, n: (s, n),
        BLOCK,
        torch.device("cpu"),
    )
    md = batch.attn_metadata
    mm.attach_maps(md, request_chunks([decode, prefill], query, batch.row_starts))
    # The mixed step runs as a decode pass and a prefill pass, each merging
    # from its own part of the maps.
    passes = step_passes(md)
    assert len(passes) == 2
    embeds = torch.cat(
        [
            mm.merge(batch.input_ids[p.start : p.stop], p.attn_metadata.mm_maps)
            for p in passes
        ]
    )
    assert embeds.shape == (batch.shape.num_tokens, HIDDEN)
    row0 = int(batch.row_starts[1])
    for pos in range(computed, 49):
        row = embeds[row0 + pos - computed]
        if 7 <= pos < 23:
            want = [-1.0, 1.0, float(pos - 7), 0.0]
        elif 30 <= pos < 46:
            want = [-1.0, 2.0, float(pos - 30), 0.0]
        else:
            want = [float(pos + 1), 0.0, 0.0, 0.0]  # prompt token id pos + 1
        assert row.tolist() == want, (pos, row.tolist())
    assert embeds[0].tolist() == [20.0, 0.0, 0.0, 0.0]  # the decode row's token
    image_rows = sum(1 for p in range(computed, 49) if 7 <= p < 23 or 30 <= p < 46)
    assert md.mm_maps["image"].num_real == image_rows
    assert md.mm_maps["image"].rows == batch.shape.num_tokens  # padded to the step
    # As one pass (opaque attention or eager mode off Gaudi): the same rows.
    (whole,) = step_passes(md, split=False)
    assert (whole.start, whole.stop) == (0, batch.shape.num_tokens)
    assert torch.equal(mm.merge(batch.input_ids, whole.attn_metadata.mm_maps), embeds)
