"""Turn one SchedulerOutput into the model's padded inputs.

Layout (token rows): decode requests first (one row each, padded to the
bucket's decode rows), then the prefill requests' tokens flattened (padded to
the bucket's prefill tokens). Padding rows carry token 0 at position 0 and write
the null block's slot, so they never touch a real KV slot.

A mixed step runs as two passes (``step_passes``) where graphs are keyed by
static shapes: the decode rows, then the prefill rows, each with its own
metadata and graph key; the hidden states are concatenated back into the same
token-row layout, so ``logits_rows`` is unchanged. Where the graph key is the
token count alone and that count is symbolic (opaque attention off Gaudi), or
there are no graphs (eager off Gaudi), it runs as one pass: the weights are
read once per step instead of twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hpu_mm.attention.cross import CrossAttentionMetadata
from vllm_hpu_mm.attention.metadata import (
    DECODE_FORM,
    HpuMMAttentionMetadata,
    MetadataKind,
    StaticAttentionMetadata,
    StepShape,
    build_metadata,
    check_fits,
    exact_shape,
    split_metadata,
    token_row_of_real_tokens,
)
from vllm_hpu_mm.multimodal.placeholders import bidirectional_spans, request_chunks
from vllm_hpu_mm.worker.buffers import DeviceBuffers
from vllm_hpu_mm.worker.merge import split_maps
from vllm_hpu_mm.worker.mrope import gather_mrope
from vllm_hpu_mm.worker.requests import RequestState


@dataclass(slots=True)
class StepBatch:
    """The padded inputs of one step, in the runner's request order."""

    req_ids: list[str]  # batch order: decodes first
    query_lens: np.ndarray  # [R] scheduled tokens per request
    seq_lens: np.ndarray  # [R] context length after this step
    shape: StepShape  # the bucket the step is padded to
    input_ids: torch.Tensor  # [shape.num_tokens] int64
    positions: torch.Tensor  # [shape.num_tokens] int64; M-RoPE models:
    # [channels, shape.num_tokens] (``worker.mrope``), padding rows at 0
    logits_rows: torch.Tensor  # [batch bucket] token row of each request's last
    # token; padding rows repeat row 0 and their logits are dropped
    attn_metadata: HpuMMAttentionMetadata
    row_starts: np.ndarray  # [R] token row of each request's first token

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_real_tokens(self) -> int:
        return int(self.query_lens.sum())


def order_requests(num_scheduled: dict[str, int]) -> list[str]:
    """Decode requests (one scheduled token) first, each group in scheduler order."""
    decodes = [r for r, n in num_scheduled.items() if n == 1]
    prefills = [r for r, n in num_scheduled.items() if n != 1]
    return decodes + prefills


def gather_step(
    states: list[RequestState], query_lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Real tokens of the step, unpadded and in batch order.

    Returns (token_ids [N], positions [N], slots [N], seq_lens [R],
    block_table [R, max_blocks]) where N = sum(query_lens).
    """
    starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
    seq_lens = starts + query_lens
    token_ids = np.fromiter(
        (
            t
            for s, a, n in zip(states, starts, query_lens, strict=True)
            for t in s.token_ids(int(a), int(a + n))
        ),
        np.int64,
        int(query_lens.sum()),
    )
    width = max((len(s.block_ids) for s in states), default=0)
    block_table = np.zeros((len(states), max(width, 1)), np.int64)
    for i, s in enumerate(states):
        block_table[i, : len(s.block_ids)] = s.block_ids
    req_of_token = np.repeat(np.arange(len(states)), query_lens)
    positions = np.repeat(starts, query_lens) + (
        np.arange(token_ids.size)
        - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    )
    blocks = block_table[req_of_token, positions // block_size]
    slots = blocks * block_size + positions % block_size
    return token_ids, positions, slots, seq_lens, block_table


def build_step(
    req_ids: list[str],
    states: list[RequestState],
    query_lens: np.ndarray,
    shape_for: Callable[[StepShape, int], tuple[StepShape, int]],
    block_size: int,
    device: torch.device,
    buffers: DeviceBuffers | None = None,
    kind: MetadataKind = "static",
    bidirectional_images: bool = False,
) -> StepBatch:
    """Gather, choose the bucket and pad.

    ``shape_for(exact_shape, num_reqs) -> (padded shape, padded batch)``.
    ``bidirectional_images``: the model's image tokens attend to each other
    both ways (Gemma 3); the attention metadata then carries their spans.
    ``kind``: the plan's attention metadata (``ExecutionPlan.attention_metadata``).
    """
    token_ids, positions, slots, seq_lens, block_table = gather_step(
        states, query_lens, block_size
    )
    spans = None
    if bidirectional_images:
        first_token = np.cumsum(query_lens) - query_lens  # in real-token order
        chunks = request_chunks(states, query_lens, first_token)
        spans = bidirectional_spans(chunks, int(query_lens.sum()))
    exact = exact_shape(
        query_lens, seq_lens, block_size, DECODE_FORM[kind], spans=spans
    )
    shape, batch_rows = shape_for(exact, len(req_ids))
    check_fits(exact, shape)  # before any padded array is filled
    if batch_rows < len(req_ids):
        raise ValueError(f"step has {len(req_ids)} requests, batch bucket {batch_rows}")
    rows = token_row_of_real_tokens(query_lens, shape)
    ids = np.zeros(shape.num_tokens, np.int64)
    pos = np.zeros(shape.num_tokens, np.int64)
    ids[rows] = token_ids
    pos[rows] = positions
    if states and states[0].mrope is not None:
        # The rotary positions are the model's M-RoPE ones; ``positions``
        # (token indices) still decides the KV slots above.
        entries = [s.mrope for s in states]
        assert all(e is not None for e in entries), "M-RoPE positions missing"
        real = gather_mrope(entries, seq_lens - query_lens, query_lens)  # type: ignore[arg-type]
        pos = np.zeros((real.shape[0], shape.num_tokens), np.int64)
        pos[:, rows] = real
    logits_rows = np.zeros(batch_rows, np.int64)
    logits_rows[: len(req_ids)] = rows[np.cumsum(query_lens) - 1]
    md = build_metadata(
        query_lens,
        seq_lens,
        block_table,
        slots,
        block_size,
        shape,
        device,
        buffers,
        kind,
        spans=spans,
    )

    def t(a: np.ndarray, name: str) -> torch.Tensor:
        if buffers is not None:
            return buffers.put(name, a)
        return torch.from_numpy(a).to(device)

    return StepBatch(
        req_ids=req_ids,
        query_lens=query_lens,
        seq_lens=seq_lens,
        shape=shape,
        input_ids=t(ids, "input_ids"),
        positions=t(pos, "positions"),
        logits_rows=t(logits_rows, "logits_rows"),
        row_starts=rows[np.cumsum(query_lens) - query_lens],
        attn_metadata=md,
    )


@dataclass(slots=True)
class StepPass:
    """One model pass of a step: token rows [start, stop) and their metadata."""

    start: int
    stop: int
    attn_metadata: HpuMMAttentionMetadata


def step_passes(md: HpuMMAttentionMetadata, split: bool = True) -> list[StepPass]:
    """The passes of a step: one, or (a mixed step, ``split``) decode rows
    then prefill rows."""
    n_dec, n_pre = md.num_decodes, md.num_prefill_tokens
    if not (split and n_dec and n_pre):
        return [StepPass(0, n_dec + n_pre, md)]
    if not isinstance(md, StaticAttentionMetadata):
        raise TypeError(
            f"a mixed step splits into two passes under the static plan only, "
            f"got {type(md).__name__}"
        )
    decode, prefill = split_metadata(md)
    if isinstance(md.cross, CrossAttentionMetadata):
        decode.cross, prefill.cross = split_cross(md.cross, n_dec)
    if md.mm_maps:
        decode.mm_maps, prefill.mm_maps = split_maps(md.mm_maps, n_dec)
    return [StepPass(0, n_dec, decode), StepPass(n_dec, n_dec + n_pre, prefill)]


def split_cross(
    cross: CrossAttentionMetadata, n_dec: int
) -> tuple[CrossAttentionMetadata, CrossAttentionMetadata]:
    """Cross-attention inputs of a mixed step's decode and prefill rows (every
    other field, such as the real rows per tile, carried over unchanged)."""
    return (
        dataclasses.replace(
            cross,
            pre_slots=cross.pre_slots[:0],
            pre_tile_mask=cross.pre_tile_mask[:0, :0],
            active=cross.active[:n_dec],
            mlp_scale=cross.mlp_scale[:n_dec],
        ),
        dataclasses.replace(
            cross,
            dec_slots=cross.dec_slots[:0],
            dec_tile_mask=cross.dec_tile_mask[:0],
            active=cross.active[n_dec:],
            mlp_scale=cross.mlp_scale[n_dec:],
        ),
    )
