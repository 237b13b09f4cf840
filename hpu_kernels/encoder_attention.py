"""Vision-encoder attention over segments, as one static-shape call.

A dynamic-resolution vision tower (Qwen2.5-VL, Qwen3-VL) runs all images of a
step as one sequence of patches: each image (each frame of a video) is an
attention segment, and Qwen2.5-VL's window layers cut each image further into
windows. The segments come as cumulative offsets ``cu_seqlens`` ([S + 1],
offsets into the patch sequence; empty segments repeat an offset). vLLM's
CPU form reads the offsets back to the host and runs one SDPA per segment: on
Gaudi that is a host read per layer and a graph specialised on every segment
length.

Here the segments become a block-diagonal mask over the whole padded sequence
of ``N`` patches, computed from the offsets as a tensor (no host read), and
attention is one masked SDPA of ``[1, H, N, D]`` per layer: every shape
depends on ``N`` alone (the patch bucket), never on the segment lengths.
Patches at or past the last offset (``cu_seqlens[-1] < N``) form one more
segment of their own, so padding rows see only each other and stay finite.
The mask is built once per encoder step and shared by the layers that use the
same offsets (``segment_bias``); on Gaudi the SDPA is FusedSDPA, handed in by
``vllm_hpu_mm.device``.

Cost: the masked form computes the whole ``N x N`` square where per-segment
attention computes ``sum(len_i ** 2)``; only a variable-length kernel reaches
that minimum. Where every segment is known to hold at most ``W`` patches
(Qwen2.5-VL's window layers: a window is at most ``(window_size /
patch_size) ** 2`` patches), the banded form cuts the square into query tiles
of ``T`` rows, each against the ``T + 2 (W - 1)`` keys around it (a segment
of at most ``W`` rows that touches the tile lies inside them): ``N x (T + 2W
- 2)`` instead of ``N x N``, still one batched SDPA with static shapes
(``band_bias``, ``banded_attention``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

SdpaFn = Callable[..., torch.Tensor]
"""``sdpa(q [B, H, N, D], k, v, attn_mask, is_causal, scale, enable_gqa)``:
``hpu_kernels.fused.sdpa_native`` or ``fused_sdpa`` (FusedSDPA on Gaudi)."""


def segment_ids(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64: the segment of each of ``n`` positions under the offsets
    ``cu_seqlens`` ([S + 1], non-decreasing, ``cu_seqlens[0] == 0``): the
    number of segment ends at or before the position. Positions at or past the
    last offset get ``S``, a segment of their own. Comparisons only (no
    ``searchsorted``), so any graph compiler takes it."""
    positions = torch.arange(n, device=cu_seqlens.device, dtype=torch.int64)
    ends = cu_seqlens[1:].to(torch.int64)
    return (positions[:, None] >= ends[None, :]).sum(dim=-1)


def segment_mask(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """[n, n] bool, True where a query row and a key column share a segment."""
    ids = segment_ids(cu_seqlens, n)
    return ids[:, None] == ids[None, :]


def segment_bias(cu_seqlens: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, n] additive mask of ``dtype``: 0 within a segment, the dtype's lowest
    finite value across segments (FusedSDPA's mask form; torch's SDPA takes
    it too). Built once per step and passed to every layer of its kind."""
    keep = segment_mask(cu_seqlens, n)
    bias = torch.zeros((n, n), dtype=dtype, device=cu_seqlens.device)
    return bias.masked_fill(~keep, torch.finfo(dtype).min)


def band_keys(n: int, tile: int, halo: int, device: torch.device) -> torch.Tensor:
    """[NT, tile + 2 * halo] indices into the keys padded by ``halo`` rows in
    front and up to ``NT * tile + halo`` behind (``NT = ceil(n / tile)``):
    the keys of query tile ``i`` are padded rows ``[i * tile, i * tile + tile
    + 2 * halo)``, i.e. real keys ``[i * tile - halo, (i + 1) * tile + halo)``."""
    tiles = -(-n // tile)
    starts = torch.arange(tiles, device=device, dtype=torch.int64) * tile
    return starts[:, None] + torch.arange(
        tile + 2 * halo, device=device, dtype=torch.int64
    )


def band_bias(
    cu_seqlens: torch.Tensor, n: int, tile: int, window: int, dtype: torch.dtype
) -> torch.Tensor:
    """[NT, tile, tile + 2 (window - 1)] additive mask of the banded form: row
    ``r`` of tile ``i`` (position ``i * tile + r``) against the keys around the
    tile (``band_keys``), 0 where they share a segment. Valid when every
    segment of ``cu_seqlens`` holds at most ``window`` positions; positions
    past ``n`` (the last tile's padding) and before 0 form segments that no
    real row shares (padding rows see their own column, so stay finite)."""
    halo = window - 1
    tiles = -(-n // tile)
    ids = segment_ids(cu_seqlens, n)
    rows = tiles * tile
    # padding positions: a segment id no real position has
    pad_id = torch.full((rows + 2 * halo,), -1, dtype=ids.dtype, device=ids.device)
    key_ids = pad_id.slice_scatter(ids, dim=0, start=halo, end=halo + n)
    query_ids = key_ids[halo : halo + rows].view(tiles, tile)
    keys = key_ids[band_keys(n, tile, halo, ids.device)]
    keep = query_ids[:, :, None] == keys[:, None, :]
    bias = torch.zeros(keep.shape, dtype=dtype, device=ids.device)
    return bias.masked_fill(~keep, torch.finfo(dtype).min)


def banded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    sdpa: SdpaFn,
) -> torch.Tensor:
    """``encoder_attention`` in the banded form: ``bias`` from ``band_bias``
    ([NT, T, T + 2 * halo]); query tiles of T rows attend their band of keys,
    one batched SDPA of ``[B * NT, H, T, D]``. [B, N, H, D] in and out."""
    b, n, hq, d = query.shape
    tiles, tile, width = bias.shape
    halo = (width - tile) // 2
    rows = tiles * tile
    q = torch.nn.functional.pad(query, (0, 0, 0, 0, 0, rows - n))
    q = q.view(b * tiles, tile, hq, d).transpose(1, 2)
    index = band_keys(n, tile, halo, query.device).flatten()

    def band(t: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(t, (0, 0, 0, 0, halo, rows - n + halo))
        out = padded.index_select(1, index).view(b * tiles, width, *t.shape[2:])
        return out.transpose(1, 2)

    k, v = band(key), band(value)
    mask = bias.to(q.dtype)[:, None].repeat(b, 1, 1, 1)  # [B * NT, 1, T, W']
    out = sdpa(q, k, v, mask, False, scale, q.shape[1] != k.shape[1])
    out = out.transpose(1, 2).reshape(b, rows, hq, d)
    return out[:, :n]


def encoder_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    sdpa: SdpaFn,
) -> torch.Tensor:
    """Attention of ``query`` [B, N, Hq, D] against ``key``/``value``
    [B, N, Hkv, D] under the additive ``bias`` ([N, N], or None: every row
    sees every key), one ``sdpa`` call; returns [B, N, Hq, D]."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if bias is not None:  # [1, 1, N, N]: FusedSDPA's 4-D mask, broadcast
        bias = bias.to(q.dtype).view(1, 1, *bias.shape[-2:])
    out = sdpa(q, k, v, bias, False, scale, q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The per-segment definition in float64, for tests: each segment of
    ``cu_seqlens`` (read on the host) attends only to itself; positions past
    the last offset form one segment. [B, N, H, D] in, [B, N, H, D] float64
    out."""
    q, k, v = (t.double().transpose(1, 2) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    n = q.shape[2]
    bounds = [0, n] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    if bounds[-1] < n:
        bounds.append(n)
    out = torch.zeros_like(q)
    for lo, hi in itertools.pairwise(bounds):
        if hi <= lo:
            continue
        scores = (q[:, :, lo:hi] @ k[:, :, lo:hi].transpose(-2, -1)) * scale
        out[:, :, lo:hi] = scores.softmax(dim=-1) @ v[:, :, lo:hi]
    return out.transpose(1, 2)
