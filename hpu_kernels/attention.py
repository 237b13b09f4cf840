"""Paged attention in pure PyTorch, with static shapes and no Python loops.

KV cache of one layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head]``
(index 0 keys, 1 values). Slot ``s`` is row ``s`` of the cache viewed as
``[2, num_blocks * block_size, num_kv_heads, head]``. Block 0 is vLLM's null block:
no request ever owns it, so padding writes its slots and padding reads mask it.

Two layouts, each with shapes fixed by the caller's bucket:

- ``prefill_attention`` (flat): the tokens of all prefill requests of a step are
  concatenated (``T`` rows) and attend to the concatenation of those requests'
  context blocks (``NB`` blocks, ``K = NB * block_size`` key rows). A boolean mask
  keeps each token to its own request, to causal order and to the sliding
  window. Covers chunked prefill with prior context and prefix-cache hits: the
  context is whatever the blocks hold.
- ``decode_attention`` (batched): one query per request, ``B`` rows, keys
  gathered through a ``[B, M]`` block table.

GQA is handled by SDPA's ``enable_gqa`` (no K/V repeat).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Sentinels: a padding token belongs to request -1 and a padding block to -2, so
# that padding never matches padding.
PAD_TOKEN_REQ = -1
PAD_BLOCK_REQ = -2


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into their cache slots.

    kv_cache: [2, NB, BS, Hkv, D]; key, value: [T, Hkv, D];
    slot_mapping: [T] int64, padding rows point into the null block 0.
    """
    _, num_blocks, block_size, num_kv_heads, head = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head)
    n = slot_mapping.shape[0]
    flat[0].index_copy_(0, slot_mapping, key[:n].to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value[:n].to(flat.dtype))


def _sdpa(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, Hkv, K, D]
    value: torch.Tensor,  # [B, Hkv, K, D]
    mask: torch.Tensor,  # [B, 1, Q, K] bool, True = attend
    scale: float,
) -> torch.Tensor:
    gqa = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa
    )


def _window_ok(
    key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor | bool:
    """True where the key lies inside the query's sliding window (broadcasts)."""
    if sliding_window is None:
        return True
    return key_pos > query_pos - sliding_window


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    ctx_blocks: torch.Tensor,
    ctx_block_req: torch.Tensor,
    ctx_block_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for a flat batch of prefill tokens over paged context.

    query: [T, H, D]; token_req: [T] request index of each token (-1 padding);
    token_pos: [T] absolute position of each token in its request;
    ctx_blocks: [NB] cache block ids of the batch's context (0 for padding);
    ctx_block_req: [NB] request index owning each block (-2 padding);
    ctx_block_pos: [NB] position held by the block's first slot.
    The current tokens' own K/V must already be written (``write_kv``).
    Returns [T, H, D].
    """
    num_tokens = query.shape[0]
    block_size = kv_cache.shape[2]
    num_keys = ctx_blocks.shape[0] * block_size
    # [NB, BS, Hkv, D] -> [Hkv, K, D]
    keys = kv_cache[0].index_select(0, ctx_blocks).flatten(0, 1).transpose(0, 1)
    values = kv_cache[1].index_select(0, ctx_blocks).flatten(0, 1).transpose(0, 1)
    offsets = torch.arange(block_size, device=query.device)
    key_req = ctx_block_req.repeat_interleave(block_size)  # [K]
    key_pos = (ctx_block_pos[:, None] + offsets[None, :]).flatten()  # [K]

    q_pos = token_pos[:, None]  # [T, 1]
    mask = (
        (token_req[:, None] == key_req[None, :])
        & (key_pos[None, :] <= q_pos)
        & _window_ok(key_pos[None, :], q_pos, sliding_window)
    )  # [T, K]
    # A padding token would see no key at all (softmax of nothing is NaN): let
    # it read key 0; its output is dropped.
    first_key = torch.arange(num_keys, device=query.device) == 0
    mask = mask | ((token_req < 0)[:, None] & first_key[None, :])

    out = _sdpa(
        query.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
        keys.unsqueeze(0).to(query.dtype),
        values.unsqueeze(0).to(query.dtype),
        mask.view(1, 1, num_tokens, num_keys),
        scale,
    )
    return out.squeeze(0).transpose(0, 1)  # [T, H, D]


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per request against its paged context.

    query: [B, H, D]; block_table: [B, M] block ids (0 past the end);
    seq_lens: [B] tokens in context including the current one (0 for padding
    rows). Returns [B, H, D].
    """
    batch, max_blocks = block_table.shape
    _, _, block_size, num_kv_heads, head = kv_cache.shape
    num_keys = max_blocks * block_size
    flat_ids = block_table.reshape(-1)
    # [B*M, BS, Hkv, D] -> [B, Hkv, K, D]
    keys = (
        kv_cache[0]
        .index_select(0, flat_ids)
        .view(batch, num_keys, num_kv_heads, head)
        .transpose(1, 2)
    )
    values = (
        kv_cache[1]
        .index_select(0, flat_ids)
        .view(batch, num_keys, num_kv_heads, head)
        .transpose(1, 2)
    )
    key_pos = torch.arange(num_keys, device=query.device)[None, :]  # [1, K]
    q_pos = (seq_lens - 1)[:, None]  # [B, 1]
    mask = (key_pos <= q_pos) & _window_ok(key_pos, q_pos, sliding_window)
    mask = mask | ((seq_lens <= 0)[:, None] & (key_pos == 0))  # padding rows
    out = _sdpa(
        query.unsqueeze(2),  # [B, H, 1, D]
        keys.to(query.dtype),
        values.to(query.dtype),
        mask.view(batch, 1, 1, num_keys),
        scale,
    )
    return out.squeeze(2)  # [B, H, D]
