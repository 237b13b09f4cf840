"""Pipeline parallelism: which stage this worker is, and what travels between stages.

As vLLM's GPU worker does (``vllm/v1/worker/gpu_worker.py``): a stage that is
not the first receives the previous stage's ``IntermediateTensors`` (hidden
states and residual, ``[T, H]`` each) before its forward, a stage that is not
the last sends its own to the next stage after it, and only the last stage
computes logits and samples. Every stage builds the same padded step from the
same scheduler output, so ``T`` is the step's bucket on each of them: the
tensors that travel have the static shape every stage compiled at warmup.

Sampled tokens reach the stages before the last through the scheduler: with
pipeline parallelism and synchronous scheduling, vLLM's scheduler puts the
tokens of each scheduled chunk in ``scheduled_cached_reqs.new_token_ids``
(``tokens_from_scheduler`` below appends the ones a stage has not seen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.sequence import IntermediateTensors


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """This worker's place in the pipeline (vLLM's PP group)."""

    rank: int  # 0 .. size - 1
    size: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @classmethod
    def current(cls) -> PipelineStage:
        """The PP group's rank and size; one stage where vLLM's groups are not
        set up (a runner built outside a worker, in unit tests)."""
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return cls(0, 1)
        group = parallel_state.get_pp_group()
        return cls(group.rank_in_group, group.world_size)


def slice_rows(
    tensors: IntermediateTensors, start: int, stop: int
) -> IntermediateTensors:
    """Rows [start, stop) of every tensor (token rows lead: ``[T, ...]``)."""
    return IntermediateTensors({k: v[start:stop] for k, v in tensors.tensors.items()})


def cat_rows(parts: list[IntermediateTensors]) -> IntermediateTensors:
    """The passes' tensors joined back in row order."""
    if len(parts) == 1:
        return parts[0]
    keys = parts[0].tensors.keys()
    return IntermediateTensors(
        {k: torch.cat([p.tensors[k] for p in parts]) for k in keys}
    )


def empty_intermediate(
    model: Any, num_tokens: int, dtype: torch.dtype, device: torch.device
) -> IntermediateTensors:
    """Zeros of the model's intermediate tensors for ``num_tokens`` rows: the
    input of a later stage at warmup and profiling, where no stage sends."""
    return model.make_empty_intermediate_tensors(
        batch_size=num_tokens, dtype=dtype, device=device
    )


def tokens_from_scheduler(
    output_token_ids: list[int],
    num_tokens: int,
    num_computed_tokens: int,
    new_token_ids: list[int],
) -> None:
    """Append to ``output_token_ids`` the sampled tokens this stage has not seen.

    ``new_token_ids`` are the request's tokens at positions
    ``[num_computed_tokens, num_computed_tokens + len)`` (vLLM's scheduler,
    PP with synchronous scheduling); the ones past the ``num_tokens`` this
    stage knows are the tokens the last stage sampled since (vLLM's
    ``GPUModelRunner._update_states`` does the same sum)."""
    unseen = num_computed_tokens + len(new_token_ids) - num_tokens
    if unseen > 0:
        output_token_ids.extend(new_token_ids[-unseen:])
