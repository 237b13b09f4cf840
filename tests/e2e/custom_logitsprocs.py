"""A custom logits processor for the tests (``--logits-processors``).

``ForceTokenProcessor``: a request with ``extra_args={"force_token": t}`` can
only produce token ``t``. It keeps its per-row state from vLLM's
``BatchUpdate`` alone (``process_dict_updates``), as any batch-level processor
must, so a request that moves rows keeps its forced token.

``PaceProcessor``: a step that samples for a request with
``extra_args={"pace_ms": n}`` sleeps ``n`` ms (logits unchanged), so a test
can hold a request mid-generation for a known minimum time whatever the
machine's speed (``tests/e2e/test_reliability.py``: a client disconnecting
from a stream that cannot have finished yet).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates


class ForceTokenProcessor(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.forced: dict[int, int] = {}  # row -> token

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        token = (params.extra_args or {}).get("force_token")
        if token is not None and not isinstance(token, int):
            raise ValueError(f"force_token must be an int, got {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.forced,
            batch_update,
            lambda params, _, __: (params.extra_args or {}).get("force_token"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.forced:
            return logits
        rows = list(self.forced)
        tokens = [self.forced[r] for r in rows]
        keep = logits[rows, tokens].clone()
        logits[rows] = float("-inf")
        logits[rows, tokens] = keep
        return logits


class PaceProcessor(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.pace_ms: dict[int, float] = {}  # row -> ms a step

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        pace = (params.extra_args or {}).get("pace_ms")
        number = isinstance(pace, int | float)
        if pace is not None and not (number and 0 < pace <= 1000):
            raise ValueError(f"pace_ms must be a number in (0, 1000], got {pace!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.pace_ms,
            batch_update,
            lambda params, _, __: (params.extra_args or {}).get("pace_ms"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.pace_ms:
            time.sleep(max(self.pace_ms.values()) / 1000)
        return logits
