"""Sampling pieces around vLLM's Sampler: logits processors, prompt logprobs.

The per-row sampling state lives in the persistent batch (``input_batch``);
this module builds vLLM's logits processors (built-ins and
``--logits-processors`` classes, through vLLM's ``build_logitsprocs``) and the
prompt logprobs of requests that ask for them.

Prompt logprobs follow vLLM's GPU runner: one ``LogprobsTensors`` per request
for the whole prompt (``num_prompt_tokens - 1`` rows, the first token has
none), filled chunk by chunk from the step's hidden states and returned once,
with the step that finishes the prompt. vLLM's scheduler never lets a request
with ``prompt_logprobs`` read the prefix cache (``skip_reading_prefix_cache``),
so every prompt position is computed by the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.logits_processor import LogitsProcessors, build_logitsprocs
from vllm.v1.sample.sampler import Sampler

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_hpu_mm.worker.requests import RequestState


def build_logits_processors(
    vllm_config: VllmConfig, device: torch.device
) -> tuple[LogitsProcessors, bool]:
    """vLLM's built-in processors (min_p, logit_bias, min_tokens) and the
    custom classes of ``--logits-processors``; and whether the processors may
    read output token ids (custom ones might, as vLLM's GPU runner assumes)."""
    custom = tuple(vllm_config.model_config.logits_processors or ())
    procs = build_logitsprocs(
        vllm_config,
        device,
        is_pin_memory=False,
        is_pooling_model=False,
        custom_logitsprocs=custom,
    )
    return procs, bool(custom)


class PromptLogprobs:
    """Prompt logprobs of the requests that asked for them, across chunks."""

    def __init__(self, vocab_size: int, logprobs_mode: str) -> None:
        self.vocab_size = vocab_size
        self.logprobs_mode = logprobs_mode
        self.pending: dict[str, int] = {}  # req_id -> logprobs per position
        self._tensors: dict[str, LogprobsTensors] = {}

    def add(self, req_id: str, params: Any) -> None:
        n = getattr(params, "prompt_logprobs", None)
        if n is not None:
            self.pending[req_id] = self.vocab_size if n == -1 else n

    def drop(self, req_id: str) -> None:
        self.pending.pop(req_id, None)
        self._tensors.pop(req_id, None)

    def collect(
        self,
        hidden: torch.Tensor,
        starts: dict[str, int],
        scheduled: dict[str, int],
        states: dict[str, RequestState],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, LogprobsTensors | None]:
        """Fill this step's chunk of each pending request.

        ``hidden``: [padded tokens, H]; ``starts[req_id]``: token row of the
        request's first scheduled token (its tokens are consecutive rows).
        Returns the requests whose prompt is complete with this step.
        """
        done: dict[str, LogprobsTensors | None] = {}
        for req_id, k in list(self.pending.items()):
            if req_id not in scheduled:  # preempted during its prefill
                continue
            state = states[req_id]
            n_prompt = state.num_prompt_tokens
            tensors = self._tensors.get(req_id)
            if tensors is None:
                tensors = LogprobsTensors.empty_cpu(n_prompt - 1, k + 1)
                self._tensors[req_id] = tensors
            start = state.num_computed_tokens  # position of the chunk's first token
            remaining = n_prompt - (start + 1)
            num = scheduled[req_id]
            if num > remaining:  # the prompt ends in this chunk
                num = remaining
                done[req_id] = tensors
            if num > 0:
                self._fill(
                    tensors,
                    hidden,
                    starts[req_id],
                    start,
                    num,
                    k,
                    state,
                    compute_logits,
                )
        for req_id in done:
            del self.pending[req_id]
            del self._tensors[req_id]
        return done

    def _fill(
        self,
        tensors: LogprobsTensors,
        hidden: torch.Tensor,
        row: int,
        start: int,
        num: int,
        k: int,
        state: RequestState,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        logits = compute_logits(hidden[row : row + num])  # [num, V]
        # position p predicts prompt token p + 1
        targets = torch.tensor(
            state.prompt_token_ids[start + 1 : start + 1 + num],
            dtype=torch.int64,
            device=logits.device,
        )
        if self.logprobs_mode in ("raw_logits", "processed_logits"):
            scores = logits.to(torch.float32)
        else:
            scores = Sampler.compute_logprobs(logits)
        ids, lps, ranks = _gather_prompt_logprobs(scores, k, targets)
        chunk = slice(start, start + num)
        tensors.logprob_token_ids[chunk].copy_(ids)
        tensors.logprobs[chunk].copy_(lps)
        tensors.selected_token_ranks[chunk].copy_(ranks)


def _gather_prompt_logprobs(
    scores: torch.Tensor, k: int, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``gather_logprobs`` of ``scores [num, V]`` for the prompt's next
    tokens ``targets [num]``, including tokens the head cannot produce.

    A prompt may hold ids past the head's ``V`` outputs: Mllama's
    ``<|image|>`` is the text vocabulary's size (128256 on Llama 3.2 Vision,
    whose head has 128256 rows). Such a token gets logprob ``-inf`` (vLLM's
    OpenAI server clamps it for JSON, ``clamp_prompt_logprobs``) and rank
    ``V``, as vLLM ranks a ``-inf`` target (every score is at least it)."""
    vocab = scores.shape[-1]
    outside = targets >= vocab
    if not bool(outside.any()):
        ids, lps, ranks, *_ = Sampler.gather_logprobs(scores, k, targets)
        return ids, lps, ranks
    ids, lps, ranks, *_ = Sampler.gather_logprobs(
        scores, k, targets.clamp(max=vocab - 1)
    )
    ids[outside, 0] = targets[outside].to(ids.dtype)
    lps[outside, 0] = float("-inf")
    ranks[outside] = vocab
    return ids, lps, ranks
