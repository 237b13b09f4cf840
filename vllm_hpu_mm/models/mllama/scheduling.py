"""Mllama's cross-attention cache in vLLM's scheduler: admit what fits.

The runner encodes every image of a request when the request arrives and keeps
its cross-attention K/V in a slot until the request ends (``worker.
cross_attention``); the cache has ``SlotLedger.capacity`` slots
(``cache_budget.plan_cross_cache``). vLLM's scheduler never charges Mllama's
images to its encoder budget (their placeholders embed nothing), so the plugin
adds the check, through vLLM's own hooks:

- ``CrossSlotEncoderCacheManager`` (``--ec-manager-config``'s
  ``encoder_cache_manager_cls``, its ``manager_config`` carrying the slot
  count) keeps the ``SlotLedger``. vLLM calls its ``free(request)`` whenever a
  request lets go of its encoder inputs: finished, aborted, preempted, or
  refused KV blocks after its encoder inputs were checked;
- ``CrossSlotScheduler`` / ``AsyncCrossSlotScheduler`` (``scheduler_cls``)
  ask the ledger before a request's tokens are scheduled, in
  ``_try_schedule_encoder_inputs`` (vLLM's per-request encoder check, called
  for every request with multimodal inputs, waiting or running). A request
  whose images do not fit is skipped this step, as vLLM skips one whose
  encoder output does not fit its encoder cache, and requests behind it may
  go first. That call depends on no token window, so a prefix-cache hit past
  every image token, or a preempted request coming back, is checked too.

The worker releases a finished or preempted request's slots at the start of
the next step, before it takes new ones, so the slots it holds are always a
subset of the ledger's and a new image always finds a free or idle slot.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_hpu_mm.models.mllama.cache_budget import SLOTS_KEY, SlotLedger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.hpu_mm.mllama")


def image_keys(request: Request) -> list[str]:
    """The item hashes of a request's images (one slot per distinct one)."""
    return [f.identifier for f in request.mm_features or () if f.modality == "image"]


class CrossSlotEncoderCacheManager(EncoderCacheManager):
    """vLLM's encoder cache manager plus the cross-attention slot ledger."""

    @classmethod
    def create_manager(
        cls, *, cache_size: int, vllm_config: VllmConfig
    ) -> CrossSlotEncoderCacheManager:
        slots = int(vllm_config.ec_manager_config.manager_config[SLOTS_KEY])
        return cls(cache_size=cache_size, cross_slots=slots)

    def __init__(self, cache_size: int, cross_slots: int = 1) -> None:
        super().__init__(cache_size)
        self.ledger = SlotLedger(cross_slots)

    def admit_images(self, request: Request) -> bool:
        """Take the request's cross-attention slots if its images fit."""
        keys = image_keys(request)
        if not keys or self.ledger.admit(request.request_id, keys):
            return True
        logger.debug(
            "request %s waits: %d new image(s), %d of %d cross-attention slots held",
            request.request_id,
            self.ledger.needed(keys),
            self.ledger.used,
            self.ledger.capacity,
        )
        return False

    def free(self, request: Request) -> None:
        super().free(request)
        self.ledger.release(request.request_id)


class CrossSlotSchedulerMixin:
    """Skips a request whose images do not fit the cross-attention cache."""

    encoder_cache_manager: Any

    def _try_schedule_encoder_inputs(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int = 0,
    ) -> tuple[list[int], int, int, list[int], list[int]]:
        manager = self.encoder_cache_manager
        if isinstance(manager, CrossSlotEncoderCacheManager) and not (
            manager.admit_images(request)
        ):
            return [], 0, encoder_compute_budget, [], []  # vLLM skips the request
        return super()._try_schedule_encoder_inputs(  # type: ignore[misc]
            request,
            num_computed_tokens,
            num_new_tokens,
            encoder_compute_budget,
            shift_computed_tokens=shift_computed_tokens,
        )


class CrossSlotScheduler(CrossSlotSchedulerMixin, Scheduler):
    """vLLM's scheduler (``--no-async-scheduling``) with the slot check."""


class AsyncCrossSlotScheduler(CrossSlotSchedulerMixin, AsyncScheduler):
    """vLLM's async scheduler with the slot check."""
