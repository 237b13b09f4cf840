"""The runner's view of the requests it serves, kept in step with the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_hpu_mm.worker.mrope import MRopePositions, compute_mrope
from vllm_hpu_mm.worker.pipeline import tokens_from_scheduler

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass(slots=True)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]  # KV-cache blocks, in position order
    num_computed_tokens: int  # tokens whose K/V are in the cache
    mm_features: list[Any] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # M-RoPE models only (``worker.mrope``): the prompt's positions and delta.
    mrope: MRopePositions | None = None
    # vLLM's LoRARequest of the request (None: the base model).
    lora_request: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


class RequestTable:
    """Request states by id, updated from each SchedulerOutput."""

    def __init__(
        self, device: torch.device, tokens_from_scheduler: bool = False
    ) -> None:
        self.device = device
        # A pipeline stage before the last samples nothing: it learns each
        # request's new tokens from the scheduler (``worker.pipeline``).
        self.tokens_from_scheduler = tokens_from_scheduler
        self.states: dict[str, RequestState] = {}
        # Set (to the model) for M-RoPE models: each new request's positions
        # are computed by the model's ``get_mrope_input_positions``.
        self.mrope_model: Any | None = None

    def __getitem__(self, req_id: str) -> RequestState:
        return self.states[req_id]

    def __len__(self) -> int:
        return len(self.states)

    def update(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self._add(new)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            # The scheduler's count wins: tokens it discarded are dropped here.
            del state.output_token_ids[cached.num_output_tokens[i] :]
            if self.tokens_from_scheduler and cached.new_token_ids:
                tokens_from_scheduler(
                    state.output_token_ids,
                    state.num_tokens,
                    state.num_computed_tokens,
                    cached.new_token_ids[i],
                )
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_blocks is not None
                state.block_ids = list(_single_group(new_blocks, req_id))
            elif new_blocks is not None:
                state.block_ids.extend(_single_group(new_blocks, req_id))

    def _add(self, new: Any) -> None:
        params = new.sampling_params
        if params is None:
            raise ValueError(f"request {new.req_id}: only generation is supported")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        prompt = list(new.prompt_token_ids or [])
        mm_features = list(new.mm_features or [])
        mrope = None
        if self.mrope_model is not None:
            mrope = compute_mrope(self.mrope_model, prompt, mm_features)
        self.states[new.req_id] = RequestState(
            req_id=new.req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            generator=generator,
            block_ids=list(_single_group(new.block_ids, new.req_id)),
            num_computed_tokens=new.num_computed_tokens,
            mm_features=mm_features,
            mrope=mrope,
            lora_request=getattr(new, "lora_request", None),
        )


def _single_group(block_ids: tuple[list[int], ...], req_id: str) -> list[int]:
    if len(block_ids) != 1:
        raise ValueError(
            f"request {req_id}: {len(block_ids)} KV-cache groups, the runner "
            "supports one (uniform full or sliding-window attention)"
        )
    return block_ids[0]
