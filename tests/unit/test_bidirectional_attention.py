"""Bidirectional image spans (Gemma 3) in the tiled prefill kernel, against a
float64 per-request reference with transformers' Gemma 3 mask.

transformers masks Gemma 3's global layers with ``causal OR same image`` and its
sliding layers with ``window AND (causal OR same image)`` (``modeling_gemma3``:
``create_masks_for_vision_model``; the window is ``key > query - window``). An
image is a run of embedding positions of one item (the soft tokens; the
``<start_of_image>`` / ``<end_of_image>`` tokens around them are text). The
reference below applies that rule to each request's own keys (those computed so
far: a span never reaches keys a later step writes). The kernel sees only the
paged cache and the metadata: spans come from the placeholder ranges through
``bidirectional_spans`` and ``prefill_tiles`` (tile blocks widened to a span's
end, spans as key columns), so the whole path from placeholders to scores is
checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stacked_kv import prefill_attention
from tests.unit.test_attention_kernels import (
    HEADS,
    block_table_of,
    make_scenario,
    write_step,
)
from vllm_hpu_mm.attention.layout import (
    exact_shape,
    prefill_context_blocks,
    prefill_tiles,
    spans_from_doc_ranges,
)
from vllm_hpu_mm.attention.metadata import PrefillRequests, build_metadata
from vllm_hpu_mm.multimodal.placeholders import (
    ItemPlacement,
    RequestChunk,
    bidirectional_spans,
)

ATOL = RTOL = 1e-5


def span_of(spans: list[tuple[int, int]], pos: int) -> tuple[int, int] | None:
    return next(((a, b) for a, b in spans if a <= pos < b), None)


def reference(
    query: torch.Tensor,  # [Tq, H, D]
    keys: torch.Tensor,  # [L, Hkv, D] the request's computed keys
    values: torch.Tensor,
    positions: list[int],
    spans: list[tuple[int, int]],  # the request's image spans (positions)
    scale: float,
    window: int | None,
) -> torch.Tensor:
    num_heads, group = query.shape[1], query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    out = torch.empty(query.shape, dtype=torch.float64)
    for t, q in enumerate(positions):
        own = span_of(spans, q)
        idx = [
            j
            for j in range(keys.shape[0])
            if (j <= q or (own is not None and own[0] <= j < own[1]))
            and (window is None or j > q - window)
        ]
        for h in range(num_heads):
            w = torch.softmax((k[idx, h] @ query[t, h].double()) * scale, dim=0)
            out[t, h] = w @ v[idx, h]
    return out


def image(key: str, offset: int, soft: int) -> ItemPlacement:
    """Gemma 3's placeholder: a text token, ``soft`` embedding tokens, a text
    token (``<start_of_image>`` ... ``<end_of_image>``)."""
    return ItemPlacement(key, "image", offset, soft + 2, (False, *[True] * soft, False))


def run_case(
    specs: list[tuple[int, int]],
    items: list[list[ItemPlacement]],
    block_size: int,
    tile: int,
    window: int | None,
    heads: tuple[int, int],
    pad_tokens: int = 0,
    pad_blocks: int = 0,
    seed: int = 0,
) -> None:
    num_heads, num_kv_heads = heads
    cache, reqs = make_scenario(specs, block_size, num_heads, num_kv_heads, seed)
    write_step(cache, reqs, pad_rows=pad_tokens)
    q = np.array([r.query_len for r in reqs], np.int64)
    seq = np.array([r.seq_len for r in reqs], np.int64)
    starts = np.cumsum(q) - q
    chunks = [
        RequestChunk(r.prior, r.query_len, int(s), tuple(its))
        for r, s, its in zip(reqs, starts, items, strict=True)
    ]
    spans = bidirectional_spans(chunks, int(q.sum()))
    n_tok = int(q.sum()) + pad_tokens
    n_blk = prefill_context_blocks(q, seq, block_size, tile, spans) + pad_blocks
    t = prefill_tiles(
        q, seq, block_table_of(reqs), block_size, n_tok, n_blk, tile, spans
    )
    assert t.span_lo is not None and t.span_hi is not None
    query = torch.cat([r.queries for r in reqs])
    scale = 0.37
    got = prefill_attention(
        torch.cat([query, torch.zeros(pad_tokens, *query.shape[1:])]),
        cache,
        torch.from_numpy(t.blocks),
        torch.from_numpy(t.mask),
        torch.from_numpy(t.query_pos),
        torch.from_numpy(t.key_pos),
        scale,
        window,
        span_lo=torch.from_numpy(t.span_lo),
        span_hi=torch.from_numpy(t.span_hi),
    )
    assert torch.isfinite(got).all()
    row = 0
    for r, its in zip(reqs, items, strict=True):
        req_spans = [run for it in its for run in it.embed_runs()]
        want = reference(
            r.queries, r.keys, r.values, r.positions, req_spans, scale, window
        )
        torch.testing.assert_close(
            got[row : row + r.query_len].double(), want, atol=ATOL, rtol=RTOL
        )
        row += r.query_len


@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("window", [None, 5, 24], ids=["global", "w5", "w24"])
def test_image_straddling_tiles_with_text_and_context(
    heads: tuple[int, int], window: int | None
) -> None:
    """Two requests: one whose 9-token image crosses two tile boundaries (tile 4),
    after 6 prior tokens; one with two images and text between, no prior. A
    5-token window is shorter than the image (the span is cut by it as in HF)."""
    run_case(
        specs=[(6, 20), (0, 30)],
        items=[[image("a", 8, 9)], [image("b", 2, 6), image("c", 14, 9)]],
        block_size=4,
        tile=4,
        window=window,
        heads=heads,
        pad_tokens=3,
        pad_blocks=1,
    )


def test_prefix_hit_inside_an_image() -> None:
    """The step starts inside an image (cached blocks end there): its remaining
    tokens see the cached part of the span both ways, and the cached part is
    not recomputed."""
    run_case(
        specs=[(12, 14)],
        items=[[image("a", 5, 12)]],  # soft tokens 6..17, step from 12
        block_size=4,
        tile=8,
        window=None,
        heads=(4, 2),
    )


def test_span_past_the_computed_keys_is_clipped() -> None:
    """A span running past the step (never so under whole-image scheduling)
    reads only computed keys: stale slots after the step stay invisible."""
    run_case(
        specs=[(0, 10)],
        items=[[image("a", 3, 16)]],  # soft tokens 4..19, step ends at 10
        block_size=4,
        tile=4,
        window=None,
        heads=(4, 2),
        pad_blocks=2,
    )


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([2, 4, 8]),
    tile=st.sampled_from([3, 4, 16]),
    window=st.sampled_from([None, 3, 7]),
)
def test_random_requests_and_images(
    data: st.DataObject, block_size: int, tile: int, window: int | None
) -> None:
    specs, items = [], []
    for r in range(data.draw(st.integers(1, 3))):
        prior = data.draw(st.integers(0, 10))
        qlen = data.draw(st.integers(2, 20))
        its: list[ItemPlacement] = []
        pos = data.draw(st.integers(0, 4))
        while pos + 3 <= prior + qlen and data.draw(st.booleans()):
            soft = data.draw(st.integers(1, 8))
            its.append(image(f"{r}-{pos}", pos, soft))
            pos += soft + 2 + data.draw(st.integers(0, 3))
        specs.append((prior, qlen))
        items.append(its)
    run_case(specs, items, block_size, tile, window, (4, 2), pad_tokens=1)


def test_tiles_widen_to_the_span_end() -> None:
    """A tile whose last rows start an image reads the blocks up to the image's
    end: the exact shape counts them (so the bucket does too)."""
    q = np.array([4, 12], np.int64)  # A: text; B: an image at positions 0..11
    seq = q.copy()
    chunks = [RequestChunk(0, 12, 4, (image("b", 0, 10),))]  # soft 1..10
    spans = bidirectional_spans(chunks, 16)
    assert spans[5].tolist() == [1, 11] and spans[4].tolist() == [0, 0]
    # Tile 0 = A's 4 rows + B's positions 0..3, which reach position 10.
    assert prefill_context_blocks(q, seq, 2, tile=8) == 6  # causal: tile 1
    assert prefill_context_blocks(q, seq, 2, tile=8, spans=spans) == 8
    table = np.array([[1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8]], np.int64)
    t = prefill_tiles(q, seq, table, 2, 16, 8, 8, spans)
    assert t.span_lo is not None and t.span_hi is not None
    assert t.blocks[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # B's keys start at column 4: span [1, 11) is columns [5, 15).
    assert t.span_lo[0].tolist() == [0, 0, 0, 0, 0, 5, 5, 5]
    assert t.span_hi[0].tolist() == [0, 0, 0, 0, 0, 15, 15, 15]


def test_metadata_carries_spans_only_when_given() -> None:
    q = np.array([1, 6], np.int64)  # a decode, then a prefill with an image
    seq = np.array([5, 6], np.int64)
    table = np.array([[1, 2], [3, 4]], np.int64)
    slots = np.arange(7, dtype=np.int64) + 8
    dev = torch.device("cpu")
    plain = build_metadata(q, seq, table, slots, 4, exact_shape(q, seq, 4), dev)
    assert plain.prefill.span_lo is None and plain.prefill.span_hi is None
    spans = np.zeros((7, 2), np.int64)
    spans[2:6] = (1, 5)  # the prefill's positions 1..4 (token rows 2..5)
    shape = exact_shape(q, seq, 4, spans=spans)
    md = build_metadata(q, seq, table, slots, 4, shape, dev, spans=spans)
    assert md.prefill.span_lo is not None and md.prefill.span_hi is not None
    assert md.prefill.span_lo.tolist() == [[0, 1, 1, 1, 1, 0]]
    assert md.prefill.span_hi.tolist() == [[0, 5, 5, 5, 5, 0]]
    with pytest.raises(ValueError, match=r"spans must be \[7, 2\]"):
        exact_shape(q, seq, 4, spans=spans[:6])


def test_vllm_doc_ranges_give_the_same_spans() -> None:
    """vLLM's ``mm_req_doc_ranges`` (inclusive ranges of ``extract_embeds_range``,
    what its GPU runner hands attention builders) mean the same spans as the
    placeholder ranges do, chunk by chunk."""
    q = np.array([1, 9, 12], np.int64)  # a decode, then two prefill chunks
    seq = np.array([30, 15, 12], np.int64)
    items = [
        (),
        (image("a", 4, 6), image("b", 13, 4)),  # soft 5..10 and 14..17
        (image("c", 0, 10),),  # soft 1..10
    ]
    chunks = [
        RequestChunk(int(s - n), int(n), int(r), its)
        for s, n, r, its in zip(seq, q, np.cumsum(q) - q, items, strict=True)
    ]
    want = bidirectional_spans(chunks, int(q.sum()))
    ranges = {0: [], 1: [(5, 10), (14, 17)], 2: [(1, 10)]}
    got = spans_from_doc_ranges(ranges, q, seq)
    assert got is not None
    assert got.tolist() == want.tolist()
    assert spans_from_doc_ranges(None, q, seq) is None


def test_vllm_metadata_builder_reads_the_doc_ranges() -> None:
    """The generic builder (vLLM code that builds metadata itself) turns
    ``CommonAttentionMetadata.mm_req_doc_ranges`` into the same spans."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_hpu_mm.attention.backend import HpuMMAttentionMetadataBuilder

    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 12]),
        query_start_loc_cpu=torch.tensor([0, 12]),
        seq_lens=torch.tensor([12]),
        num_reqs=1,
        num_actual_tokens=12,
        max_query_len=12,
        max_seq_len=12,
        block_table_tensor=torch.tensor([[1, 2, 3]]),
        slot_mapping=torch.arange(12) + 4,
        mm_req_doc_ranges={0: [(1, 10)]},
    )
    spec = SimpleNamespace(block_size=4)
    builder = HpuMMAttentionMetadataBuilder(
        spec,  # type: ignore[arg-type]
        ["layer"],
        None,
        torch.device("cpu"),
    )
    md = builder.build(0, cm)
    assert md.prefill.span_lo is not None and md.prefill.span_hi is not None
    lo, hi = md.prefill.span_lo.tolist()[0], md.prefill.span_hi.tolist()[0]
    assert lo == [0] + [1] * 10 + [0] and hi == [0] + [11] * 10 + [0]
    cm.mm_req_doc_ranges = None
    # Without spans (the CPU's dynamic plan): the prefill request by request.
    assert isinstance(builder.build(0, cm).prefill, PrefillRequests)


def test_build_step_carries_the_image_spans_of_bidirectional_models() -> None:
    """The runner's step: a decode and a prefill chunk with an image whose
    placeholder (vLLM's ``PlaceholderRange``, ``is_embed`` holes) starts before
    the chunk; only a bidirectional-image model gets the spans."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.multimodal.inputs import PlaceholderRange

    from vllm_hpu_mm.worker.inputs import build_step
    from vllm_hpu_mm.worker.requests import RequestState

    embed = torch.tensor([False, *[True] * 6, False])  # soft tokens 3..8
    feature = SimpleNamespace(
        identifier="img", modality="image", mm_position=PlaceholderRange(2, 8, embed)
    )
    decode = RequestState(
        "d", [1, 2, 3], SamplingParams(), None, [1], 3, output_token_ids=[4]
    )
    prefill = RequestState(
        "p", list(range(10, 22)), SamplingParams(), None, [2, 3, 4], 5, [feature]
    )
    q = np.array([1, 7], np.int64)  # decode row 0, prefill positions 5..11
    states = [decode, prefill]
    cpu = torch.device("cpu")

    def exact(shape: object, n: int) -> tuple[object, int]:
        return shape, n

    plain = build_step(["d", "p"], states, q, exact, 4, cpu)  # type: ignore[arg-type]
    assert plain.attn_metadata.prefill.span_lo is None
    batch = build_step(
        ["d", "p"],
        states,
        q,
        exact,  # type: ignore[arg-type]
        4,
        cpu,
        bidirectional_images=True,
    )
    md = batch.attn_metadata
    assert md.prefill.span_lo is not None and md.prefill.span_hi is not None
    # Positions 5..8 are in the image (span [3, 9)); 9..11 are text.
    assert md.prefill.span_lo.tolist() == [[3, 3, 3, 3, 0, 0, 0]]
    assert md.prefill.span_hi.tolist() == [[9, 9, 9, 9, 0, 0, 0]]
