"""The runner's step inputs: RequestState.token_ids, order_requests, gather_step
and build_step, on hand-built RequestState objects (no engine)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams

from vllm_hpu_mm.attention.metadata import (
    DynamicAttentionMetadata,
    PrefillRequests,
    StaticAttentionMetadata,
    StepShape,
    build_metadata,
)
from vllm_hpu_mm.worker.inputs import build_step, gather_step, order_requests
from vllm_hpu_mm.worker.requests import RequestState

CPU = torch.device("cpu")
BS = 4


def state(
    req_id: str,
    prompt: list[int],
    output: list[int],
    computed: int,
    blocks: list[int],
) -> RequestState:
    return RequestState(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(),
        generator=None,
        block_ids=list(blocks),
        num_computed_tokens=computed,
        output_token_ids=list(output),
    )


def i64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# ----------------------------------------------------------------------------
# RequestState.token_ids
# ----------------------------------------------------------------------------


def test_token_ids_prompt_output_and_across_the_boundary() -> None:
    s = state("r", [10, 11, 12, 13, 14, 15], [100, 101, 102], 0, [])
    assert s.num_prompt_tokens == 6
    assert s.num_tokens == 9
    assert s.token_ids(0, 3) == [10, 11, 12]
    assert s.token_ids(2, 6) == [12, 13, 14, 15]
    assert s.token_ids(4, 8) == [14, 15, 100, 101]
    assert s.token_ids(5, 7) == [15, 100]
    assert s.token_ids(6, 9) == [100, 101, 102]
    assert s.token_ids(8, 9) == [102]
    assert s.token_ids(0, 9) == [10, 11, 12, 13, 14, 15, 100, 101, 102]
    assert s.token_ids(3, 3) == []


# ----------------------------------------------------------------------------
# order_requests
# ----------------------------------------------------------------------------


def test_order_requests_decodes_first_in_scheduler_order() -> None:
    sched = {"a": 5, "b": 1, "c": 1, "d": 3, "e": 1, "f": 2}
    assert order_requests(sched) == ["b", "c", "e", "a", "d", "f"]
    assert order_requests({"x": 1, "y": 1}) == ["x", "y"]
    assert order_requests({"y": 7, "x": 4}) == ["y", "x"]
    assert order_requests({}) == []


# ----------------------------------------------------------------------------
# Hand-worked step (block size 4)
#
#   id     prompt              output        computed  sched  blocks
#   span   21..26 (6 tokens)   61, 62, 63    4         5      [5, 1, 9]
#   dec    11..15 (5 tokens)   51, 52        6         1      [8, 3]
#   fresh  31..37 (7 tokens)   -             0         3      [2, 7]
#   dec2   41, 42, 43          71            3         1      [6]
#
# span's tokens (positions 4..8) run across the prompt/output boundary:
# 25, 26, 61, 62, 63 at slots 1*4+0..3 = 4..7, then 9*4+0 = 36.
# dec: position 6 -> token 52, slot 3*4+2 = 14.  dec2: position 3 -> 71, slot 27.
# fresh: positions 0..2 -> 31..33, slots 8..10.
# ----------------------------------------------------------------------------


def hand_states() -> dict[str, RequestState]:
    return {
        "span": state("span", [21, 22, 23, 24, 25, 26], [61, 62, 63], 4, [5, 1, 9]),
        "dec": state("dec", [11, 12, 13, 14, 15], [51, 52], 6, [8, 3]),
        "fresh": state("fresh", [31, 32, 33, 34, 35, 36, 37], [], 0, [2, 7]),
        "dec2": state("dec2", [41, 42, 43], [71], 3, [6]),
    }


SCHEDULED = {"span": 5, "dec": 1, "fresh": 3, "dec2": 1}


def test_gather_step_hand_worked() -> None:
    states = hand_states()
    order = ["dec", "span", "fresh"]
    q = np.array([1, 5, 3], np.int64)
    token_ids, positions, slots, seq_lens, table = gather_step(
        [states[r] for r in order], q, BS
    )
    assert token_ids.tolist() == [52, 25, 26, 61, 62, 63, 31, 32, 33]
    assert positions.tolist() == [6, 4, 5, 6, 7, 8, 0, 1, 2]
    assert slots.tolist() == [14, 4, 5, 6, 7, 36, 8, 9, 10]
    assert seq_lens.tolist() == [7, 9, 3]
    assert table.tolist() == [[8, 3, 0], [5, 1, 9], [2, 7, 0]]
    for a in (token_ids, positions, slots, seq_lens, table):
        assert a.dtype == np.int64


def test_build_step_hand_worked() -> None:
    states = hand_states()
    req_ids = order_requests(SCHEDULED)
    assert req_ids == ["dec", "dec2", "span", "fresh"]
    q = np.array([SCHEDULED[r] for r in req_ids], np.int64)
    seen: list[tuple[StepShape, int]] = []
    bucket = StepShape(
        num_decodes=4, decode_blocks=4, num_prefill_tokens=16, prefill_blocks=8
    )

    def shape_for(exact: StepShape, num_reqs: int) -> tuple[StepShape, int]:
        seen.append((exact, num_reqs))
        return bucket, 6

    batch = build_step(req_ids, [states[r] for r in req_ids], q, shape_for, BS, CPU)

    # Decode blocks: the flat list of the decodes' real blocks (2 + 1); prefill
    # blocks: one tile holds all 8 rows and reads span's 3 blocks + fresh's 1.
    assert seen == [(StepShape(2, 3, 8, 4), 4)]
    assert batch.shape == bucket
    assert batch.req_ids == req_ids
    assert batch.num_reqs == 4
    assert batch.num_real_tokens == 10
    assert batch.query_lens.tolist() == [1, 1, 5, 3]
    assert batch.seq_lens.tolist() == [7, 4, 9, 3]
    # Rows: decodes 0, 1 (2, 3 pad), prefill from row 4: span 4..8, fresh 9..11.
    assert torch.equal(
        batch.input_ids, i64(52, 71, 0, 0, 25, 26, 61, 62, 63, 31, 32, 33, *[0] * 8)
    )
    assert torch.equal(
        batch.positions, i64(6, 3, 0, 0, 4, 5, 6, 7, 8, 0, 1, 2, *[0] * 8)
    )
    # Six logits rows (the batch bucket): the four requests' last tokens, then
    # padding entries pointing at row 0.
    assert torch.equal(batch.logits_rows, i64(0, 1, 8, 11, 0, 0))

    md = batch.attn_metadata
    assert torch.equal(
        md.slot_mapping, i64(14, 27, 0, 0, 4, 5, 6, 7, 36, 8, 9, 10, *[0] * 8)
    )
    assert isinstance(md, StaticAttentionMetadata)
    assert torch.equal(md.decode.block_list, i64(8, 3, 6, 0))
    assert torch.equal(md.decode.block_req, i64(0, 0, 1, 3))
    assert md.decode.block_mapping.tolist() == [
        [1, 1, 0, 0],
        [0, 0, 1, 0],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
    ]
    assert torch.equal(md.decode.seq_lens, i64(7, 4, 0, 0))
    # dec: positions 0..6 of blocks 8, 3 visible; dec2: 0..3 of block 6.
    visible = (md.decode.block_bias == 0).tolist()
    assert visible[:3] == [[True] * 4, [True, True, True, False], [True] * 4]
    assert visible[3] == [False] * 4
    # One tile of 16 rows over 8 blocks: span's blocks, fresh's, padding.
    assert torch.equal(md.prefill.blocks, i64(5, 1, 9, 2, 0, 0, 0, 0)[None])
    pad = -(2**40)
    assert md.prefill.query_pos.tolist() == [[4, 5, 6, 7, 8, 0, 1, 2, *[pad] * 8]]
    mask = md.prefill.mask[0]  # [16 rows, 32 keys]
    assert mask[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # span pos 4
    assert mask[4].nonzero().flatten().tolist() == list(range(9))  # span pos 8
    assert mask[5].nonzero().flatten().tolist() == [12]  # fresh pos 0
    assert mask[7].nonzero().flatten().tolist() == [12, 13, 14]  # fresh pos 2
    assert all(mask[r].nonzero().flatten().tolist() == [0] for r in range(8, 16))

    dynamic = build_step(
        req_ids,
        [states[r] for r in req_ids],
        q,
        lambda exact, n: (bucket, 6),
        BS,
        CPU,
        kind="dynamic",
    )
    dmd = dynamic.attn_metadata
    assert isinstance(dmd, DynamicAttentionMetadata)
    # The real decode rows over their widest row's 2 blocks.
    assert torch.equal(dmd.decode_block_table, torch.tensor([[8, 3], [6, 0]]))
    assert torch.equal(dmd.slot_mapping, md.slot_mapping)
    assert isinstance(dmd.prefill, PrefillRequests)


def test_build_step_exact_bucket() -> None:
    states = hand_states()
    req_ids = order_requests(SCHEDULED)
    q = np.array([SCHEDULED[r] for r in req_ids], np.int64)
    batch = build_step(
        req_ids, [states[r] for r in req_ids], q, lambda s, n: (s, n), BS, CPU
    )
    assert batch.shape == StepShape(2, 3, 8, 4)
    assert batch.input_ids.tolist() == [52, 71, 25, 26, 61, 62, 63, 31, 32, 33]
    assert batch.positions.tolist() == [6, 3, 4, 5, 6, 7, 8, 0, 1, 2]
    assert batch.logits_rows.tolist() == [0, 1, 6, 9]


@pytest.mark.parametrize(
    "name", ["num_decodes", "decode_blocks", "num_prefill_tokens", "prefill_blocks"]
)
def test_build_step_too_small_bucket_raises(name: str) -> None:
    """A bucket smaller than the step is refused with build_metadata's error."""
    states = hand_states()
    req_ids = order_requests(SCHEDULED)
    q = np.array([SCHEDULED[r] for r in req_ids], np.int64)

    def shape_for(exact: StepShape, num_reqs: int) -> tuple[StepShape, int]:
        fields = {f: getattr(exact, f) for f in exact.__slots__}
        fields[name] -= 1
        return StepShape(**fields), num_reqs

    with pytest.raises(ValueError, match=f"needs {name}="):
        build_step(req_ids, [states[r] for r in req_ids], q, shape_for, BS, CPU)


# ----------------------------------------------------------------------------
# Property tests
# ----------------------------------------------------------------------------


@st.composite
def steps(draw: st.DrawFn) -> tuple[dict[str, int], dict[str, RequestState], int]:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    n = draw(st.integers(1, 6))
    next_block = iter(draw(st.permutations(range(1, 400))))
    sched: dict[str, int] = {}
    states: dict[str, RequestState] = {}
    for i in range(n):
        decode = draw(st.booleans())
        n_prompt = draw(st.integers(1, 30))
        n_out = draw(st.integers(0, 6))
        total = n_prompt + n_out
        if decode:
            computed, query = total - 1, 1
        else:
            computed = draw(st.integers(0, total - 1))
            query = draw(st.integers(1, total - computed))
        n_blocks = math.ceil((computed + query) / bs) + draw(st.integers(0, 2))
        base = 1000 * (i + 1)
        prompt = list(range(base, base + n_prompt))
        output = list(range(base + 500, base + 500 + n_out))
        rid = f"r{i}"
        blocks = [next(next_block) for _ in range(n_blocks)]
        states[rid] = state(rid, prompt, output, computed, blocks)
        sched[rid] = query
    return sched, states, bs


@settings(max_examples=150, deadline=None)
@given(steps(), st.integers(0, 3))
def test_gather_and_build_step_properties(
    step: tuple[dict[str, int], dict[str, RequestState], int], pad: int
) -> None:
    sched, states, bs = step
    req_ids = order_requests(sched)
    assert sorted(req_ids) == sorted(sched)
    n_dec = sum(1 for n in sched.values() if n == 1)
    assert all(sched[r] == 1 for r in req_ids[:n_dec])
    assert [r for r in sched if sched[r] == 1] == req_ids[:n_dec]
    assert [r for r in sched if sched[r] != 1] == req_ids[n_dec:]

    batch_states = [states[r] for r in req_ids]
    q = np.array([sched[r] for r in req_ids], np.int64)

    # Reference: a per-request loop.
    ref_ids, ref_pos, ref_slots, ref_req = [], [], [], []
    for r, s in enumerate(batch_states):
        everything = s.prompt_token_ids + s.output_token_ids
        for p in range(s.num_computed_tokens, s.num_computed_tokens + int(q[r])):
            ref_ids.append(everything[p])
            ref_pos.append(p)
            ref_slots.append(s.block_ids[p // bs] * bs + p % bs)
            ref_req.append(r)

    token_ids, positions, slots, seq_lens, table = gather_step(batch_states, q, bs)
    assert token_ids.tolist() == ref_ids
    assert positions.tolist() == ref_pos
    assert slots.tolist() == ref_slots
    assert seq_lens.tolist() == [
        s.num_computed_tokens + int(n) for s, n in zip(batch_states, q, strict=True)
    ]
    for r, s in enumerate(batch_states):
        assert table[r, : len(s.block_ids)].tolist() == s.block_ids
        assert np.all(table[r, len(s.block_ids) :] == 0)

    def shape_for(exact: StepShape, num_reqs: int) -> tuple[StepShape, int]:
        assert num_reqs == len(req_ids)
        return StepShape(
            exact.num_decodes + pad,
            exact.decode_blocks + pad,
            exact.num_prefill_tokens + 2 * pad,
            exact.prefill_blocks + pad,
        ), num_reqs + pad

    batch = build_step(req_ids, batch_states, q, shape_for, bs, CPU)
    shape = batch.shape
    ids = batch.input_ids.numpy()
    pos = batch.positions.numpy()
    slot_map = batch.attn_metadata.slot_mapping.numpy()
    assert ids.shape == pos.shape == slot_map.shape == (shape.num_tokens,)

    # Real tokens at their rows (decodes first), padding rows: token 0, pos 0,
    # slot 0.
    dec_tokens = [t for t in range(len(ref_req)) if ref_req[t] < n_dec]
    pre_tokens = [t for t in range(len(ref_req)) if ref_req[t] >= n_dec]
    rows = list(range(len(dec_tokens)))
    rows += [shape.num_decodes + i for i in range(len(pre_tokens))]
    for row, t in zip(rows, dec_tokens + pre_tokens, strict=True):
        assert ids[row] == ref_ids[t]
        assert pos[row] == ref_pos[t]
        assert slot_map[row] == ref_slots[t]
    pad_rows = np.setdiff1d(np.arange(shape.num_tokens), rows)
    assert np.all(ids[pad_rows] == 0)
    assert np.all(pos[pad_rows] == 0)
    assert np.all(slot_map[pad_rows] == 0)

    # logits_rows: each request's last token.
    logits_rows = batch.logits_rows.numpy()
    assert logits_rows.shape == (len(req_ids) + pad,)
    assert np.all(logits_rows[len(req_ids) :] == 0)
    for r, s in enumerate(batch_states):
        last = s.num_computed_tokens + int(q[r]) - 1
        row = logits_rows[r]
        assert pos[row] == last
        assert ids[row] == (s.prompt_token_ids + s.output_token_ids)[last]
        assert row == max(
            rw
            for rw, t in zip(rows, dec_tokens + pre_tokens, strict=True)
            if ref_req[t] == r
        )

    # The metadata is exactly build_metadata's on the gathered arrays.
    md = batch.attn_metadata
    want = build_metadata(q, seq_lens, table, slots, bs, shape, CPU)
    assert torch.equal(md.slot_mapping, want.slot_mapping)
    for part in ("decode", "prefill"):
        got, ref = getattr(md, part), getattr(want, part)
        assert (got is None) == (ref is None), part
        for f in dataclasses.fields(ref) if ref is not None else ():
            a, b = getattr(got, f.name), getattr(ref, f.name)
            assert (a is None and b is None) or torch.equal(a, b), f"{part}.{f.name}"
