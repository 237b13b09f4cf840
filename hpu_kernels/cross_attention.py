"""Cross-attention of text tokens over cached image rows, in pure PyTorch.

Cross-attention cache of one layer: a ``CrossCache``, a key and a value tensor
of ``[num_slots, rows, num_kv_heads, head]`` each. A slot holds one image:
``rows = tiles * padded`` vision rows, tile-major. Slot 0 is a null slot that
padding entries point at. Written by ``write_cross_kv``.

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


class CrossCache(NamedTuple):
    """One cross-attention layer's image cache.

    key, value: [num_slots, rows, Hkv, D] each, slot ``s`` at index ``s``. Two
    separate tensors, as the self-attention ``KVCache``
    (docs/kv-cache-layout.md): inside a graph compiled by Habana's
    ``hpu_backend`` each is a graph input of its own that ``write_cross_kv``
    writes with a plain ``index_copy_``, which its compile passes reinplace.
    Written through K and V views of one ``[2, ...]`` tensor, AOTAutograd
    rebuilds the whole base and copies it back on every write.
    """

    key: torch.Tensor
    value: torch.Tensor

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[2])

    @property
    def rows(self) -> int:
        return int(self.key.shape[1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


def new_cross_cache(
    num_slots: int,
    rows: int,
    num_kv_heads: int,
    head: int,
    dtype: torch.dtype,
    device: torch.device,
) -> CrossCache:
    """A zeroed cache, K and V allocated separately (not views of one tensor)."""
    shape = (num_slots, rows, num_kv_heads, head)
    return CrossCache(
        torch.zeros(shape, dtype=dtype, device=device),
        torch.zeros(shape, dtype=dtype, device=device),
    )


def cross_cache_of_stacked(stacked: torch.Tensor) -> CrossCache:
    """A ``CrossCache`` over the halves of one ``[2, S, rows, Hkv, D]`` tensor
    (views). For eager callers and tests only: in an ``hpu_backend`` graph a
    write through these views costs a whole copy of ``stacked``."""
    return CrossCache(stacked[0], stacked[1])


def write_cross_kv(
    cache: CrossCache,
    slots: torch.Tensor,  # [N] int64
    key: torch.Tensor,  # [N, rows, Hkv, D]
    value: torch.Tensor,  # [N, rows, Hkv, D]
) -> None:
    """Store N images' K/V in ``slots``: a plain ``index_copy_`` into each
    tensor (reinplaced by Habana's passes when traced, ``CrossCache``)."""
    cache.key.index_copy_(0, slots, key.to(cache.key.dtype))
    cache.value.index_copy_(0, slots, value.to(cache.value.dtype))


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
    cache: CrossCache,  # K, V [S, rows, Hkv, D]
    slots: torch.Tensor,  # [B, M] int64
    tile_mask: torch.Tensor,  # [B, M, tiles] bool
    scale: float,
    patches: int | None = None,  # real rows of a tile; None: all
) -> torch.Tensor:
    b, h, d = query.shape
    hkv, rows = cache.num_kv_heads, cache.rows
    m = slots.shape[1]
    padded = rows // tile_mask.shape[-1]
    key = cache.key.index_select(0, slots.flatten()).view(b, m * rows, hkv, d)
    value = cache.value.index_select(0, slots.flatten()).view(b, m * rows, hkv, d)
    q = query.view(b, hkv, h // hkv, d)
    out = _attend(q, key, value, _rows(tile_mask, padded, patches), scale)
    return out.reshape(b, h, d)


def cross_attention_prefill(
    query: torch.Tensor,  # [T, H, D]
    cache: CrossCache,  # K, V [S, rows, Hkv, D]
    slots: torch.Tensor,  # [N] int64
    tile_mask: torch.Tensor,  # [T, N, tiles] bool
    scale: float,
    patches: int | None = None,  # real rows of a tile; None: all
) -> torch.Tensor:
    t, h, d = query.shape
    hkv, rows = cache.num_kv_heads, cache.rows
    n = slots.shape[0]
    padded = rows // tile_mask.shape[-1]
    key = cache.key.index_select(0, slots).view(1, n * rows, hkv, d)
    value = cache.value.index_select(0, slots).view(1, n * rows, hkv, d)
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
    cache: CrossCache,  # K, V [S, rows, Hkv, D]
    requests: Sequence[CrossRequest],
    scale: float,
) -> torch.Tensor:
    """Prefill cross-attention one request at a time: each request's rows read
    only its own images' real rows (``key_rows`` into ``cache`` flattened to
    ``[S * rows, Hkv, D]``), through SDPA, which accumulates the scores in
    float32. Rows of no request (padding) get zeros. Returns [T, H, D]."""
    t, h, d = query.shape
    hkv = cache.num_kv_heads
    keys = cache.key.view(-1, hkv, d)  # [S * rows, Hkv, D], a view
    values = cache.value.view(-1, hkv, d)
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
