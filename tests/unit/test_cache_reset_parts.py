"""The worker-side parts of a cache reset, on real small objects.

``ImageSlots.drop_idle`` frees exactly the slots no running request holds (a held
slot keeps its image: the request reads its K/V every step), and the freed slots
are handed out again, to be encoded anew; ``EncoderStore.clear`` empties the
encoder outputs. The engine-level behaviour (a reset, then a repeated image runs
the encoder again) is ``tests/e2e/test_encoder_cache_reset.py``.
"""

from __future__ import annotations

import torch

from vllm_hpu_mm.worker.cross_attention import ImageSlots
from vllm_hpu_mm.worker.encoder_store import EncoderStore


def test_drop_idle_frees_only_unreferenced_images() -> None:
    slots = ImageSlots(3)
    held, _ = slots.acquire("held")
    idle, _ = slots.acquire("idle")
    slots.release("idle")
    assert slots.drop_idle() == ["idle"]
    assert len(slots) == 1 and slots.slot == {"held": held}
    assert slots.acquire("held") == (held, False)  # still cached for its request
    again, new = slots.acquire("idle")
    assert new  # encoded again after the reset
    assert again in {idle, 3}  # a free slot, never slot 0
    assert slots.drop_idle() == []  # everything left is referenced


def test_release_after_drop_keeps_counts_consistent() -> None:
    slots = ImageSlots(2)
    slots.acquire("a")
    slots.drop_idle()  # "a" is held: not dropped
    slots.release("a")
    assert list(slots.idle) == ["a"]
    assert slots.drop_idle() == ["a"]
    assert len(slots) == 0 and sorted(slots.free) == [1, 2]


def test_encoder_cache_clear() -> None:
    cache = EncoderStore(8, 2, torch.float32, torch.device("cpu"))
    cache.put("x", torch.zeros(4, 2))
    cache.put("y", torch.zeros(4, 2))
    assert cache.clear() == 2
    assert "x" not in cache and "y" not in cache
    assert cache.clear() == 0
    cache.put("z", torch.ones(8, 2))  # the whole capacity is free again
    assert cache.first_row("z") == 1
