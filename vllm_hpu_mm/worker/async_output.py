"""Sampled tokens that stay on the device until they are needed (async scheduling).

With ``--async-scheduling`` vLLM schedules step N+1 before it has read step
N's output, so the device may still be running step N while the host builds
step N+1. The runner must then not wait for step N's tokens in
``sample_tokens``:

- the tokens' device-to-host copy is started without blocking, behind an
  event (``device.host_copy_event``);
- each request that got a token is given a placeholder (-1) at the end of its
  ``output_token_ids`` at once, so lengths (``num_tokens``, vLLM's
  ``min_tokens`` processor) are right for the next step;
- the next step reads those tokens on the device (``scatter_into``: a
  decode row's input id is copied from the sampled-token tensor, no host trip);
- ``resolve`` waits for the copy and writes the real values over the
  placeholders; the runner calls it once the next step's forward is issued
  (before sampling, whose penalties read the output tokens), and vLLM's
  ``get_output`` calls it too. Either order is fine; it runs once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from vllm_hpu_mm import device as dev
from vllm_hpu_mm.worker.requests import RequestState

PLACEHOLDER = -1


@dataclass(slots=True)
class PendingTokens:
    """One step's sampled tokens, on their way to the host."""

    device_ids: torch.Tensor  # [R] int64, persistent-batch row order
    host_ids: torch.Tensor  # [R] int64, filled by a non-blocking copy
    event: Any | None  # recorded after the copy (None on the CPU)
    # (row, state, index in state.output_token_ids) of each placeholder
    placeholders: list[tuple[int, RequestState, int]]
    done: bool = False
    # where each placeholder's token sits in the sequence (token position)
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        sampled: torch.Tensor,
        states: list[RequestState],
        keeps: list[bool],
    ) -> PendingTokens:
        """Start the copy of ``sampled`` [R] and give each kept row a placeholder."""
        device_ids = sampled.to(torch.int64)
        # D2H with non_blocking lands in pinned host memory; a no-op on the CPU.
        host_ids = device_ids.to("cpu", non_blocking=True)
        pending = cls(device_ids, host_ids, dev.host_copy_event(), [])
        for row, (state, keep) in enumerate(zip(states, keeps, strict=True)):
            if not keep:
                continue
            index = len(state.output_token_ids)
            state.output_token_ids.append(PLACEHOLDER)
            pending.placeholders.append((row, state, index))
            pending.positions[state.req_id] = (row, state.num_prompt_tokens + index)
        return pending

    def host_tokens(self) -> np.ndarray:
        """[R] the sampled tokens on the host (waits for the copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host_ids.numpy()

    def resolve(self) -> np.ndarray:
        """Write the real tokens over the placeholders (once); returns [R]."""
        tokens = self.host_tokens()
        if not self.done:
            self.done = True
            for row, state, index in self.placeholders:
                out = state.output_token_ids
                # The scheduler may have trimmed the request since (preemption).
                if index < len(out) and out[index] == PLACEHOLDER:
                    out[index] = int(tokens[row])
        return tokens

    def scatter_into(
        self,
        input_ids: torch.Tensor,
        req_ids: list[str],
        row_starts: np.ndarray,
        starts: np.ndarray,
        query_lens: np.ndarray,
    ) -> int:
        """Copy placeholder tokens into a step's ``input_ids`` [padded tokens] on
        the device: request i's tokens sit at token rows ``row_starts[i] + (p -
        starts[i])`` for positions p in [starts[i], starts[i] + query_lens[i]).
        Returns how many rows were written."""
        dst: list[int] = []
        src: list[int] = []
        for i, req_id in enumerate(req_ids):
            where = self.positions.get(req_id)
            if where is None:
                continue
            row, pos = where
            offset = pos - int(starts[i])
            if 0 <= offset < int(query_lens[i]):
                dst.append(int(row_starts[i]) + offset)
                src.append(row)
        if dst:
            device = input_ids.device
            index = torch.tensor(dst, dtype=torch.int64, device=device)
            values = self.device_ids.index_select(
                0, torch.tensor(src, dtype=torch.int64, device=device)
            )
            input_ids.index_copy_(0, index, values)
        return len(dst)


class AsyncStepOutput(AsyncModelRunnerOutput):
    """A step's ``ModelRunnerOutput``, built when vLLM asks for it."""

    def __init__(self, build: Callable[[], ModelRunnerOutput]) -> None:
        self._build = build

    def get_output(self) -> ModelRunnerOutput:
        return self._build()

    def get_kv_connector_output(self) -> None:
        return None
