"""The runner's LoRA part: vLLM's adapter manager around the model, and the
adapters of each step set from the requests' ``lora_request``.

vLLM's own runners do this in ``LoRAModelRunnerMixin`` (``load_lora_model``,
``set_active_loras``); here the mapping follows the plugin's padded step
layout (``worker.inputs.StepBatch``): one entry per token row, padding rows
served by no adapter, and one per logits row (the batch bucket). The ops are
``vllm_hpu_mm.lora.punica``'s; each pass of a step selects its rows there.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm.hpu_mm.lora")


def step_lora_ids(
    lora_ids: list[int],
    row_starts: np.ndarray,
    query_lens: np.ndarray,
    num_rows: int,
    num_logits_rows: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The LoRA id (``0``: none) of each token row and of each logits row.

    ``lora_ids[i]``, ``row_starts[i]`` and ``query_lens[i]`` describe request
    ``i`` of the step in batch order; rows are token rows of the padded step
    (``num_rows`` of them), logits rows its batch bucket (``num_logits_rows``).
    Returns (tokens [num_rows], logits [num_logits_rows]), int64."""
    if not len(lora_ids) == len(row_starts) == len(query_lens):
        raise ValueError(
            f"{len(lora_ids)} LoRA ids for {len(row_starts)} requests "
            f"({len(query_lens)} query lengths)"
        )
    if len(lora_ids) > num_logits_rows:
        raise ValueError(f"{len(lora_ids)} requests, {num_logits_rows} logits rows")
    tokens = np.zeros(num_rows, np.int64)
    for lora_id, start, length in zip(lora_ids, row_starts, query_lens, strict=True):
        if start + length > num_rows:
            raise ValueError(
                f"request rows [{start}, {start + length}) past the step's "
                f"{num_rows} rows"
            )
        tokens[start : start + length] = lora_id
    logits = np.zeros(num_logits_rows, np.int64)
    logits[: len(lora_ids)] = lora_ids
    return tokens, logits


def lora_id_of(lora_request: Any) -> int:
    return int(lora_request.lora_int_id) if lora_request is not None else 0


class LoraAdapters:
    """vLLM's LRU adapter manager over the model, driven per step."""

    def __init__(
        self, model: torch.nn.Module, vllm_config: Any, device: torch.device
    ) -> None:
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
        from vllm.model_executor.models import supports_lora

        if not supports_lora(model):
            raise ValueError(
                f"{type(model).__name__} does not support LoRA in vLLM "
                "(no SupportsLoRA interface)"
            )
        self.config = vllm_config.lora_config
        self.manager = LRUCacheWorkerLoRAManager(
            vllm_config, device, getattr(model, "embedding_modules", {})
        )
        self.model = self.manager.create_lora_manager(model, vllm_config)
        from vllm_hpu_mm.lora.punica import PunicaWrapperHPUMM

        wrappers = set(self.manager._adapter_manager.punica_wrapper_mapping.values())
        if len(wrappers) != 1:
            raise RuntimeError(
                f"{len(wrappers)} punica wrappers (tower or connector LoRA); "
                "vllm-hpu-mm serves LoRA on the language model only"
            )
        (wrapper,) = wrappers
        assert isinstance(wrapper, PunicaWrapperHPUMM), type(wrapper)
        self.wrapper: PunicaWrapperHPUMM = wrapper
        logger.info(
            "LoRA: %d slots of rank %d (padded: every step applies all slots), "
            "%d adapters cached on the host",
            self.config.max_loras,
            self.config.max_lora_rank,
            self.config.max_cpu_loras or self.config.max_loras,
        )

    def set_step(
        self,
        lora_requests: list[Any],
        row_starts: np.ndarray,
        query_lens: np.ndarray,
        num_rows: int,
        num_logits_rows: int,
    ) -> None:
        """Activate the step's adapters (loading any not in a slot) and map its
        rows; ``lora_requests[i]`` is request ``i``'s (None: the base model)."""
        from vllm.lora.layers import LoRAMapping

        ids = [lora_id_of(r) for r in lora_requests]
        tokens, logits = step_lora_ids(
            ids, row_starts, query_lens, num_rows, num_logits_rows
        )
        active = {r for r in lora_requests if r is not None}
        mapping = LoRAMapping(tuple(tokens.tolist()), tuple(logits.tolist()))
        self.manager.set_active_adapters(active, mapping)

    def select_rows(self, start: int, stop: int) -> None:
        self.wrapper.select_rows(start, stop)

    def add(self, lora_request: Any) -> bool:
        return bool(self.manager.add_adapter(lora_request))

    def remove(self, lora_id: int) -> bool:
        return bool(self.manager.remove_adapter(lora_id))

    def pin(self, lora_id: int) -> bool:
        return bool(self.manager.pin_adapter(lora_id))

    def list(self) -> set[int]:
        return set(self.manager.list_adapters())
