"""``ImageSlots``: the cross-attention cache's slots by image key.

A repeated image reuses its slot without an encode; slots are reference-counted;
only unreferenced (idle) images are evicted, least recently released first; a
cache whose every slot is referenced refuses a new image with a clear error;
``forget`` drops an image whose encode failed; slot 0 (the null slot padding
entries read) is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_hpu_mm.worker.cross_attention import NULL_SLOT, ImageSlots


def test_first_slots_are_one_to_capacity_never_zero() -> None:
    slots = ImageSlots(4)
    got = [slots.acquire(k) for k in "abcd"]
    assert all(new for _, new in got)
    assert sorted(s for s, _ in got) == [1, 2, 3, 4]
    assert NULL_SLOT == 0
    assert len(slots) == 4


def test_hit_reuses_the_slot_without_encode_and_counts_references() -> None:
    slots = ImageSlots(2)
    slot, new = slots.acquire("a")
    assert new
    assert slots.acquire("a") == (slot, False)
    assert slots.refs["a"] == 2
    slots.release("a")
    assert slots.refs["a"] == 1
    assert "a" not in slots.idle  # still referenced once
    slots.release("a")
    assert list(slots.idle) == ["a"]
    # Idle but filled: a later request still hits it, no encode.
    assert slots.acquire("a") == (slot, False)
    assert not slots.idle
    assert len(slots) == 1


def test_eviction_takes_the_least_recently_released_idle_image() -> None:
    slots = ImageSlots(3)
    s = {k: slots.acquire(k)[0] for k in "abc"}
    slots.release("b")
    slots.release("a")  # idle order: b, a; c stays referenced
    assert slots.acquire("d") == (s["b"], True)
    assert "b" not in slots.slot
    assert slots.acquire("a") == (s["a"], False)  # a was not evicted
    slots.release("a")
    slots.release("d")  # idle order: a, d
    assert slots.acquire("e") == (s["a"], True)
    assert slots.acquire("f") == (s["b"], True)  # d's slot (d had b's)
    assert set(slots.slot) == {"c", "e", "f"}


def test_reuse_moves_an_image_to_the_back_of_the_eviction_order() -> None:
    slots = ImageSlots(2)
    s = {k: slots.acquire(k)[0] for k in "ab"}
    slots.release("a")
    slots.release("b")  # idle: a, b
    slots.acquire("a")
    slots.release("a")  # idle: b, a
    assert slots.acquire("c") == (s["b"], True)
    assert "a" in slots.slot


def test_referenced_images_are_never_evicted_and_a_full_cache_raises() -> None:
    slots = ImageSlots(2)
    slots.acquire("a")
    slots.acquire("b")
    with pytest.raises(RuntimeError, match="cross-attention cache full"):
        slots.acquire("c")
    # Nothing changed: both images keep their slots, c got none.
    assert set(slots.slot) == {"a", "b"}
    assert slots.refs == {"a": 1, "b": 1}
    assert not slots.free
    slots.release("b")
    slot_b = slots.slot["b"]
    assert slots.acquire("c") == (slot_b, True)


def test_forget_frees_the_slot_and_the_next_acquire_encodes() -> None:
    slots = ImageSlots(2)
    slot, _ = slots.acquire("a")
    slots.forget("a")
    assert "a" not in slots.slot and "a" not in slots.refs
    assert len(slots) == 0
    assert slots.acquire("a") == (slot, True)


def test_forget_of_an_idle_image_leaves_it_out_of_the_eviction_order() -> None:
    slots = ImageSlots(2)
    slots.acquire("a")
    slots.acquire("b")
    slots.release("a")
    slots.forget("a")
    assert not slots.idle
    slots.acquire("c")  # takes a's freed slot, evicts nothing
    with pytest.raises(RuntimeError, match="cross-attention cache full"):
        slots.acquire("d")
    assert set(slots.slot) == {"b", "c"}


class SlotsMachine(RuleBasedStateMachine):
    """Random acquire/release/forget against a plain model of the rule."""

    CAPACITY = 3

    def __init__(self) -> None:
        super().__init__()
        self.slots = ImageSlots(self.CAPACITY)
        self.refs: dict[str, int] = {}  # images held by the model
        self.idle: OrderedDict[str, None] = OrderedDict()
        self.where: dict[str, int] = {}

    @rule(key=st.sampled_from("abcdef"))
    def acquire(self, key: str) -> None:
        full = len(self.refs) == self.CAPACITY and not self.idle
        if key not in self.refs and full:
            with pytest.raises(RuntimeError, match="cross-attention cache full"):
                self.slots.acquire(key)
            return
        slot, new = self.slots.acquire(key)
        assert slot != NULL_SLOT and 1 <= slot <= self.CAPACITY
        if key in self.refs:
            assert (slot, new) == (self.where[key], False)
            self.refs[key] += 1
            self.idle.pop(key, None)
            return
        assert new
        if len(self.refs) == self.CAPACITY:  # must evict the oldest idle image
            old, _ = self.idle.popitem(last=False)
            assert slot == self.where.pop(old)
            del self.refs[old]
        self.refs[key], self.where[key] = 1, slot

    @precondition(lambda self: any(n > 0 for n in self.refs.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, n in self.refs.items() if n)))
        self.slots.release(key)
        self.refs[key] -= 1
        if not self.refs[key]:
            self.idle[key] = None

    @precondition(lambda self: bool(self.refs))
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.refs)))
        self.slots.forget(key)
        del self.refs[key], self.where[key]
        self.idle.pop(key, None)

    @invariant()
    def agrees(self) -> None:
        assert self.slots.slot == self.where
        assert {k: n for k, n in self.slots.refs.items()} == self.refs
        assert list(self.slots.idle) == list(self.idle)
        held = list(self.where.values())
        assert len(set(held)) == len(held)  # no slot shared by two images
        assert sorted(held + self.slots.free) == list(range(1, self.CAPACITY + 1))


TestSlotsMachine = SlotsMachine.TestCase
TestSlotsMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
