"""Which image tiles each token reads: the plugin's rule against transformers'.

The oracle is transformers' own code: ``get_cross_attention_token_mask`` and
``convert_sparse_cross_attention_mask_to_dense`` (``processing_mllama``) build the
prompt's dense [tokens, images, tiles] mask; generation extends it by repeating
its last row for every new token (``_update_model_kwargs_for_generation``); and
``_prepare_cross_attention_mask`` (``modeling_mllama``) turns it into the additive
bias and ``full_text_row_masked_out_mask`` the cross-attention layers use. The
plugin's ``image_groups`` / ``tile_mask`` must give the same reads for prompt
and decode positions, the same masked-out rows, and read every row of every
image on a masked-out row (HF's bias row there is all zero).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask
from transformers.models.mllama.processing_mllama import (
    convert_sparse_cross_attention_mask_to_dense,
    get_cross_attention_token_mask,
)

from vllm_hpu_mm.worker.cross_attention import RequestImage, image_groups, tile_mask

IMAGE_ID = 1000
MAX_TILES = 4
ROWS_PER_TILE = 3  # vision rows per tile in the widened HF bias (any value works)


@st.composite
def prompts(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """(token ids with <|image|> tokens, tiles per image, decode steps after)."""
    num_images = draw(st.integers(1, 5))
    # gap 0: the image token follows the previous one at once (a group).
    lead = draw(st.integers(0, 4))
    gaps = draw(
        st.lists(st.integers(0, 4), min_size=num_images - 1, max_size=num_images - 1)
    )
    tail = draw(st.integers(0, 5))
    ids: list[int] = draw(st.lists(st.integers(0, 99), min_size=lead, max_size=lead))
    for i in range(num_images):
        if i:
            ids += draw(
                st.lists(st.integers(0, 99), min_size=gaps[i - 1], max_size=gaps[i - 1])
            )
        ids.append(IMAGE_ID)
    ids += draw(st.lists(st.integers(0, 99), min_size=tail, max_size=tail))
    tiles = draw(
        st.lists(st.integers(1, MAX_TILES), min_size=num_images, max_size=num_images)
    )
    decode = draw(st.integers(0, 4))
    return ids, tiles, decode


def hf_masks(
    ids: list[int], tiles: list[int], decode: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HF's (dense [P, M, tiles] mask, bias [P, M*tiles*rows], row kept [P]).

    P = prompt length + ``decode`` generated tokens, each new row a copy of the
    last one, as HF's generation does.
    """
    sparse = get_cross_attention_token_mask(ids, IMAGE_ID)
    dense = convert_sparse_cross_attention_mask_to_dense(
        [sparse], num_tiles=[tiles], max_num_tiles=MAX_TILES, length=len(ids)
    )
    mask = torch.as_tensor(dense)
    for _ in range(decode):
        mask = torch.cat([mask, mask[:, -1:, ...]], dim=1)
    # HF annotates dtype as str but calls torch.finfo on it (its model passes a dtype).
    bias, kept = _prepare_cross_attention_mask(
        mask,
        ROWS_PER_TILE,
        torch.float32,  # type: ignore[arg-type]
    )
    return mask[0].numpy(), bias[0, 0].numpy(), kept[0, 0, :, 0].numpy()


def plugin_masks(
    ids: list[int], tiles: list[int], positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    offsets = [i for i, t in enumerate(ids) if t == IMAGE_ID]
    images = [
        RequestImage(f"img{i}", off, n)
        for i, (off, n) in enumerate(zip(offsets, tiles, strict=True))
    ]
    return tile_mask(images, positions, MAX_TILES)


def check_against_hf(ids: list[int], tiles: list[int], decode: int) -> None:
    dense, bias, kept = hf_masks(ids, tiles, decode)
    total = len(ids) + decode
    mask, masked_out = plugin_masks(ids, tiles, np.arange(total))
    m = len(tiles)
    assert mask.shape == (total, m, MAX_TILES)
    assert masked_out.shape == (total,)

    # Masked-out rows are exactly HF's full_text_row_masked_out rows (value 0),
    # and those are exactly the tokens before the first image.
    first = ids.index(IMAGE_ID)
    np.testing.assert_array_equal(masked_out, kept == 0)
    np.testing.assert_array_equal(masked_out, np.arange(total) < first)

    # What a token reads = where HF's additive bias is 0 (widened to rows).
    reads = (bias == 0).reshape(total, m, MAX_TILES, ROWS_PER_TILE)
    assert (reads == reads[..., :1]).all()  # a tile is read whole or not at all
    np.testing.assert_array_equal(mask, reads[..., 0])

    # Rows that are not masked out read exactly HF's dense mask; masked-out rows
    # read every tile of every image, padding tiles included (all-zero bias).
    live = ~masked_out
    np.testing.assert_array_equal(mask[live], dense[live].astype(bool))
    assert mask[masked_out].all()
    assert (bias[masked_out] == 0).all()


@settings(max_examples=400, deadline=None)
@given(prompts())
@example(([IMAGE_ID], [1], 0))  # the prompt is one image token
@example(([IMAGE_ID], [4], 3))
@example(([5, 6, IMAGE_ID, IMAGE_ID], [2, 3], 2))  # group at the end
@example(([IMAGE_ID, IMAGE_ID, 7, IMAGE_ID, 8], [1, 2, 3], 2))
@example(([3, IMAGE_ID, 7, IMAGE_ID, IMAGE_ID, 9, IMAGE_ID], [4, 1, 2, 3], 1))
@example(([1, 2, 3, IMAGE_ID, 4, IMAGE_ID], [2, 2], 3))  # last image at the end
def test_tile_mask_matches_transformers(
    prompt: tuple[list[int], list[int], int],
) -> None:
    check_against_hf(*prompt)


@settings(max_examples=200, deadline=None)
@given(prompts(), st.data())
def test_tile_mask_of_a_chunk_is_the_slice_of_the_whole(
    prompt: tuple[list[int], list[int], int], data: st.DataObject
) -> None:
    """The runner asks for the step's positions only (chunked prefill, decode)."""
    ids, tiles, decode = prompt
    total = len(ids) + decode
    start = data.draw(st.integers(0, total - 1))
    stop = data.draw(st.integers(start + 1, total))
    whole, whole_out = plugin_masks(ids, tiles, np.arange(total))
    part, part_out = plugin_masks(ids, tiles, np.arange(start, stop))
    np.testing.assert_array_equal(part, whole[start:stop])
    np.testing.assert_array_equal(part_out, whole_out[start:stop])


@settings(max_examples=300, deadline=None)
@given(prompts())
def test_image_groups_match_transformers_ranges(
    prompt: tuple[list[int], list[int], int],
) -> None:
    ids, _, _ = prompt
    offsets = [i for i, t in enumerate(ids) if t == IMAGE_ID]
    sparse = get_cross_attention_token_mask(ids, IMAGE_ID)
    # HF ends at the prompt's end (-1 or len) where the plugin reads on forever.
    want = [(s, len(ids) if e in (-1, len(ids)) else e) for s, e in sparse]
    got = [
        (s, len(ids) if e == float("inf") else int(e)) for s, e in image_groups(offsets)
    ]
    assert got == want
    # Reading to the end is the plugin's infinity, never a finite prompt length.
    assert all(e == float("inf") or e < len(ids) for _, e in image_groups(offsets))


@pytest.mark.parametrize(
    ("offsets", "want"),
    [
        ([4], [(4, float("inf"))]),
        ([2, 5, 6], [(2, 5), (5, float("inf")), (6, float("inf"))]),
        ([0, 1, 3, 4, 9], [(0, 3), (1, 3), (3, 9), (4, 9), (9, float("inf"))]),
    ],
)
def test_image_groups_examples(
    offsets: list[int], want: list[tuple[int, float]]
) -> None:
    assert image_groups(offsets) == want
