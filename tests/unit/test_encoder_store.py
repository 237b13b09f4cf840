"""The encoder store: items in consecutive rows of one preallocated tensor.

Checked against a plain dict of the outputs it was given: every live item
reads back exactly, whatever order items come and go in (including the
compactions that variable-sized items force), no two live items share a row,
and row 0 stays the zero scratch row.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_hpu_mm.worker.encoder_store import SCRATCH_ROW, EncoderStore

CPU = torch.device("cpu")


def _output(seed: int, rows: int, width: int = 3) -> torch.Tensor:
    return torch.arange(rows * width, dtype=torch.float32).view(rows, width) + (
        1000.0 * seed
    )


def _check(store: EncoderStore, want: dict[str, torch.Tensor]) -> None:
    assert set(store.items) == set(want)
    taken: set[int] = set()
    for key, out in want.items():
        assert torch.equal(store[key], out), key
        start, n = store.items[key]
        rows = set(range(start, start + n))
        assert not rows & taken, f"{key} overlaps another item"
        assert SCRATCH_ROW not in rows
        taken |= rows
    assert torch.count_nonzero(store.rows[SCRATCH_ROW]) == 0


def test_put_free_and_reuse() -> None:
    store = EncoderStore(10, 3, torch.float32, CPU)
    store.put("a", _output(1, 4))
    store.put("b", _output(2, 4))
    assert (store.first_row("a"), store.first_row("b")) == (1, 5)
    store.free(["a"])
    store.put("c", _output(3, 3))  # first fit: a's old rows
    assert store.first_row("c") == 1
    _check(store, {"b": _output(2, 4), "c": _output(3, 3)})
    store.free(["b", "c", "never-put"])
    assert store._free == [(1, 10)]  # the three ranges joined back into one


def test_fragmented_rows_are_compacted_not_grown() -> None:
    store = EncoderStore(8, 3, torch.float32, CPU)
    for i, key in enumerate("abcd"):
        store.put(key, _output(i, 2))
    store.free(["a", "c"])  # free rows: 1-2 and 5-6, no run of 4
    store.put("e", _output(9, 4))
    assert store.capacity == 8, "a fitting item must not grow the store"
    _check(store, {"b": _output(1, 2), "d": _output(3, 2), "e": _output(9, 4)})


def test_an_item_beyond_capacity_grows_the_store() -> None:
    store = EncoderStore(4, 3, torch.float32, CPU)
    store.put("a", _output(1, 3))
    store.put("b", _output(2, 3))
    assert store.capacity >= 6
    _check(store, {"a": _output(1, 3), "b": _output(2, 3)})


def test_wrong_width_is_refused_with_the_sizes() -> None:
    store = EncoderStore(4, 3, torch.float32, CPU)
    with pytest.raises(RuntimeError, match=r"5 wide.*sized for 3"):
        store.put("a", torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="never computed or was already freed"):
        store.first_row("a")


def test_outputs_are_cast_to_the_store_dtype_and_flattened() -> None:
    store = EncoderStore(8, 3, torch.bfloat16, CPU)
    store.put("a", _output(0, 4).view(2, 2, 3))
    assert store["a"].dtype == torch.bfloat16
    assert torch.equal(store["a"], _output(0, 4).to(torch.bfloat16))


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_every_live_item(seed: int) -> None:
    """Puts and frees of items of 1-9 rows, keeping the live total within
    capacity as vLLM's encoder cache manager does: the store never grows."""
    rng = random.Random(seed)
    store = EncoderStore(24, 3, torch.float32, CPU)
    want: dict[str, torch.Tensor] = {}
    for step in range(200):
        live = sum(v.shape[0] for v in want.values())
        n = rng.randint(1, 9)
        if want and (rng.random() < 0.4 or live + n > 24):
            victims = rng.sample(sorted(want), rng.randint(1, len(want)))
            store.free(victims)
            for v in victims:
                del want[v]
            continue
        key = f"i{step}"
        want[key] = _output(step, n)
        store.put(key, want[key])
        _check(store, want)
    assert store.capacity == 24
