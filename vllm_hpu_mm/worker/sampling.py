"""Sampling metadata for vLLM's Sampler, built from the step's requests."""

from __future__ import annotations

import torch
from vllm.sampling_params import SamplingType
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_hpu_mm.worker.requests import RequestState


def build_sampling_metadata(
    states: list[RequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """One row per request, in batch order."""
    params = [s.sampling_params for s in states]
    greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    temperature = [
        0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)
    ]
    top_p = [p.top_p for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    logprobs = [
        vocab_size if p.logprobs == -1 else p.logprobs
        for p in params
        if p.logprobs is not None
    ]
    no_penalties = all(
        p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and p.repetition_penalty == 1.0
        for p in params
    )

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    allowed_mask = None
    if any(p.allowed_token_ids for p in params):
        # True = masked out (vLLM's convention).
        allowed_mask = torch.zeros(len(states), vocab_size, dtype=torch.bool)
        for i, p in enumerate(params):
            if p.allowed_token_ids:
                allowed_mask[i] = True
                allowed_mask[i, p.allowed_token_ids] = False
        allowed_mask = allowed_mask.to(device)

    return SamplingMetadata(
        temperature=f32(temperature),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None if all(v == 1.0 for v in top_p) else f32(top_p),
        top_k=None
        if all(v == vocab_size for v in top_k)
        else torch.tensor(top_k, dtype=torch.int32, device=device),
        generators={i: s.generator for i, s in enumerate(states) if s.generator},
        max_num_logprobs=max(logprobs) if logprobs else None,
        no_penalties=no_penalties,
        prompt_token_ids=None
        if no_penalties
        else _prompt_ids(states, vocab_size, device),
        frequency_penalties=f32([p.frequency_penalty for p in params]),
        presence_penalties=f32([p.presence_penalty for p in params]),
        repetition_penalties=f32([p.repetition_penalty for p in params]),
        output_token_ids=[s.output_token_ids for s in states],
        allowed_token_ids_mask=allowed_mask,
        bad_words_token_ids={
            i: p.bad_words_token_ids
            for i, p in enumerate(params)
            if p.bad_words_token_ids
        },
        logitsprocs=LogitsProcessors(),
    )


def _prompt_ids(
    states: list[RequestState], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[R, longest prompt] prompt ids padded with vocab_size (the penalty pad)."""
    width = max(s.num_prompt_tokens for s in states)
    out = torch.full((len(states), width), vocab_size, dtype=torch.int64)
    for i, s in enumerate(states):
        out[i, : s.num_prompt_tokens] = torch.tensor(s.prompt_token_ids)
    return out.to(device)
