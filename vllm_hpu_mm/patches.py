"""Every unavoidable patch of vLLM or torch, in one place.

Each entry says why it exists, what it changes and when it can go. Patches are
applied by ``apply_patches()`` from the platform plugin entry point (vLLM
resolves the platform in every process that uses it, engine or not), the
general plugin entry point and the worker's ``init_device`` (never at import),
only where their condition holds, and each at most once.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_hpu_mm import device as dev

logger = logging.getLogger("vllm.hpu_mm.patches")


@dataclass(frozen=True, slots=True)
class Patch:
    name: str
    why: str
    until: str  # when it can be removed
    applies: Callable[[], bool]
    apply: Callable[[], None]


def _noop(*args: object, **kwargs: object) -> None:
    return None


def _empty_cache_noop(*args: object, **kwargs: object) -> None:
    # Distinct from _noop: torch.compile keys a handler on synchronize's identity.
    return None


def _accelerator_noop() -> None:
    torch.accelerator.synchronize = _noop  # type: ignore[assignment]
    torch.accelerator.empty_cache = _empty_cache_noop  # type: ignore[assignment]
    torch.accelerator.empty_host_cache = _noop  # type: ignore[assignment]


def _accelerator_hpu() -> None:
    torch.accelerator.empty_cache = _empty_cache_noop  # type: ignore[assignment]
    torch.accelerator.empty_host_cache = _noop  # type: ignore[assignment]


def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's ``v1/sample/ops/logprobs.py`` helper, uncompiled: per row of ``x
    [N, V]``, how many entries are >= ``values [N, 1]`` (the rank of a token)."""
    return (x >= values).sum(-1)


def get_masked_input_and_mask(
    input_: torch.Tensor,
    org_vocab_start_index: int,
    org_vocab_end_index: int,
    num_org_vocab_padding: int,
    added_vocab_start_index: int,
    added_vocab_end_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's vocab-parallel embedding helper, uncompiled: token ids local to
    this rank's shard (0 outside it) and the mask of ids outside it."""
    org_mask = (input_ >= org_vocab_start_index) & (input_ < org_vocab_end_index)
    added_mask = (input_ >= added_vocab_start_index) & (input_ < added_vocab_end_index)
    added_offset = (
        added_vocab_start_index
        - (org_vocab_end_index - org_vocab_start_index)
        - num_org_vocab_padding
    )
    valid_offset = (org_vocab_start_index * org_mask) + (added_offset * added_mask)
    vocab_mask = org_mask | added_mask
    return vocab_mask * (input_ - valid_offset), ~vocab_mask


_SAMPLER = "vllm.v1.sample.sampler"


def _uncompiled_helpers() -> None:
    import vllm.model_executor.layers.vocab_parallel_embedding as embedding
    import vllm.v1.sample.ops.logprobs as logprobs
    import vllm.v1.sample.sampler as sampler

    logprobs.batched_count_greater_than = batched_count_greater_than  # type: ignore[assignment]
    sampler.batched_count_greater_than = batched_count_greater_than  # type: ignore[attr-defined]
    embedding.get_masked_input_and_mask = get_masked_input_and_mask  # type: ignore[assignment]


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="torch.accelerator no-ops on the CPU fallback",
        why=(
            "vLLM 0.33 calls torch.accelerator.empty_cache() in its model "
            "loader (model_loader/base_loader.py) and empty_host_cache() at "
            "shutdown for every non-CPU platform enum "
            "(cleanup_dist_env_and_memory); both raise 'Cannot access "
            "accelerator device' on a host without one"
        ),
        until="vLLM guards its torch.accelerator calls by platform",
        applies=lambda: dev.device_kind() == "cpu",
        apply=_accelerator_noop,
    ),
    Patch(
        name="torch.accelerator cache release skipped on HPU",
        why=(
            "vLLM 0.33 calls torch.accelerator.empty_cache() after loading "
            "weights (model_loader/base_loader.py) and empty_cache() / "
            "empty_host_cache() at shutdown (distributed/parallel_state.py); "
            "Habana's allocator is not a c10::DeviceAllocator, so on Gaudi "
            "software 1.24 empty_cache raises 'Allocator for hpu is not a "
            "DeviceAllocator' (HabanaAI/vllm-fork #2250) and empty_host_cache "
            "has no HPU hook; the official plugin replaces both with no-ops "
            "(vllm-gaudi patches.py)"
        ),
        until="the Habana bridge's allocator implements c10::DeviceAllocator",
        applies=lambda: dev.device_kind() == "hpu",
        apply=_accelerator_hpu,
    ),
    Patch(
        name="vLLM's symbolic-shape compiled helpers run eagerly on HPU",
        why=(
            "the sampler marks the logprobs batch unbacked (mark_unbacked) and "
            "calls batched_count_greater_than, which vLLM compiles with "
            "simple_compile_backend (v1/sample/ops/logprobs.py); under TP > 1 "
            "the vocab-parallel embedding calls get_masked_input_and_mask, "
            "compiled with dynamic=True. hpu_backend compiles static shapes "
            "only ('TypeError: Cannot convert symbols to int', vllm-gaudi "
            "patches.py, which replaces the helpers with plain functions); "
            "applied once vLLM's sampler is imported (in the worker, before "
            "init_device), so that registering the platform stays light"
        ),
        until="vLLM compiles these helpers with static shapes on HPU",
        applies=lambda: dev.device_kind() == "hpu" and _SAMPLER in sys.modules,
        apply=_uncompiled_helpers,
    ),
)

_applied: set[str] = set()


def apply_patches() -> None:
    for patch in PATCHES:
        if patch.name in _applied or not patch.applies():
            continue
        patch.apply()
        _applied.add(patch.name)
        logger.info("vllm-hpu-mm patch applied: %s (%s)", patch.name, patch.why)
