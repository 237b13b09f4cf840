"""Cross-attention of text tokens over cached image rows, in pure PyTorch.

Cross-attention cache of one layer: ``cache[2, num_slots, rows, num_kv_heads,
head]`` (0 keys, 1 values). A slot holds one image: ``rows = tiles * patches``
vision rows, tile-major. Slot 0 is a null slot that padding entries point at.

Which rows a token reads is given at tile granularity (``[..., images, tiles]``
booleans) and widened to rows here (``patches`` rows per tile). Masked scores get
the dtype's lowest finite value, not -inf, so a row that reads nothing (padding,
text-only requests; the caller discards those outputs) stays finite.

Two layouts, like self-attention:

- decode (batched): one query per request, ``B`` rows, each reading its own
  request's ``M`` image slots (``slots[B, M]``, ``tile_mask[B, M, tiles]``);
- prefill (flat): ``T`` tokens of all prefill requests read the concatenation of
  the step's ``N`` prefill image slots; ``tile_mask[T, N, tiles]`` keeps each
  token to its own request's images. Static shapes, for Gaudi's graphs;
- prefill (per request, CPU and CUDA): one SDPA per request over the rows of
  its own images only (``cross_attention_requests``): the flat form's
  ``[T, N * rows]`` scores grow with the square of the step's requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F


def _attend(
    query: torch.Tensor,  # [Q, Hkv, G, D]
    key: torch.Tensor,  # [Q or 1, K, Hkv, D]
    value: torch.Tensor,  # [Q or 1, K, Hkv, D]
    mask: torch.Tensor,  # [Q, K] bool, True = read
    scale: float,
) -> torch.Tensor:
    scores = (
        torch.einsum("qhgd,bkhd->qhgk", query, key)
        if key.shape[0] == 1
        else (torch.einsum("qhgd,qkhd->qhgk", query, key))
    )
    scores = scores.float() * scale
    scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    if value.shape[0] == 1:
        return torch.einsum("qhgk,bkhd->qhgd", probs, value)
    return torch.einsum("qhgk,qkhd->qhgd", probs, value)


def _rows(tile_mask: torch.Tensor, padded: int, patches: int | None) -> torch.Tensor:
    """[..., images, tiles] -> [..., images * tiles * padded]; padding rows False."""
    wide = tile_mask.unsqueeze(-1).expand(*tile_mask.shape, padded)
    if patches is not None and patches < padded:
        real = torch.arange(padded, device=tile_mask.device) < patches  # [padded]
        wide = wide & real
    return wide.reshape(*tile_mask.shape[:-2], -1)


def cross_attention_decode(
    query: torch.Tensor,  # [B, H, D]
    cache: torch.Tensor,  # [2, S, rows, Hkv, D]
    slots: torch.Tensor,  # [B, M] int64
    tile_mask: torch.Tensor,  # [B, M, tiles] bool
    scale: float,
    patches: int | None = None,  # real rows of a tile; None: all
) -> torch.Tensor:
    b, h, d = query.shape
    hkv = cache.shape[3]
    m = slots.shape[1]
    padded = cache.shape[2] // tile_mask.shape[-1]
    key = cache[0].index_select(0, slots.flatten()).view(b, m * cache.shape[2], hkv, d)
    value = (
        cache[1].index_select(0, slots.flatten()).view(b, m * cache.shape[2], hkv, d)
    )
    q = query.view(b, hkv, h // hkv, d)
    out = _attend(q, key, value, _rows(tile_mask, padded, patches), scale)
    return out.reshape(b, h, d)


def cross_attention_prefill(
    query: torch.Tensor,  # [T, H, D]
    cache: torch.Tensor,  # [2, S, rows, Hkv, D]
    slots: torch.Tensor,  # [N] int64
    tile_mask: torch.Tensor,  # [T, N, tiles] bool
    scale: float,
    patches: int | None = None,  # real rows of a tile; None: all
) -> torch.Tensor:
    t, h, d = query.shape
    hkv = cache.shape[3]
    n = slots.shape[0]
    padded = cache.shape[2] // tile_mask.shape[-1]
    key = cache[0].index_select(0, slots).view(1, n * cache.shape[2], hkv, d)
    value = cache[1].index_select(0, slots).view(1, n * cache.shape[2], hkv, d)
    q = query.view(t, hkv, h // hkv, d)
    out = _attend(q, key, value, _rows(tile_mask, padded, patches), scale)
    return out.reshape(t, h, d)


class CrossRequest(NamedTuple):
    """One prefill request's cross-attention, built on the host per step."""

    start: int  # its first prefill row
    length: int  # its rows
    key_rows: torch.Tensor  # [K] int64 rows of the flattened cache it reads
    mask: torch.Tensor | None  # [length, K] bool, True = read; None: all


def cross_attention_requests(
    query: torch.Tensor,  # [T, H, D]
    cache: torch.Tensor,  # [2, S, rows, Hkv, D]
    requests: Sequence[CrossRequest],
    scale: float,
) -> torch.Tensor:
    """Prefill cross-attention one request at a time: each request's rows read
    only its own images' real rows (``key_rows`` into ``cache`` flattened to
    ``[S * rows, Hkv, D]``), through SDPA, which accumulates the scores in
    float32. Rows of no request (padding) get zeros. Returns [T, H, D]."""
    t, h, d = query.shape
    hkv = cache.shape[3]
    keys = cache[0].reshape(-1, hkv, d)
    values = cache[1].reshape(-1, hkv, d)
    out = query.new_zeros(t, h, d)
    for r in requests:
        q = query[r.start : r.start + r.length].transpose(0, 1)[None]  # [1, H, q, D]
        k = keys.index_select(0, r.key_rows).transpose(0, 1)[None]  # [1, Hkv, K, D]
        v = values.index_select(0, r.key_rows).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q,
            k.to(query.dtype),
            v.to(query.dtype),
            attn_mask=None if r.mask is None else r.mask[None, None],
            scale=scale,
            enable_gqa=h != hkv,
        )
        out[r.start : r.start + r.length] = o[0].transpose(0, 1)
    return out
