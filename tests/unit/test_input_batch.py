"""The persistent batch: stable rows, vLLM's BatchUpdate protocol, per-row state."""

from __future__ import annotations

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessors,
    MoveDirectionality,
)
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

from vllm_hpu_mm.worker.input_batch import PersistentBatch
from vllm_hpu_mm.worker.requests import RequestState

VOCAB = 32
CPU = torch.device("cpu")


class RecordingProcessor(LogitsProcessor):
    """Keeps the request id of each row from the updates alone, as a real
    processor must (it never sees the batch itself)."""

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}  # row -> the request's seed (its identity)
        self.updates: list[BatchUpdate | None] = []

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        if batch_update is None:
            return
        for row, params, _, _ in batch_update.added:
            self.rows[row] = params.seed
        for row in batch_update.removed:
            self.rows.pop(row, None)
        for src, dst, kind in batch_update.moved:
            assert kind == MoveDirectionality.UNIDIRECTIONAL
            self.rows[dst] = self.rows.pop(src)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def state(i: int, **params: object) -> RequestState:
    return RequestState(
        req_id=f"r{i}",
        prompt_token_ids=[1, 2, i % VOCAB],
        sampling_params=SamplingParams(seed=i, **params),  # type: ignore[arg-type]
        generator=torch.Generator().manual_seed(i),
        block_ids=[],
        num_computed_tokens=0,
    )


def make(max_reqs: int = 8, *procs: LogitsProcessor) -> PersistentBatch:
    return PersistentBatch(max_reqs, VOCAB, CPU, LogitsProcessors(procs))


def check_rows(batch: PersistentBatch, rec: RecordingProcessor) -> None:
    """The processor's view equals the batch, row for row."""
    expected = {row: int(r[1:]) for row, r in enumerate(batch.req_ids)}
    assert rec.rows == expected
    assert batch.req_id_to_index == {r: i for i, r in enumerate(batch.req_ids)}
    for row, gen in batch.generators.items():
        # each row's generator is its own request's (seeded with its number)
        seed = int(batch.req_ids[row][1:])
        assert gen.initial_seed() == seed


def test_rows_are_stable_and_holes_refilled_first() -> None:
    rec = RecordingProcessor()
    batch = make(8, rec)
    s = [state(i) for i in range(6)]
    batch.sync(s[:4])
    assert batch.req_ids == ["r0", "r1", "r2", "r3"]
    check_rows(batch, rec)
    update = rec.updates[-1]
    assert update is not None and [a[0] for a in update.added] == [0, 1, 2, 3]

    batch.sync(s[:4])  # nothing changed: the processors hear None
    assert rec.updates[-1] is None

    batch.sync([s[0], s[2], s[3], s[4]])  # r1 leaves, r4 takes its row
    assert batch.req_ids == ["r0", "r4", "r2", "r3"]
    update = rec.updates[-1]
    assert update is not None
    assert [a[0] for a in update.added] == [1] and not update.moved
    assert not update.removed  # the row was refilled, not freed
    check_rows(batch, rec)


def test_removals_condense_with_unidirectional_moves() -> None:
    rec = RecordingProcessor()
    batch = make(8, rec)
    s = [state(i) for i in range(5)]
    batch.sync(s)
    batch.sync([s[1], s[3]])  # rows 0, 2, 4 leave: r3 slides from 3 to 0
    assert batch.req_ids == ["r3", "r1"]
    update = rec.updates[-1]
    assert update is not None
    assert update.batch_size == 2
    assert update.moved == [(3, 0, MoveDirectionality.UNIDIRECTIONAL)]
    assert sorted(update.removed) == [2, 4]
    check_rows(batch, rec)

    batch.sync([])  # all leave
    assert batch.num_reqs == 0 and batch.req_ids == []
    batch.sync([s[4], s[0]])
    assert batch.req_ids == ["r4", "r0"]
    check_rows(batch, rec)


def test_per_row_sampling_state_follows_the_request() -> None:
    batch = make(8)
    a = state(1, temperature=0.5, top_k=3, top_p=0.9)
    b = state(2, temperature=0.0)
    c = state(3, temperature=1.2, repetition_penalty=1.3, allowed_token_ids=[4, 5])
    batch.sync([a, b, c])
    md = batch.metadata
    assert md.temperature is not None
    assert md.temperature.tolist() == [0.5, 0.0, torch.tensor(1.2).item()]
    assert md.top_k is not None and md.top_k.tolist() == [3, VOCAB, VOCAB]
    assert not md.all_greedy and not md.all_random and not md.no_penalties
    assert md.allowed_token_ids_mask is not None
    assert md.allowed_token_ids_mask[2].logical_not().nonzero().flatten().tolist() == [
        4,
        5,
    ]
    assert not md.allowed_token_ids_mask[:2].any()
    assert md.prompt_token_ids is not None
    assert md.prompt_token_ids[2].tolist() == [1, 2, 3]

    batch.sync([c, b])  # a leaves: c moves from row 2 to row 0
    md = batch.metadata
    assert batch.req_ids == ["r3", "r2"]
    assert md.temperature is not None
    assert md.temperature.tolist() == [torch.tensor(1.2).item(), 0.0]
    assert md.top_k is None and md.top_p is None  # no row uses them any more
    assert md.repetition_penalties.tolist() == [torch.tensor(1.3).item(), 1.0]
    assert md.allowed_token_ids_mask is not None
    assert md.allowed_token_ids_mask[0].logical_not().nonzero().flatten().tolist() == [
        4,
        5,
    ]
    assert not md.allowed_token_ids_mask[1].any()
    assert md.generators[0].initial_seed() == 3 and md.generators[1].initial_seed() == 2

    batch.sync([b])
    md = batch.metadata
    assert md.all_greedy and md.temperature is None and md.no_penalties
    assert md.allowed_token_ids_mask is None


def test_sampling_columns_are_vllms_buffers_in_pageable_memory() -> None:
    from vllm.v1.utils import CpuGpuBuffer

    batch = make(4)
    batch.sync([state(1, temperature=0.5)])
    column = batch.columns["temperature"]
    assert isinstance(column, CpuGpuBuffer)
    assert not column.cpu.is_pinned()  # the platform has no pinned memory
    assert batch.metadata.temperature is not None
    assert batch.metadata.temperature.data_ptr() == column.gpu.data_ptr()  # a view


def test_vllm_logit_bias_follows_moves() -> None:
    """vLLM's own LogitBias processor, fed by the batch's updates, biases the
    row where its request is now."""
    proc = LogitBiasLogitsProcessor(None, CPU, False)
    batch = make(8, proc)
    plain = state(0)
    biased = state(1, logit_bias={7: 50.0})
    other = state(2)
    batch.sync([plain, other, biased])
    logits = proc.apply(torch.zeros(3, VOCAB))
    assert logits.argmax(-1).tolist()[2] == 7 and logits[:2].abs().sum() == 0

    batch.sync([biased, other])  # plain leaves: biased moves from row 2 to 0
    assert batch.req_ids == ["r1", "r2"]
    logits = proc.apply(torch.zeros(2, VOCAB))
    assert logits[0, 7] == 50.0 and logits[1].abs().sum() == 0


def test_output_tokens_are_the_requests_own_lists() -> None:
    """Penalties and processors read the request's live output list."""
    batch = make(4)
    a = state(1, presence_penalty=0.5)
    batch.sync([a])
    a.output_token_ids.append(9)
    assert batch.metadata.output_token_ids[0] is a.output_token_ids
    assert batch.metadata.output_token_ids[0] == [9]


def test_order_of_maps_rows_to_the_step_layout() -> None:
    batch = make(4)
    s = [state(i) for i in range(3)]
    batch.sync(s)
    # the step lays out decodes first, e.g. r2, r0, r1
    assert batch.order_of(["r2", "r0", "r1"]) == [1, 2, 0]


def test_prompt_logprobs_accumulate_across_chunks() -> None:
    """Chunks of 4, 4 and 2 prompt tokens give one answer, at the last chunk,
    equal to the log-softmax of the whole prompt at once."""
    from vllm_hpu_mm.worker.sampling import PromptLogprobs

    torch.manual_seed(0)
    head = torch.randn(8, VOCAB)
    prompt = [3, 9, 4, 1, 7, 7, 2, 5, 6, 8]
    hidden_of = torch.randn(len(prompt), 8)  # the hidden state of each position
    s = state(1)
    s.prompt_token_ids = prompt
    pl = PromptLogprobs(VOCAB, "raw_logprobs")
    pl.add(s.req_id, SamplingParams(prompt_logprobs=2))
    answers = []
    for start, n in ((0, 4), (4, 4), (8, 2)):
        s.num_computed_tokens = start
        # the step's token rows: 3 padding rows, then this chunk
        hidden = torch.cat([torch.zeros(3, 8), hidden_of[start : start + n]])
        answers.append(
            pl.collect(
                hidden, {s.req_id: 3}, {s.req_id: n}, {s.req_id: s}, lambda h: h @ head
            )
        )
    assert answers[0] == {} and answers[1] == {}
    got = answers[2][s.req_id]
    assert got is not None and not pl.pending
    want = torch.log_softmax(hidden_of[:-1] @ head, -1)  # position p scores p + 1
    targets = torch.tensor(prompt[1:])
    assert torch.equal(got.logprob_token_ids[:, 0], targets)
    assert torch.allclose(got.logprobs[:, 0], want.gather(1, targets[:, None])[:, 0])
    assert torch.equal(got.logprob_token_ids[:, 1:], want.topk(2).indices)
