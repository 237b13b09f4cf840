"""Pipeline stages without an engine: the tokens a stage before the last learns
from the scheduler, and the rows of the intermediate tensors per pass."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.sampling_params import SamplingParams
from vllm.sequence import IntermediateTensors
from vllm.v1.core.sched.output import CachedRequestData

from vllm_hpu_mm.worker.pipeline import (
    PipelineStage,
    cat_rows,
    slice_rows,
    tokens_from_scheduler,
)
from vllm_hpu_mm.worker.requests import RequestState, RequestTable

PROMPT = [11, 12, 13, 14, 15]


def _table(tokens_from_scheduler: bool) -> RequestTable:
    table = RequestTable(torch.device("cpu"), tokens_from_scheduler)
    table.states["r"] = RequestState(
        req_id="r",
        prompt_token_ids=list(PROMPT),
        sampling_params=SamplingParams(),
        generator=None,
        block_ids=[0],
        num_computed_tokens=0,
    )
    return table


def _step(computed: int, new_tokens: list[int], outputs: int) -> SimpleNamespace:
    """What vLLM's scheduler sends with PP and synchronous scheduling: the
    tokens of the scheduled chunk, ``[computed, computed + len)``."""
    cached = CachedRequestData(
        req_ids=["r"],
        resumed_req_ids=set(),
        new_token_ids=[new_tokens],
        all_token_ids={},
        new_block_ids=[None],
        num_computed_tokens=[computed],
        num_output_tokens=[outputs],
    )
    return SimpleNamespace(
        finished_req_ids=set(), scheduled_new_reqs=[], scheduled_cached_reqs=cached
    )


def test_an_early_stage_learns_each_sampled_token_from_the_scheduler() -> None:
    table = _table(tokens_from_scheduler=True)
    table.update(_step(3, [14, 15], 0))  # the prompt's second chunk: nothing new
    assert table["r"].output_token_ids == []
    table.update(_step(5, [99], 1))  # the first sampled token, now decoded
    table.update(_step(6, [98], 2))
    assert table["r"].output_token_ids == [99, 98]
    assert table["r"].token_ids(0, 7) == [*PROMPT, 99, 98]


def test_the_last_stage_keeps_its_own_tokens() -> None:
    """The last stage appends what it samples (``sample_tokens``); the
    scheduler's copy is not added again."""
    table = _table(tokens_from_scheduler=False)
    table["r"].output_token_ids.append(99)  # sampled by this stage
    table.update(_step(5, [99], 1))
    assert table["r"].output_token_ids == [99]


def test_tokens_from_scheduler_appends_only_the_unseen() -> None:
    out = [7]
    tokens_from_scheduler(out, num_tokens=6, num_computed_tokens=5, new_token_ids=[7])
    assert out == [7]  # already known
    tokens_from_scheduler(out, num_tokens=6, num_computed_tokens=6, new_token_ids=[8])
    assert out == [7, 8]


def test_pass_rows_round_trip() -> None:
    """A mixed step's passes (decode rows, then prefill rows) each read their
    rows of the received tensors; a stage's output is joined back in order."""
    hidden = torch.arange(12.0).reshape(6, 2)
    tensors = IntermediateTensors({"hidden_states": hidden, "residual": -hidden})
    parts = [slice_rows(tensors, 0, 2), slice_rows(tensors, 2, 6)]
    assert parts[1]["hidden_states"].shape == (4, 2)
    joined = cat_rows(parts)
    assert torch.equal(joined["hidden_states"], hidden)
    assert torch.equal(joined["residual"], -hidden)


def test_stage_outside_a_worker_is_the_only_one() -> None:
    stage = PipelineStage.current()
    assert (stage.is_first, stage.is_last) == (True, True)
    assert (PipelineStage(0, 2).is_last, PipelineStage(1, 2).is_first) == (
        False,
        False,
    )
