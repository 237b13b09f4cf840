"""The compiled merge: encoder-store rows into token embeddings by the maps.

Checked against a per-row Python reference; the split of a mixed step's maps
into its two passes; and, compiled, one graph per token shape whatever the
step's items (the maps and the store change values only).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hpu_mm.worker.encoder_store import SCRATCH_ROW
from vllm_hpu_mm.worker.graphs import CompileCounter
from vllm_hpu_mm.worker.merge import merge_map, merge_rows, split_maps, to_device

CPU = torch.device("cpu")
HIDDEN = 4
VOCAB = 50


def _embedding() -> torch.nn.Embedding:
    torch.manual_seed(0)
    return torch.nn.Embedding(VOCAB, HIDDEN)


def _store(rows: int, width: int) -> torch.Tensor:
    store = torch.randn(1 + rows, width)
    store[SCRATCH_ROW] = 0
    return store


def _reference(
    embed: torch.nn.Embedding,
    ids: torch.Tensor,
    store: torch.Tensor,
    entries: list[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    out = embed(ids).clone()
    extra = torch.zeros(ids.shape[0], store.shape[1] - HIDDEN)
    for src, dst in entries:
        out[dst] = store[src, :HIDDEN]
        extra[dst] = store[src, HIDDEN:]
    return out, extra


def _random_entries(rng: np.random.Generator, rows: int, store_rows: int) -> tuple:
    n = int(rng.integers(0, rows + 1))
    dst = rng.permutation(rows)[:n].astype(np.int64)
    src = rng.integers(1, store_rows + 1, n).astype(np.int64)
    return src, dst


@pytest.mark.parametrize("width", [HIDDEN, 3 * HIDDEN])  # plain, deep-stack
def test_merge_matches_the_per_row_reference(width: int) -> None:
    rng = np.random.default_rng(0)
    embed, store = _embedding(), _store(30, width)
    put = to_device(CPU)
    for _ in range(20):
        t = int(rng.integers(1, 17))
        ids = torch.from_numpy(rng.integers(0, VOCAB, t))
        src, dst = _random_entries(rng, t, 30)
        m = merge_map("mm.image", src, dst, t, put)
        assert m.rows == t and m.num_real == src.size
        got, extra = merge_rows(embed(ids), store, (m.src,), (m.dst,))
        want, want_extra = _reference(
            embed, ids, store, list(zip(src.tolist(), dst.tolist(), strict=True))
        )
        assert torch.equal(got, want)
        if width == HIDDEN:
            assert extra is None
        else:
            assert extra is not None and torch.equal(extra, want_extra)


def test_two_modalities_write_their_own_rows() -> None:
    embed, store = _embedding(), _store(10, HIDDEN)
    put = to_device(CPU)
    ids = torch.arange(6)
    image = merge_map("mm.image", np.array([3, 4]), np.array([1, 2]), 6, put)
    audio = merge_map("mm.audio", np.array([7]), np.array([5]), 6, put)
    got, _ = merge_rows(
        embed(ids), store, (image.src, audio.src), (image.dst, audio.dst)
    )
    want, _ = _reference(embed, ids, store, [(3, 1), (4, 2), (7, 5)])
    assert torch.equal(got, want)


def test_split_gives_each_pass_its_rows_from_zero() -> None:
    put = to_device(CPU)
    # Rows 0-1 are decode rows (row 1 a one-token chunk that is a placeholder),
    # rows 2-7 the prefill pass.
    m = merge_map("mm.image", np.array([5, 6, 7, 8]), np.array([1, 3, 4, 7]), 8, put)
    (dec, pre) = (p["image"] for p in split_maps({"image": m}, 2))
    assert dec.src.tolist() == [5, SCRATCH_ROW]
    assert dec.dst.tolist() == [1, 2]  # padding writes row 2, past the pass
    assert pre.src.tolist() == [6, 7, 8, 0, 0, 0]
    assert pre.dst.tolist() == [1, 2, 5, 6, 6, 6]
    embed, store = _embedding(), _store(10, HIDDEN)
    ids = torch.arange(8)
    whole, _ = merge_rows(embed(ids), store, (m.src,), (m.dst,))
    parts = [
        merge_rows(embed(ids[a:b]), store, (p.src,), (p.dst,))[0]
        for p, (a, b) in ((dec, (0, 2)), (pre, (2, 8)))
    ]
    assert torch.equal(torch.cat(parts), whole)


def test_bad_maps_are_refused() -> None:
    put = to_device(CPU)
    with pytest.raises(ValueError, match="3 placeholder entries for a pass of 2"):
        merge_map("m", np.zeros(3, np.int64), np.arange(3), 2, put)
    with pytest.raises(ValueError, match="outside pass rows"):
        merge_map("m", np.zeros(1, np.int64), np.array([4]), 4, put)


def test_compiled_merge_is_one_graph_per_token_shape() -> None:
    """Different items, entry counts and store contents at the same token
    count reuse one graph; a new token count is a new graph."""
    counter = CompileCounter("eager")
    merge = torch.compile(merge_rows, backend=counter, dynamic=False)
    rng = np.random.default_rng(1)
    embed, put = _embedding(), to_device(CPU)
    store = _store(30, HIDDEN)
    for t in (8, 8, 8, 16, 16, 8):
        ids = torch.from_numpy(rng.integers(0, VOCAB, t))
        src, dst = _random_entries(rng, t, 30)
        m = merge_map("mm.image", src, dst, t, put)
        store[1:] = torch.randn(30, HIDDEN)
        got, _ = merge(embed(ids), store, (m.src,), (m.dst,))
        want, _ = _reference(
            embed, ids, store, list(zip(src.tolist(), dst.tolist(), strict=True))
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counter.count == 2
