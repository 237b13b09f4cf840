"""Paged attention in pure PyTorch, with static shapes and no Python loops.

KV cache of one layer: a ``KVCache``, a key and a value tensor of
``[num_blocks * block_size, num_kv_heads, head]`` each, two tensors rather than
two views of one (the official plugin's layout: vllm-gaudi
``HPUAttentionBackend.get_kv_cache_shape`` and ``VLLMKVCache``). Slot ``s`` is
row ``s``; block ``b`` is rows ``[b * block_size, (b + 1) * block_size)``.
Block 0 is vLLM's null block: no request ever owns it, so padding writes its
slots and padding reads mask it.

Each kernel costs what the step's tokens need, not the square of the step:

- ``prefill_attention`` (block-diagonal tiles): the step's prefill tokens stay
  flat (``T`` rows) and are cut into ``NT`` tiles of ``tq`` rows. A tile attends
  only to the context blocks of the requests its rows belong to, up to its last
  row's position (``[NT, CB]`` block ids), through a ``[NT, tq, CB * BS]``
  boolean mask built once per step (request, causality; the sliding window is
  added per layer from the positions). Cost ``T x CB x BS`` where ``CB`` is the
  context of a tile's own requests, instead of ``T x`` the whole step's context.
  Chunked prefill with prior context and prefix-cache hits are covered: the
  context is whatever the blocks hold. Bidirectional image spans (Gemma 3) add
  each row's span as a range of its tile's key columns. The form is batched
  SDPA (FusedSDPA on HPU takes it).
- ``decode_attention`` (flat paged attention, after the Gaudi plugin's
  ``flat_pa``): the real blocks of every decode request form one flat list
  (``NB`` blocks, bucketed on the total); each block yields softmax partials
  (max, sum, weighted values) for its request's query, and a per-request
  reduction combines them. Cost ``NB x BS``: a short request no longer pays for
  the longest one.
- ``batched_decode_attention``: the ``[B, M]`` block-table form (every row
  padded to the widest table, through SDPA), the decode form off Gaudi
  (``worker.shapes.decode_form_for``: CPU and CUDA), where it measured faster
  than the flat list's small per-block matmuls; eager on the CPU the dense
  decode cache below replaces it when the cache is built.
- ``request_prefill_attention`` (the CPU and CUDA, attention outside any
  graph): request by request, a whole prompt attends its own new K/V with
  SDPA's causal kernel (no mask, no gather: the upper triangle is skipped),
  and a chunk with prior context attends its blocks with a bottom-right causal
  mask. The tiles' masked SDPA computes the whole ``tq x CB * BS`` square:
  twice the causal work for a fresh prompt.
- ``dense_decode_attention`` (attention outside any graph; the runner uses it
  on the CPU):
  decode rows read a dense per-request copy of their K/V (``[2, S, Hkv, L,
  D]``, one slot per decoding request, kept step to step) instead of
  gathering their blocks from the paged cache each layer. A request's blocks
  are copied into its slot once, when it starts decoding; each step appends
  one token. The gather was 60 % of decode attention on the CPU.

An FP8 cache (``KVCache.quant``, ``--kv-cache-dtype fp8``) holds keys and
values divided by the layer's scales; every read above dequantizes what it
gathers (``read_keys`` / ``read_values``) to the query's dtype.

GQA is handled by SDPA's ``enable_gqa`` and by grouping heads (no K/V repeat).
The SDPA callable is a parameter (default torch's) so a device can plug in its
fused kernel (FusedSDPA on Gaudi) through ``vllm_hpu_mm.device``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hpu_kernels.kv_fp8 import KVQuant, write_rows

SdpaFn = Callable[..., torch.Tensor]
"""``(query [N, H, Q, D], key [N, Hkv, K, D], value, attn_mask=, scale=,
enable_gqa=) -> [N, H, Q, D]``, the signature of F.scaled_dot_product_attention."""

# Position given to padding query rows: every key passes their window test, so
# the key the mask keeps for them (key 0) survives any sliding window.
PAD_QUERY_POS = -(2**40)

# Additive score of a masked key in flat decode: finite, so that a block with no
# visible key still has a finite max (its weight in the reduction is then 0).
MASKED_SCORE = -1e30


class KVCache(NamedTuple):
    """One attention layer's paged KV cache.

    key, value: [num_blocks * block_size, Hkv, D] each, slot ``s`` at row
    ``s``. Two separate tensors, so that inside a graph compiled by Habana's
    ``hpu_backend`` each is a graph input of its own that the KV write mutates
    in place (``index_copy_`` on a non-view input, which its compile passes
    reinplace). Written through two views of one ``[2, ...]`` tensor,
    AOTAutograd rebuilds the whole base (``select_scatter``) and copies it
    back into the input every layer and step.
    """

    key: torch.Tensor
    value: torch.Tensor
    block_size: int
    # An FP8 cache's scales and casts (``--kv-cache-dtype fp8``), given by the
    # attention layer for its forward; None: the cache holds compute values.
    quant: KVQuant | None = None

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[1])

    @property
    def head_size(self) -> int:
        return int(self.key.shape[2])


def blocks_of(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """[NB * BS, Hkv, D] -> its [NB, BS, Hkv, D] view, for reading by block."""
    rows, num_kv_heads, head = cache.shape
    return cache.view(rows // block_size, block_size, num_kv_heads, head)


def read_keys(
    kv_cache: KVCache, keys: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Keys read from ``kv_cache`` (any shape) as ``dtype``: an FP8 cache's
    dequantized with its key scale (``hpu_kernels.kv_fp8``)."""
    q = kv_cache.quant
    return keys.to(dtype) if q is None else q.dequantize(keys, q.k_scale, dtype)


def read_values(
    kv_cache: KVCache, values: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``read_keys`` for values (the value scale)."""
    q = kv_cache.quant
    return values.to(dtype) if q is None else q.dequantize(values, q.v_scale, dtype)


def kv_cache_of_stacked(stacked: torch.Tensor) -> KVCache:
    """A ``KVCache`` over the two halves of one ``[2, NB, BS, Hkv, D]`` tensor
    (views: writes land in ``stacked``). For eager callers and tests only:
    inside a graph compiled by ``hpu_backend``, K and V views taken of one
    ``[2, ...]`` input are what costs a whole-cache copy (see ``KVCache``)."""
    _, num_blocks, block_size, num_kv_heads, head = stacked.shape
    flat = stacked.view(2, num_blocks * block_size, num_kv_heads, head)
    return KVCache(flat[0], flat[1], block_size)


@torch.library.custom_op("hpu_mm::write_kv", mutates_args=("key_cache", "value_cache"))
def _write_kv_op(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    n = slot_mapping.shape[0]
    write_rows(key_cache, slot_mapping, key[:n].to(key_cache.dtype))
    write_rows(value_cache, slot_mapping, value[:n].to(value_cache.dtype))


@_write_kv_op.register_fake
def _(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    return None


def write_kv(
    kv_cache: KVCache,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into their cache slots.

    key, value: [T, Hkv, D]; slot_mapping: [T'] int64 (T' <= T), padding rows
    point into the null block 0. An FP8 cache takes keys and values already
    quantized (``kv_fp8.quantize_kv``).

    A custom op that mutates the cache in place, so that a graph compiled by
    Inductor writes the step's slots instead of copying the whole cache (a
    traced in-place write to a graph input is functionalised into a copy of
    it, which Inductor reinplaces only for custom ops it knows).
    """
    _write_kv_op(kv_cache.key, kv_cache.value, key, value, slot_mapping)


def write_kv_plain(
    kv_cache: KVCache,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``write_kv`` as plain in-place ``index_copy_`` on the layer's K and V
    tensors, for graphs compiled by Habana's ``hpu_backend``.

    Same arguments and effect as ``write_kv``. Traced through AOTAutograd, the
    custom op would become an ``auto_functionalized`` higher-order op, which
    Habana's graph compiler does not implement (only ``cond`` / ``while_loop``),
    while it reinplaces a plain ``index_copy`` on a non-view input; the
    official plugin writes its cache the same way (vllm-gaudi
    ``extension/utils.py`` ``VLLMKVCache``: ``cache.index_copy_(0,
    slot_mapping, input)``, one K and one V tensor per layer).
    """
    n = slot_mapping.shape[0]
    # write_rows: index_copy_ (an FP8 cache's through its uint8 view on host
    # tensors, the simulated card's: PyTorch's CPU kernel lacks FP8).
    write_rows(kv_cache.key, slot_mapping, key[:n].to(kv_cache.key.dtype))
    write_rows(kv_cache.value, slot_mapping, value[:n].to(kv_cache.value.dtype))


def _gather_blocks(
    kv_cache: KVCache, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_ids [N, C] -> keys, values [N, Hkv, C * BS, D]."""
    n, c = block_ids.shape
    block_size = kv_cache.block_size
    flat_ids = block_ids.reshape(-1)

    def one(cache: torch.Tensor) -> torch.Tensor:
        return (
            blocks_of(cache, block_size)
            .index_select(0, flat_ids)
            .view(n, c * block_size, cache.shape[1], cache.shape[2])
            .transpose(1, 2)
        )

    return one(kv_cache.key), one(kv_cache.value)


def prefill_attention(
    query: torch.Tensor,
    kv_cache: KVCache,
    tile_blocks: torch.Tensor,
    tile_mask: torch.Tensor,
    tile_query_pos: torch.Tensor,
    tile_key_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sdpa: SdpaFn = F.scaled_dot_product_attention,
    span_lo: torch.Tensor | None = None,
    span_hi: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of flat prefill tokens, tile by tile, over paged context.

    query: [T, H, D], T <= NT * tq (rows past T are padding added here);
    tile_blocks: [NT, CB] cache blocks each tile reads (0 for padding);
    tile_mask: [NT, tq, CB * BS] bool, True where a row may attend a key (same
    request, key position <= query position); each padding row keeps key 0;
    tile_query_pos: [NT, tq] position of each row (PAD_QUERY_POS on padding);
    tile_key_pos: [NT, CB * BS] position of each key in its request.
    span_lo, span_hi: [NT, tq] int64 or None. Bidirectional image spans (Gemma
    3): a row also attends the key columns ``[span_lo, span_hi)`` of its tile
    (its image's tokens, later ones included); ``lo == hi`` adds nothing. The
    sliding window applies after, as in transformers' Gemma 3:
    ``window AND (causal OR span)``.
    The current tokens' own K/V must already be written (``write_kv``).
    Returns [T, H, D].
    """
    num_tokens, num_heads, head = query.shape
    num_tiles, tile = tile_mask.shape[:2]
    pad = num_tiles * tile - num_tokens
    q = F.pad(query, (0, 0, 0, 0, 0, pad)) if pad else query
    q = q.view(num_tiles, tile, num_heads, head).transpose(1, 2)  # [NT, H, tq, D]
    keys, values = _gather_blocks(kv_cache, tile_blocks)  # [NT, Hkv, K, D]
    mask = tile_mask
    if span_lo is not None and span_hi is not None:
        col = torch.arange(mask.shape[-1], device=mask.device)  # [K]
        in_span = (col >= span_lo[:, :, None]) & (col < span_hi[:, :, None])
        mask = mask | in_span  # [NT, tq, K]
    if sliding_window is not None:
        inside = tile_key_pos[:, None, :] > tile_query_pos[:, :, None] - sliding_window
        mask = mask & inside
    out = sdpa(
        q,
        read_keys(kv_cache, keys, query.dtype),
        read_values(kv_cache, values, query.dtype),
        attn_mask=mask.unsqueeze(1),  # [NT, 1, tq, K]
        is_causal=False,
        scale=scale,
        enable_gqa=num_heads != keys.shape[1],
    )
    return out.transpose(1, 2).reshape(num_tiles * tile, num_heads, head)[:num_tokens]


def causal_prefill_attention(
    query: torch.Tensor,
    kv_cache: KVCache,
    blocks: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sdpa: SdpaFn = F.scaled_dot_product_attention,
    window_tile: int = 128,
) -> torch.Tensor:
    """Causal attention of one fresh request's prompt (FusedSDPA's prompt form).

    query: [T, H, D], row i at position i (rows past the request's are padding;
    their outputs are discarded: they read the stale slots of the request's
    last block and the null block); blocks: [1, NB]
    int64 the request's blocks in order (NB * BS >= T), gathered once. Without
    a sliding window SDPA's own causal mask (``is_causal``), whose kernels skip
    the keys above the diagonal. With a window W: when the rows outnumber
    ``window_tile + W - 1``, the rows in tiles of ``window_tile``, each over the
    ``window_tile + W - 1`` keys its rows can reach (views of the one gather:
    ``_window_tiles``); else one banded mask over all the rows.
    The current tokens' own K/V must already be written (``write_kv``).
    Returns [T, H, D].
    """
    num_tokens, num_heads, _ = query.shape
    keys, values = _gather_blocks(kv_cache, blocks)  # [1, Hkv, NB * BS, D]
    k = read_keys(kv_cache, keys[:, :, :num_tokens], query.dtype)
    v = read_values(kv_cache, values[:, :, :num_tokens], query.dtype)
    q = query.transpose(0, 1)[None]  # [1, H, T, D]
    gqa = num_heads != keys.shape[1]
    if sliding_window is not None and window_tile + sliding_window - 1 < num_tokens:
        return _window_tiles(q, k, v, scale, sliding_window, sdpa, window_tile)
    mask = None
    if sliding_window is not None:
        pos = torch.arange(num_tokens, device=query.device)
        mask = _in_window(pos[:, None], pos[None, :], sliding_window)[None, None]
    out = sdpa(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )
    return out[0].transpose(0, 1)


def _in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Causal and inside a sliding window of ``window`` positions (the query's
    own included), broadcast over the two position tensors."""
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def _window_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int,
    sdpa: SdpaFn,
    tile: int,
) -> torch.Tensor:
    """Sliding-window causal attention of a fresh prompt in row tiles: q [1, H,
    T, D], k, v [1, Hkv, T, D] (position = row). Tile t's rows [t * tile, (t +
    1) * tile) read keys [t * tile - (W - 1), (t + 1) * tile): the keys padded
    by W - 1 rows in front (and to whole tiles behind) and unfolded into
    overlapping windows, so the computed scores are T x (tile + W - 1) instead
    of T x T. Returns [T, H, D]."""
    _, num_heads, num_tokens, head = q.shape
    num_tiles = -(-num_tokens // tile)
    front, back = window - 1, num_tiles * tile - num_tokens
    width = tile + window - 1

    def windows(x: torch.Tensor) -> torch.Tensor:  # [1, Hkv, T, D] -> [NT, Hkv, W', D]
        padded = F.pad(x, (0, 0, front, back))  # [1, Hkv, front + NT * tile, D]
        return padded.unfold(2, width, tile)[0].permute(1, 0, 3, 2)

    qt = F.pad(q, (0, 0, 0, back))[0].view(num_heads, num_tiles, tile, head)
    device = q.device
    row = torch.arange(tile, device=device)[None, :, None]  # [1, tq, 1]
    col = torch.arange(width, device=device)[None, None, :]  # [1, 1, W']
    first = torch.arange(num_tiles, device=device)[:, None, None] * tile  # [NT, 1, 1]
    q_pos, k_pos = first + row, first + col - front  # [NT, tq, 1], [NT, 1, W']
    mask = _in_window(q_pos, k_pos, window) & (k_pos >= 0)
    out = sdpa(
        qt.transpose(0, 1),  # [NT, H, tq, D]
        windows(k),
        windows(v),
        attn_mask=mask[:, None],  # [NT, 1, tq, W']
        is_causal=False,
        scale=scale,
        enable_gqa=num_heads != k.shape[1],
    )  # [NT, H, tq, D]
    return out.transpose(1, 2).reshape(num_tiles * tile, num_heads, head)[:num_tokens]


def decode_attention(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_list: torch.Tensor,
    block_req: torch.Tensor,
    block_bias: torch.Tensor,
    block_key_pos: torch.Tensor,
    block_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Flat paged attention: one query per request over a flat list of blocks.

    query: [B, H, D]; block_list: [NB] block ids of every decode request, request
    after request (0 for padding); block_req: [NB] decode row owning each block
    (padding blocks name any row: their bias masks every key and the mapping
    drops them);
    block_bias: [NB, BS] float32, 0 on visible keys, MASKED_SCORE elsewhere
    (past the request's length, padding blocks);
    block_key_pos: [NB, BS] position of each key in its request;
    block_mapping: [B, NB] one-hot (1 where block n belongs to row b; padding
    blocks belong to none);
    seq_lens: [B] context length including the current token (0 on padding
    rows). Returns [B, H, D] (0 on rows that own no block).
    """
    batch, num_heads, head = query.shape
    num_blocks = block_list.shape[0]
    num_kv_heads = kv_cache.num_kv_heads
    group = num_heads // num_kv_heads
    bs = kv_cache.block_size
    # [NB, BS, Hkv, D] each
    keys = read_keys(
        kv_cache, blocks_of(kv_cache.key, bs).index_select(0, block_list), query.dtype
    )
    values = read_values(
        kv_cache, blocks_of(kv_cache.value, bs).index_select(0, block_list), query.dtype
    )
    q = query.index_select(0, block_req).view(num_blocks, num_kv_heads, group, head)
    # [NB, Hkv, G, D] @ [NB, Hkv, D, BS] -> [NB, Hkv, G, BS]
    scores = (q @ keys.permute(0, 2, 3, 1)).float() * scale
    bias = block_bias
    if sliding_window is not None:
        first = (seq_lens.index_select(0, block_req) - sliding_window)[:, None]
        bias = torch.where(block_key_pos >= first, bias, MASKED_SCORE)
    scores = scores + bias[:, None, None, :]
    block_max = scores.amax(-1)  # [NB, Hkv, G]
    probs = torch.exp(scores - block_max[..., None])
    block_sum = probs.sum(-1)
    # [NB, Hkv, G, BS] @ [NB, Hkv, BS, D] -> [NB, Hkv, G, D]
    block_out = probs.to(values.dtype) @ values.transpose(1, 2)
    # Per-request reduction of the block partials: the max by scatter, the sums
    # by one matmul with the [B, NB] block mapping (no scatter-add).
    index = block_req[:, None, None].expand_as(block_max)
    req_max = block_max.new_full((batch, num_kv_heads, group), MASKED_SCORE)
    req_max = req_max.scatter_reduce(0, index, block_max, "amax")
    weight = torch.exp(block_max - req_max.index_select(0, block_req))  # [NB, Hkv, G]
    mapping = block_mapping.to(torch.float32)  # [B, NB]
    req_sum = (mapping @ (block_sum * weight).view(num_blocks, -1)).view(
        batch, num_kv_heads, group, 1
    )
    weighted = (block_out.float() * weight[..., None]).view(num_blocks, -1)
    req_out = (mapping @ weighted).view(batch, num_kv_heads, group, head)
    out = req_out / req_sum.clamp_min(1e-30)
    return out.view(batch, num_heads, head).to(query.dtype)


def batched_decode_attention(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sdpa: SdpaFn = F.scaled_dot_product_attention,
) -> torch.Tensor:
    """One query per request through a ``[B, M]`` block table (every request
    padded to M blocks). query: [B, H, D]; block_table: [B, M] (0 past the end);
    seq_lens: [B] (0 on padding rows). Returns [B, H, D].

    GQA: the ``G = H / Hkv`` query heads that share a KV head are that head's
    ``G`` query rows (``[B, Hkv, G, D]``): one decode query has one position,
    so they share its mask. SDPA then reads each gathered KV head once, where
    ``enable_gqa`` runs (and reads the keys for) every query head on its own:
    on the CPU's flash kernel that measured 0.73 -> 0.62 ms a layer at 32
    requests x 320 keys, 12/4 heads (bfloat16, 2 threads)."""
    batch, max_blocks = block_table.shape
    block_size = kv_cache.block_size
    num_keys = max_blocks * block_size
    num_heads, head = query.shape[1], query.shape[2]
    keys, values = _gather_blocks(kv_cache, block_table)  # [B, Hkv, K, D]
    num_kv_heads = keys.shape[1]
    key_pos = torch.arange(num_keys, device=query.device)[None, :]  # [1, K]
    q_pos = (seq_lens - 1)[:, None]  # [B, 1]
    mask = key_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (key_pos > q_pos - sliding_window)
    mask = mask | ((seq_lens <= 0)[:, None] & (key_pos == 0))  # padding rows
    group = num_heads // num_kv_heads
    out = sdpa(
        query.view(batch, num_kv_heads, group, head),  # [B, Hkv, G, D]
        read_keys(kv_cache, keys, query.dtype),
        read_values(kv_cache, values, query.dtype),
        attn_mask=mask.view(batch, 1, 1, num_keys),
        is_causal=False,
        scale=scale,
        enable_gqa=False,
    )
    return out.reshape(batch, num_heads, head)  # [B, H, D]


def dense_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    dense: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    fill_slots: torch.Tensor | None,
    fill_blocks: torch.Tensor | None,
    mask: torch.Tensor,
    scale: float,
    sdpa: SdpaFn = F.scaled_dot_product_attention,
) -> torch.Tensor:
    """Decode attention over the dense per-request K/V copy.

    query: [R, H, D] real decode rows; key, value: [R, Hkv, D] their new K/V
    (of an FP8 cache: as it holds them, quantized and read back);
    kv_cache: the paged cache (already holding this step's
    K/V: ``write_kv`` first); dense: [2, S, Hkv, L, D], slot s holding one
    request's keys and values at their positions;
    slots: [R] int64 slot of each row; positions: [R] int64 position of each
    row's token (its context length - 1);
    fill_slots: [F] int64 or None, slots to (re)build from the paged cache
    before attending (a request that starts decoding); fill_blocks: [F, M]
    int64, the blocks of each (``M * BS <= L``; PAD_BLOCK past a request's end);
    mask: [U, 1, 1, W] bool, True where slot u (of the first U) may attend key
    position w (below its length; inside its sliding window); a slot with no
    request keeps key 0. Every row's slot is below U and its length at most W.
    Returns [R, H, D].
    """
    rows, num_heads, head = query.shape
    used, width = mask.shape[0], mask.shape[-1]
    num_kv_heads = dense.shape[2]
    if fill_slots is not None and fill_blocks is not None:
        keys, values = _gather_blocks(kv_cache, fill_blocks)  # [F, Hkv, M*BS, D]
        n = keys.shape[2]
        dense[0, :, :, :n].index_copy_(
            0, fill_slots, read_keys(kv_cache, keys, dense.dtype)
        )
        dense[1, :, :, :n].index_copy_(
            0, fill_slots, read_values(kv_cache, values, dense.dtype)
        )
        # Past n the slot holds its previous request's K/V: masked, so of zero
        # weight, but 0 * NaN is NaN in P @ V. Cleared, a NaN request's K/V
        # cannot reach the next request of its slot.
        dense[:, :, :, n:].index_fill_(1, fill_slots, 0.0)
    dense[0, slots, :, positions] = key.to(dense.dtype)
    dense[1, slots, :, positions] = value.to(dense.dtype)
    # One query row per head, GQA through enable_gqa (rows placed at their
    # slots). Folding the G heads of a KV head into G rows, as the gathered
    # form above does, is slower here: on the CPU's flash kernel at 32 slots x
    # 320 keys, 12/4 heads (bfloat16, 2 threads), 1.14 against 1.07 ms a layer
    # and step in the engine (1.31-1.46 against 0.95-0.99 ms with the K/V in
    # cache), same error against float64.
    q = query.new_zeros(used, num_heads, 1, head)
    q.index_copy_(0, slots, query.view(rows, num_heads, 1, head))
    out = sdpa(
        q,
        dense[0, :used, :, :width].to(query.dtype),
        dense[1, :used, :, :width].to(query.dtype),
        attn_mask=mask,
        is_causal=False,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [U, H, 1, D]
    return out.index_select(0, slots).view(rows, num_heads, head)


def request_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    requests: Sequence[tuple[int, int, int]],
    block_table: torch.Tensor,
    masks: Sequence[torch.Tensor | None],
    scale: float,
    sdpa: SdpaFn = F.scaled_dot_product_attention,
) -> torch.Tensor:
    """Causal prefill attention, one SDPA per request (host-side lengths).

    query: [T, H, D]; key, value: [T, Hkv, D] this step's prefill rows (of an
    FP8 cache: as it holds them, quantized and read back, so that a fresh
    prompt attends the same keys as a later chunk reading the cache);
    requests: per prefill request ``(first row, query_len, seq_len)``, rows in
    order (rows past the last request are padding and get zeros);
    block_table: [P, >= max blocks] int64 the requests' blocks (read only for
    requests with prior context, which ``write_kv`` has already completed);
    masks: per request None (a fresh prompt without a sliding window: SDPA's
    own causal mask) or [query_len, seq_len] bool, its bottom-right causal
    mask, sliding window included (built once per step:
    ``PrefillRequests.masks_for``).
    Returns [T, H, D].
    """
    out = torch.zeros_like(query)
    num_heads = query.shape[1]
    block_size = kv_cache.block_size
    for i, (start, q_len, seq_len) in enumerate(requests):
        q = query[start : start + q_len].transpose(0, 1)[None]  # [1, H, q, D]
        if seq_len == q_len:
            k = key[start : start + q_len].transpose(0, 1)[None]
            v = value[start : start + q_len].transpose(0, 1)[None]
        else:
            blocks = block_table[i, : -(-seq_len // block_size)]
            keys, values = _gather_blocks(kv_cache, blocks[None])
            k = read_keys(kv_cache, keys[:, :, :seq_len], query.dtype)
            v = read_values(kv_cache, values[:, :, :seq_len], query.dtype)
            # [1, Hkv, seq_len, D] each
        mask = masks[i]
        o = sdpa(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=num_heads != k.shape[1],
        )
        out[start : start + q_len] = o[0].transpose(0, 1)
    return out
