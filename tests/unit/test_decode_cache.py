"""The dense decode cache against the per-request float64 reference.

A simulated run over several steps: requests own random, non-contiguous blocks
of a paged cache (the source of truth, written with ``write_kv`` as the
backend does); each step some of them decode one token, in a shuffled order,
some join (their earlier positions exist only in the paged cache), some skip a
step, some prefill again (their slot must be dropped and rebuilt) or finish.
``DecodeCache.plan`` and ``dense_decode_attention`` must give, every step,
what attention over each request's whole true K/V gives.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpu_kernels.attention import kv_cache_of_stacked
from tests.stacked_kv import dense_decode_attention, write_kv
from tests.unit.test_attention_kernels import ATOL, HEAD, RTOL, reference_attention
from vllm_hpu_mm.attention.decode_cache import DecodeCache

BLOCK = 4
MAX_LEN = 40


class World:
    """Requests with true K/V, a paged cache holding them, and a dense cache."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, slots: int, seed: int = 0
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.h, self.hkv = num_heads, num_kv_heads
        num_blocks = 64
        # Garbage everywhere: a read of a wrong slot shows as a mismatch.
        self.paged = torch.randn(
            2, num_blocks, BLOCK, num_kv_heads, HEAD, generator=self.gen
        )
        self.free = (torch.randperm(num_blocks - 1, generator=self.gen) + 1).tolist()
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.blocks: dict[str, list[int]] = {}
        self.cache = DecodeCache(slots, MAX_LEN, BLOCK, torch.device("cpu"))

    def _append(self, req: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.randn(n, self.hkv, HEAD, generator=self.gen)
        v = torch.randn(n, self.hkv, HEAD, generator=self.gen)
        self.keys[req] = torch.cat([self.keys.get(req, k[:0]), k])
        self.values[req] = torch.cat([self.values.get(req, v[:0]), v])
        need = -(-len(self.keys[req]) // BLOCK)
        blocks = self.blocks.setdefault(req, [])
        while len(blocks) < need:
            blocks.append(self.free.pop())
        return k, v

    def _slots(self, req: str, first: int, n: int) -> torch.Tensor:
        b = self.blocks[req]
        return torch.tensor(
            [b[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + n)],
            dtype=torch.int64,
        )

    def prefill(self, req: str, n: int, fresh: bool = False) -> None:
        """Write n more prompt tokens of ``req`` (fresh: its old K/V are
        recomputed from scratch, as after preemption)."""
        if fresh:
            self.free += self.blocks.pop(req, [])
            self.keys.pop(req, None)
            self.values.pop(req, None)
        first = len(self.keys.get(req, ()))
        k, v = self._append(req, n)
        write_kv(self.paged, k, v, self._slots(req, first, n))

    def decode(self, reqs: list[str], prefills: list[str], window: int | None) -> None:
        """One decode step of ``reqs`` (in that row order), checked."""
        news = [self._append(r, 1) for r in reqs]
        k = torch.cat([n[0] for n in news])
        v = torch.cat([n[1] for n in news])
        lens = np.array([len(self.keys[r]) for r in reqs], np.int64)
        slots = torch.cat(
            [self._slots(r, int(n) - 1, 1) for r, n in zip(reqs, lens, strict=True)]
        )
        write_kv(self.paged, k, v, slots)
        step = self.cache.plan(reqs, lens, [self.blocks[r] for r in reqs], prefills)
        assert step is not None
        q = torch.randn(len(reqs), self.h, HEAD, generator=self.gen)
        scale = 1 / math.sqrt(HEAD)
        out = dense_decode_attention(
            q,
            k,
            v,
            self.paged,
            self.cache.tensor_for(kv_cache_of_stacked(self.paged)),
            step.slots,
            step.positions,
            step.fill_slots,
            step.fill_blocks,
            step.mask(window),
            scale,
        )
        for i, r in enumerate(reqs):
            expected = reference_attention(
                q[i : i + 1],
                self.keys[r],
                self.values[r],
                [int(lens[i]) - 1],
                scale,
                window,
            )
            torch.testing.assert_close(
                out[i : i + 1].double(), expected, atol=ATOL, rtol=RTOL
            )


HEADS = [(4, 2), (4, 1), (2, 2)]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_dense_decode_over_a_run_matches_reference(
    num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    w = World(num_heads, num_kv_heads, slots=4)
    for r, n in (("a", 5), ("b", 8), ("c", 1)):
        w.prefill(r, n)
    w.decode(["a", "b", "c"], [], window)  # all three copied in
    assert w.cache.fills == 3
    w.decode(["b", "a", "c"], [], window)  # appended, rows reordered
    w.decode(["c", "a"], [], window)  # b skips a step, keeps its slot
    w.decode(["a", "b", "c"], [], window)  # b's slot still holds all of b
    assert w.cache.fills == 3
    w.prefill("d", 11)
    w.decode(["d", "a"], ["b"], window)  # b prefills again: slot dropped
    w.prefill("b", 3, fresh=True)  # recomputed, new values and blocks
    w.decode(["a", "b", "c", "d"], [], window)
    w.cache.drop("c")  # finished
    w.prefill("e", 2)
    w.decode(["e", "d", "b", "a"], [], window)  # e takes c's slot
    assert w.cache.active == 4
    assert w.cache.fills == 6  # d, b again, e
    for _ in range(4):
        w.decode(["a", "b", "d", "e"], [], window)


def test_a_full_cache_evicts_a_request_not_in_the_step() -> None:
    w = World(2, 1, slots=2)
    for r in ("a", "b", "c"):
        w.prefill(r, 3)
    w.decode(["a", "b"], [], None)
    w.decode(["c", "a"], [], None)  # b (preempted, say) loses its slot
    assert w.cache.active == 2
    w.decode(["b", "a"], [], None)  # b comes back: rebuilt from the paged cache
    assert w.cache.fills == 4


def test_a_slot_reused_after_a_nan_request_reads_none_of_its_keys() -> None:
    # Issue 34: a request whose K/V were NaN (a bf16 Mllama image request
    # whose encoder returned NaN) left them in its slot past the next
    # occupant's length. Masked keys get zero weight, but 0 * NaN is NaN in
    # the P @ V product: the text-only request that took the slot answered
    # garbage (token 1 mid-answer).
    w = World(2, 1, slots=1)
    w.prefill("a", 30)
    w.decode(["a"], [], None)
    dense = w.cache.tensor_for(kv_cache_of_stacked(w.paged))
    dense.fill_(float("nan"))  # a's K/V, every position of its slot
    w.cache.drop("a")
    w.prefill("b", 3)
    w.decode(["b"], [], None)  # b's keys are rebuilt into the slot: finite
    w.decode(["b"], [], None)


def test_one_token_prompt_needs_no_copy() -> None:
    w = World(2, 2, slots=2)
    w.prefill("a", 0)
    w.decode(["a"], [], None)  # position 0 is this step's token
    assert w.cache.fills == 0
    w.decode(["a"], [], None)


def test_plan_refuses_what_does_not_fit() -> None:
    cache = DecodeCache(2, MAX_LEN, BLOCK, torch.device("cpu"))
    assert cache.plan([], np.zeros(0, np.int64), [], ["x"]) is None
    with pytest.raises(ValueError, match="3 decode rows but 2 slots"):
        cache.plan(["a", "b", "c"], np.ones(3, np.int64), [[1], [2], [3]])
    with pytest.raises(ValueError, match="exceeds the dense decode cache's 40"):
        cache.plan(["a"], np.array([41]), [list(range(1, 12))])
    with pytest.raises(ValueError, match="num_slots"):
        DecodeCache(0, MAX_LEN, BLOCK, torch.device("cpu"))


def test_mask_keeps_key_zero_of_free_slots_and_applies_the_window() -> None:
    cache = DecodeCache(4, MAX_LEN, BLOCK, torch.device("cpu"))
    step = cache.plan(["a", "b"], np.array([3, 9]), [[1], [2, 3, 4]])
    assert step is not None
    assert step.slots.tolist() == [0, 1]
    mask = step.mask(None)[:, 0, 0]
    assert mask.shape == (2, 40)  # 9 rounded up to 64, capped at the 40 held
    assert mask[0].nonzero().ravel().tolist() == [0, 1, 2]
    assert mask[1].nonzero().ravel().tolist() == list(range(9))
    windowed = step.mask(4)[:, 0, 0]
    assert windowed[1].nonzero().ravel().tolist() == [5, 6, 7, 8]
    cache.drop("a")
    step = cache.plan(["b"], np.array([10]), [[2, 3, 4]])
    assert step is not None
    free = step.mask(None)[0, 0, 0]  # slot 0 is free: it keeps key 0 only
    assert free.nonzero().ravel().tolist() == [0]


def test_bytes_per_layer() -> None:
    paged = kv_cache_of_stacked(torch.zeros(2, 10, 16, 4, 64, dtype=torch.bfloat16))
    # 2 (K, V) x 32 slots x 4 heads x 320 tokens (300 rounded to blocks) x 64 x 2 B
    assert DecodeCache.bytes_per_layer(32, 300, 16, paged) == 2 * 32 * 4 * 304 * 64 * 2


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    steps=st.lists(
        st.lists(st.sampled_from("abcde"), min_size=1, max_size=5, unique=True),
        min_size=1,
        max_size=8,
    ),
    restarts=st.lists(st.sampled_from("abcde"), max_size=3),
)
def test_random_runs_match_reference(
    seed: int, steps: list[list[str]], restarts: list[str]
) -> None:
    """Random decode sets per step (joining, skipping, reordering), with a
    request now and then recomputed from scratch and its slot dropped."""
    w = World(4, 2, slots=5, seed=seed)
    rng = np.random.default_rng(seed)
    for r in "abcde":
        w.prefill(r, int(rng.integers(0, 7)))
    for i, reqs in enumerate(steps):
        prefills = []
        if i < len(restarts) and restarts[i] not in reqs:
            prefills = [restarts[i]]
            w.prefill(restarts[i], int(rng.integers(1, 5)), fresh=True)
        w.decode(reqs, prefills, None)
