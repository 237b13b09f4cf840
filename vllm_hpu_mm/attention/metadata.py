"""Attention metadata of one engine step, and the pure function that builds it.

Index spaces used below:

- *token rows*: rows of the step's flattened token batch, decode rows first
  (``[0, num_decodes)``), then prefill rows (``[num_decodes, num_tokens)``);
- *positions*: a token's absolute position inside its request;
- *slots*: rows of a layer's KV cache seen as ``[num_blocks * block_size]``.

Every tensor has a length fixed by the step's bucket (``StepShape``); padding
entries are described field by field and never touch a real KV slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionMetadata

if TYPE_CHECKING:
    from vllm_hpu_mm.worker.buffers import DeviceBuffers

from hpu_kernels.attention import PAD_BLOCK_REQ, PAD_TOKEN_REQ

# The slot padding tokens write to: slot 0 of vLLM's null block, owned by no request.
PAD_SLOT = 0
PAD_BLOCK = 0


@dataclass(frozen=True, slots=True)
class StepShape:
    """Padded sizes of one step (a bucket). Real sizes must not exceed them."""

    num_decodes: int  # decode rows (one token each)
    decode_blocks: int  # block-table width of the decode rows
    num_prefill_tokens: int  # flattened prefill tokens
    prefill_blocks: int  # context blocks of all prefill requests together

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + self.num_prefill_tokens


@dataclass
class HpuMMAttentionMetadata(AttentionMetadata):
    """What the attention kernels need for one step, shared by all layers."""

    num_decodes: int
    """Decode rows (padded): token rows [0, num_decodes) are one request each."""
    num_prefill_tokens: int
    """Prefill token rows (padded): rows [num_decodes, num_decodes + this)."""
    num_actual_tokens: int
    """Real (unpadded) tokens of the step, decode and prefill together."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64, cache slot written by each token row; padding rows
    write PAD_SLOT in the null block."""
    decode_block_table: torch.Tensor
    """[num_decodes, decode_blocks] int64 block ids; PAD_BLOCK past each row's
    last block and on padding rows."""
    decode_seq_lens: torch.Tensor
    """[num_decodes] int64 context length including the current token; 0 on
    padding rows."""
    prefill_token_req: torch.Tensor
    """[num_prefill_tokens] int64 index (among the step's prefill requests) of
    each prefill row's request; PAD_TOKEN_REQ (-1) on padding rows."""
    prefill_token_pos: torch.Tensor
    """[num_prefill_tokens] int64 position of each prefill row; 0 on padding."""
    prefill_ctx_blocks: torch.Tensor
    """[prefill_blocks] int64 cache blocks holding every prefill request's
    context (prior chunks, prefix-cache hits and this chunk), request after
    request; PAD_BLOCK on padding."""
    prefill_ctx_block_req: torch.Tensor
    """[prefill_blocks] int64 owning request of each block; PAD_BLOCK_REQ (-2)
    on padding, so padding tokens and padding blocks never match."""
    prefill_ctx_block_pos: torch.Tensor
    """[prefill_blocks] int64 position held by each block's first slot."""
    mm_maps: dict[str, object] = field(default_factory=dict)
    """Per modality: the placeholder row maps (encoder-output rows to token
    rows) of this step's chunk, filled by the multimodal input builder."""
    cross: object | None = None
    """Cross-attention inputs of the step (``attention.cross``), for models whose
    images are read by cross-attention layers; None otherwise."""


def _ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(n) for each n in lengths."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts


def exact_shape(
    query_lens: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> StepShape:
    """The unpadded StepShape of a batch ordered decodes first."""
    num_decodes = count_leading_decodes(query_lens)
    blocks = -(-seq_lens // block_size)
    return StepShape(
        num_decodes=num_decodes,
        decode_blocks=int(blocks[:num_decodes].max(initial=0)),
        num_prefill_tokens=int(query_lens[num_decodes:].sum()),
        prefill_blocks=int(blocks[num_decodes:].sum()),
    )


def count_leading_decodes(query_lens: np.ndarray) -> int:
    """Requests at the front of the batch with exactly one query token."""
    not_decode = np.flatnonzero(query_lens != 1)
    return int(not_decode[0]) if not_decode.size else int(query_lens.size)


def build_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    shape: StepShape,
    device: torch.device,
    buffers: DeviceBuffers | None = None,
) -> HpuMMAttentionMetadata:
    """Build the step's metadata, padded to ``shape``.

    query_lens: [R] tokens scheduled per request, decode requests (1 token)
    first; seq_lens: [R] context length after this step's tokens;
    block_table: [R, >= max blocks] block ids per request;
    slot_mapping: [sum(query_lens)] slots of the real tokens, in token-row order.
    buffers: when given, the tensors are views of these reused device buffers.
    """
    num_dec = count_leading_decodes(query_lens)
    real = exact_shape(query_lens, seq_lens, block_size)
    check_fits(real, shape)
    blocks = -(-seq_lens // block_size)

    # Decode rows.
    dec_table = np.full((shape.num_decodes, shape.decode_blocks), PAD_BLOCK, np.int64)
    width = real.decode_blocks
    dec_table[:num_dec, :width] = block_table[:num_dec, :width]
    cols = np.arange(width)[None, :]
    dec_table[:num_dec, :width][cols >= blocks[:num_dec, None]] = PAD_BLOCK
    dec_seq = np.zeros(shape.num_decodes, np.int64)
    dec_seq[:num_dec] = seq_lens[:num_dec]

    # Prefill rows: token -> (request, position).
    p_q = query_lens[num_dec:]
    p_seq = seq_lens[num_dec:]
    p_blocks = blocks[num_dec:]
    n_tok, n_blk = real.num_prefill_tokens, real.prefill_blocks
    tok_req = np.full(shape.num_prefill_tokens, PAD_TOKEN_REQ, np.int64)
    tok_pos = np.zeros(shape.num_prefill_tokens, np.int64)
    local = np.arange(p_q.size, dtype=np.int64)
    tok_req[:n_tok] = np.repeat(local, p_q)
    tok_pos[:n_tok] = np.repeat(p_seq - p_q, p_q) + _ragged_arange(p_q)
    # Prefill context blocks, request after request.
    ctx_blocks = np.full(shape.prefill_blocks, PAD_BLOCK, np.int64)
    ctx_req = np.full(shape.prefill_blocks, PAD_BLOCK_REQ, np.int64)
    ctx_pos = np.zeros(shape.prefill_blocks, np.int64)
    blk_req = np.repeat(local, p_blocks)
    blk_idx = _ragged_arange(p_blocks)
    ctx_blocks[:n_blk] = block_table[num_dec:][blk_req, blk_idx]
    ctx_req[:n_blk] = blk_req
    ctx_pos[:n_blk] = blk_idx * block_size

    # Slots: decode rows, pad, prefill rows, pad.
    slots = np.full(shape.num_tokens, PAD_SLOT, np.int64)
    slots[:num_dec] = slot_mapping[:num_dec]
    slots[shape.num_decodes : shape.num_decodes + n_tok] = slot_mapping[num_dec:]

    def t(a: np.ndarray, name: str) -> torch.Tensor:
        if buffers is not None:
            return buffers.put(name, a)
        return torch.from_numpy(a).to(device, non_blocking=True)

    return HpuMMAttentionMetadata(
        num_decodes=shape.num_decodes,
        num_prefill_tokens=shape.num_prefill_tokens,
        num_actual_tokens=int(query_lens.sum()),
        slot_mapping=t(slots, "slot_mapping"),
        decode_block_table=t(dec_table, "decode_block_table"),
        decode_seq_lens=t(dec_seq, "decode_seq_lens"),
        prefill_token_req=t(tok_req, "prefill_token_req"),
        prefill_token_pos=t(tok_pos, "prefill_token_pos"),
        prefill_ctx_blocks=t(ctx_blocks, "prefill_ctx_blocks"),
        prefill_ctx_block_req=t(ctx_req, "prefill_ctx_block_req"),
        prefill_ctx_block_pos=t(ctx_pos, "prefill_ctx_block_pos"),
    )


def check_fits(real: StepShape, shape: StepShape) -> None:
    for name in StepShape.__slots__:
        if getattr(real, name) > getattr(shape, name):
            raise ValueError(
                f"step needs {name}={getattr(real, name)} but its bucket "
                f"{shape} has only {getattr(shape, name)}"
            )


def token_row_of_real_tokens(query_lens: np.ndarray, shape: StepShape) -> np.ndarray:
    """[sum(query_lens)] token row of each real token in the padded layout."""
    num_dec = count_leading_decodes(query_lens)
    n_pre = int(query_lens[num_dec:].sum())
    return np.concatenate(
        [
            np.arange(num_dec, dtype=np.int64),
            shape.num_decodes + np.arange(n_pre, dtype=np.int64),
        ]
    )
