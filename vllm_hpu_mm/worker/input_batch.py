"""The persistent input batch: the sampler's rows, kept across steps.

A request keeps its row from the step it is scheduled until it finishes or is
left out of a step; rows freed by removals are refilled by new requests first,
then the highest rows slide down into the remaining holes (``condense``), so
rows ``[0, num_reqs)`` are the step's requests. Every change is reported to
vLLM's logits processors through vLLM's ``BatchUpdate`` protocol
(``BatchUpdateBuilder``: removals, then additions into freed rows, then
unidirectional moves), the same protocol vLLM's GPU input batch speaks.

Per-row sampling state lives in preallocated host arrays written only when a
row changes, and is copied to the device once per changed step
(``refresh``). The rows are the *sampling* order; the token layout of a step
(decodes first) is the step builder's business: ``order_of`` maps one to the
other. Padding rows of a step bucket never enter this batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.v1.sample.logits_processor import (
    BatchUpdateBuilder,
    LogitsProcessors,
    MoveDirectionality,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.utils import CpuGpuBuffer

if TYPE_CHECKING:
    from vllm_hpu_mm.worker.requests import RequestState


# One per-row value each: vLLM's CpuGpuBuffer, a host array written per row
# (``.np``) and its device copy, uploaded once per changed step (``copy_to_gpu``).
# Pinned host memory follows the platform (``is_pin_memory_available``: False here).
_COLUMNS: dict[str, torch.dtype] = {
    "temperature": torch.float32,
    "top_p": torch.float32,
    "top_k": torch.int32,
    "frequency_penalty": torch.float32,
    "presence_penalty": torch.float32,
    "repetition_penalty": torch.float32,
}


class PersistentBatch:
    """Sampler rows of the scheduled requests, stable across steps."""

    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device,
        logitsprocs: LogitsProcessors | None = None,
        logitsprocs_need_output_token_ids: bool = False,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.logitsprocs = logitsprocs or LogitsProcessors()
        self.logitsprocs_need_output_token_ids = logitsprocs_need_output_token_ids
        self._rows: list[RequestState | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.columns = {
            k: CpuGpuBuffer(max_num_reqs, dtype=t, device=device)
            for k, t in _COLUMNS.items()
        }
        self._greedy = np.zeros(max_num_reqs, dtype=bool)
        self.generators: dict[int, torch.Generator] = {}
        self.bad_words: dict[int, list[list[int]]] = {}
        # [max_num_reqs, vocab] True = masked out (vLLM's convention); allocated
        # at the first request with allowed_token_ids.
        self._allowed_host: torch.Tensor | None = None
        self._allowed_device: torch.Tensor | None = None
        self._has_allowed: set[str] = set()
        self.updates = BatchUpdateBuilder()
        self.metadata = self._make_metadata()

    # ---- queries ------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids by row (rows [0, num_reqs) after ``refresh``)."""
        return [s.req_id for s in self._rows if s is not None]

    def states(self) -> list[RequestState]:
        return [s for s in self._rows if s is not None]

    def order_of(self, step_req_ids: list[str]) -> list[int]:
        """For each row, the index of its request in ``step_req_ids``."""
        where = {r: i for i, r in enumerate(step_req_ids)}
        return [where[r] for r in self.req_ids]

    # ---- changes ------------------------------------------------------------------
    def sync(self, scheduled: list[RequestState]) -> None:
        """Make the rows hold exactly the ``scheduled`` requests, then refresh.

        Removals come first (vLLM's protocol: all removals of a step before the
        first addition), additions fill the freed rows lowest first, then the
        batch is condensed.
        """
        keep = {s.req_id for s in scheduled}
        for req_id in [r for r in self.req_id_to_index if r not in keep]:
            self._remove(req_id)
        for state in scheduled:
            if state.req_id not in self.req_id_to_index:
                self._add(state)
        self._condense()
        self.refresh()

    def _add(self, state: RequestState) -> None:
        row = self.updates.pop_removed()
        if row is None:
            row = len(self._rows)
            if row >= self.max_num_reqs:
                raise RuntimeError(
                    f"persistent batch full: {self.max_num_reqs} rows (max_num_seqs)"
                )
            self._rows.append(state)
        else:
            self._rows[row] = state
        self.req_id_to_index[state.req_id] = row
        p = state.sampling_params
        self.updates.added.append(
            (row, p, state.prompt_token_ids, state.output_token_ids)
        )
        self.updates.batch_changed = True
        greedy = p.sampling_type == SamplingType.GREEDY
        self._greedy[row] = greedy
        cols = self.columns
        cols["temperature"].np[row] = 0.0 if greedy else p.temperature
        cols["top_p"].np[row] = p.top_p
        cols["top_k"].np[row] = (
            p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        )
        cols["frequency_penalty"].np[row] = p.frequency_penalty
        cols["presence_penalty"].np[row] = p.presence_penalty
        cols["repetition_penalty"].np[row] = p.repetition_penalty
        if state.generator is not None:
            self.generators[row] = state.generator
        if p.bad_words_token_ids:
            self.bad_words[row] = p.bad_words_token_ids
        if p.allowed_token_ids:
            self._set_allowed(row, p.allowed_token_ids)
            self._has_allowed.add(state.req_id)

    def _set_allowed(self, row: int, allowed: list[int]) -> None:
        if self._allowed_host is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self._allowed_host = torch.zeros(shape, dtype=torch.bool)
            self._allowed_device = torch.zeros(
                shape, dtype=torch.bool, device=self.device
            )
        self._allowed_host[row] = True
        self._allowed_host[row, allowed] = False

    def _remove(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id)
        self.updates.removed_append(row)
        self._rows[row] = None
        self.generators.pop(row, None)
        self.bad_words.pop(row, None)
        self._has_allowed.discard(req_id)
        if self._allowed_host is not None:
            self._allowed_host[row] = False

    def _condense(self) -> None:
        """Slide the highest rows into the holes left by removals."""
        holes = self.updates.removed  # descending
        if self.num_reqs == 0:
            self._rows.clear()
            return
        last = len(self._rows) - 1
        while holes:
            while last >= 0 and self._rows[last] is None:
                last -= 1
            hole = self.updates.peek_removed()
            assert hole is not None
            if hole >= last:
                break
            self.updates.pop_removed()
            self._move(last, hole)
            last -= 1
        del self._rows[self.num_reqs :]

    def _move(self, src: int, dst: int) -> None:
        state = self._rows[src]
        assert state is not None
        self._rows[dst], self._rows[src] = state, None
        self.req_id_to_index[state.req_id] = dst
        self.updates.moved.append((src, dst, MoveDirectionality.UNIDIRECTIONAL))
        for col in self.columns.values():
            col.np[dst] = col.np[src]
        self._greedy[dst] = self._greedy[src]
        for table in (self.generators, self.bad_words):
            if src in table:
                table[dst] = table.pop(src)  # type: ignore[assignment]
        if self._allowed_host is not None:
            self._allowed_host[dst] = self._allowed_host[src]
            self._allowed_host[src] = False

    def refresh(self) -> None:
        """Tell the logits processors what changed; rebuild the metadata if so."""
        update = self.updates.get_and_reset(self.num_reqs)
        for proc in self.logitsprocs.all:
            proc.update_state(update)
        if update is not None:
            self.metadata = self._make_metadata()

    # ---- sampling metadata --------------------------------------------------------
    def _make_metadata(self) -> SamplingMetadata:
        n = self.num_reqs
        states = self.states()
        cols = self.columns
        greedy = self._greedy[:n]
        all_greedy = bool(greedy.all())
        no_top_p = bool((cols["top_p"].np[:n] == 1.0).all())
        no_top_k = bool((cols["top_k"].np[:n] == self.vocab_size).all())
        no_penalties = bool(
            (cols["frequency_penalty"].np[:n] == 0.0).all()
            and (cols["presence_penalty"].np[:n] == 0.0).all()
            and (cols["repetition_penalty"].np[:n] == 1.0).all()
        )
        needs_output = (
            not no_penalties
            or bool(self.bad_words)
            or self.logitsprocs_need_output_token_ids
        )
        logprobs = [
            self.vocab_size
            if s.sampling_params.logprobs == -1
            else s.sampling_params.logprobs
            for s in states
            if s.sampling_params.logprobs is not None
        ]
        token_ids = {
            i: s.sampling_params.logprob_token_ids
            for i, s in enumerate(states)
            if getattr(s.sampling_params, "logprob_token_ids", None)
        }
        return SamplingMetadata(
            temperature=None if all_greedy else cols["temperature"].copy_to_gpu(n),
            all_greedy=all_greedy,
            all_random=not bool(greedy.any()),
            top_p=None if no_top_p else cols["top_p"].copy_to_gpu(n),
            top_k=None if no_top_k else cols["top_k"].copy_to_gpu(n),
            generators=self.generators,
            max_num_logprobs=max(logprobs) if logprobs else None,
            logprob_token_ids=token_ids or None,  # type: ignore[arg-type]
            no_penalties=no_penalties,
            prompt_token_ids=None if no_penalties else self._prompt_ids(states),
            frequency_penalties=cols["frequency_penalty"].copy_to_gpu(n),
            presence_penalties=cols["presence_penalty"].copy_to_gpu(n),
            repetition_penalties=cols["repetition_penalty"].copy_to_gpu(n),
            output_token_ids=[s.output_token_ids for s in states]
            if needs_output
            else [],
            allowed_token_ids_mask=self._allowed_rows(n),
            bad_words_token_ids=self.bad_words,
            logitsprocs=self.logitsprocs,
        )

    def _allowed_rows(self, n: int) -> torch.Tensor | None:
        if not self._has_allowed:
            return None
        assert self._allowed_host is not None and self._allowed_device is not None
        self._allowed_device[:n].copy_(self._allowed_host[:n], non_blocking=True)
        return self._allowed_device[:n]

    def _prompt_ids(self, states: list[RequestState]) -> torch.Tensor:
        """[R, longest prompt] prompt ids padded with vocab_size (the penalty pad)."""
        width = max(s.num_prompt_tokens for s in states)
        out = np.full((len(states), width), self.vocab_size, np.int64)
        for i, s in enumerate(states):
            out[i, : s.num_prompt_tokens] = s.prompt_token_ids
        return torch.from_numpy(out).to(self.device)
