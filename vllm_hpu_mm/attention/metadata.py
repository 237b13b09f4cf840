"""Attention metadata of one engine step: one class per execution plan.

Which class a step carries is the plan's (``ExecutionPlan.attention_metadata``,
``vllm_hpu_mm.plan``), decided once at start-up:

- ``StaticAttentionMetadata`` (the static plan, and every plan on Gaudi): the
  inputs of a compiled graph and nothing else. Every tensor has the shape of
  the step's bucket (``StepShape``) and its ints are part of the bucket key, so
  the graph Dynamo traces through attention sees no host value that changes
  from step to step. A part the bucket does not have (no decode rows, say) is
  None, not an empty tensor.
- ``DynamicAttentionMetadata`` (the dynamic plan off Gaudi, where attention
  never runs under a graph): host-side lengths that change every step. The
  real decode rows over a batched block table of their real width (or their
  slots of the dense decode cache), the prefill requests one by one (tiles
  only for bidirectional image spans).

Both share the row layout (token rows ``[0, num_decodes)`` are decode rows,
then ``num_prefill_tokens`` prefill rows), the slot mapping, the multimodal
placeholder maps and the cross-attention inputs. The host arrays come from
the pure functions of ``attention.layout``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionMetadata

from vllm_hpu_mm.attention.layout import (
    PAD_BLOCK,
    PAD_SLOT,
    PREFILL_TILE,
    DecodeForm,
    StepShape,
    batched_decode_table,
    causal_blocks,
    check_fits,
    count_leading_decodes,
    exact_shape,
    flat_decode,
    prefill_spans,
    prefill_tiles,
    spans_from_doc_ranges,
    tile_rows,
    token_row_of_real_tokens,
)

if TYPE_CHECKING:
    from vllm_hpu_mm.attention.decode_cache import DenseDecodeStep
    from vllm_hpu_mm.worker.buffers import DeviceBuffers
    from vllm_hpu_mm.worker.merge import MergeMap

__all__ = [
    "DECODE_FORM",
    "PAD_BLOCK",
    "PAD_SLOT",
    "PREFILL_TILE",
    "DecodeForm",
    "DynamicAttentionMetadata",
    "FlatDecodeInputs",
    "HpuMMAttentionMetadata",
    "MetadataKind",
    "PrefillCausalInputs",
    "PrefillRequests",
    "PrefillTileInputs",
    "StaticAttentionMetadata",
    "StepShape",
    "build_metadata",
    "build_prefill_requests",
    "check_fits",
    "count_leading_decodes",
    "exact_shape",
    "spans_from_doc_ranges",
    "split_metadata",
    "tile_rows",
    "token_row_of_real_tokens",
]

MetadataKind = Literal["static", "dynamic"]
"""Which metadata a plan's steps carry (``ExecutionPlan.attention_metadata``)."""

DECODE_FORM: dict[MetadataKind, DecodeForm] = {"static": "flat", "dynamic": "batched"}
"""The decode form each metadata lays out (what its bucket's ``decode_blocks``
counts: ``layout.exact_shape``)."""


@dataclass(kw_only=True)
class HpuMMAttentionMetadata(AttentionMetadata):
    """What both plans' metadata share: the step's row layout, its KV writes,
    its multimodal maps and cross-attention inputs."""

    num_decodes: int
    """Decode rows (padded): token rows [0, num_decodes) are one request each."""
    num_prefill_tokens: int
    """Prefill token rows (padded): rows [num_decodes, num_decodes + this)."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64, cache slot written by each token row; padding rows
    write PAD_SLOT in the null block."""
    mm_maps: dict[str, MergeMap] = field(default_factory=dict)
    """Per modality: the placeholder map of this step's chunk
    (``worker.merge.MergeMap``: encoder-store rows to token rows, one entry
    per token row, padding entries on the scratch rows), which the compiled
    merge reads; written by ``MultimodalInputs.attach_maps``."""
    cross: object | None = None
    """Cross-attention inputs of the step (``attention.cross``), for models whose
    images are read by cross-attention layers; None otherwise."""


@dataclass
class FlatDecodeInputs:
    """The decode rows as one flat list of their blocks (Gaudi's flat paged
    attention); B = the bucket's ``num_decodes``, NB = its ``decode_blocks``."""

    seq_lens: torch.Tensor
    """[B] int64 context length including the current token; 0 on padding rows."""
    block_list: torch.Tensor
    """[NB] int64 block ids of every decode row, row after row; PAD_BLOCK on
    padding."""
    block_req: torch.Tensor
    """[NB] int64 decode row owning each block (padding blocks: the last row)."""
    block_bias: torch.Tensor
    """[NB, block_size] float32 additive score, 0 on keys inside the row's
    length, MASKED_SCORE elsewhere."""
    block_key_pos: torch.Tensor
    """[NB, block_size] int64 position of each key in its request (for
    sliding windows)."""
    block_mapping: torch.Tensor
    """[B, NB] float32 one-hot row of each block (padding blocks: all 0)."""


@dataclass
class PrefillTileInputs:
    """The prefill rows in ``NT`` tiles of ``tq`` rows (``layout.tile_rows``);
    CB = the bucket's ``prefill_blocks``."""

    blocks: torch.Tensor
    """[NT, CB] int64 blocks each tile reads: for each request with rows in
    the tile, its blocks up to the tile's last row of it; PAD_BLOCK on padding."""
    mask: torch.Tensor
    """[NT, tq, CB * block_size] bool: row may attend key (same request, key
    position <= row position); padding rows keep key 0 only."""
    query_pos: torch.Tensor
    """[NT, tq] int64 position of each prefill row; PAD_QUERY_POS on padding."""
    key_pos: torch.Tensor
    """[NT, CB * block_size] int64 position of each key in its request; 0 on
    padding."""
    span_lo: torch.Tensor | None = None
    """[NT, tq] int64, models with bidirectional image spans only (None
    otherwise): first key column of the tile inside the row's span; 0 on rows
    outside any span and on padding."""
    span_hi: torch.Tensor | None = None
    """[NT, tq] int64: one past the last key column of the row's span, clipped
    to the keys computed so far (``lo == hi``: no span)."""


@dataclass
class PrefillCausalInputs:
    """The rows of one fresh request (the bucket's ``prefill_form`` is
    ``causal``): row i is position i, so attention is SDPA's causal mask over
    its own blocks, gathered once."""

    blocks: torch.Tensor
    """[1, ceil(T / block_size)] int64 the request's blocks in order,
    PAD_BLOCK past its last (T: the bucket's prefill rows)."""


@dataclass(kw_only=True)
class StaticAttentionMetadata(HpuMMAttentionMetadata):
    """The graph inputs of one step of the static plan: tensors of the
    bucket's shapes, the bucket's row counts; nothing read on the host."""

    decode: FlatDecodeInputs | None
    """The decode rows' inputs; None when the bucket has no decode rows."""
    prefill: PrefillTileInputs | PrefillCausalInputs | None
    """The prefill rows by the bucket's ``prefill_form``: tiles (``tiles``;
    ``request``: one tile of all the rows) or one fresh request's blocks
    (``causal``); None when the bucket has no prefill rows."""


@dataclass(kw_only=True)
class DynamicAttentionMetadata(HpuMMAttentionMetadata):
    """One step of the dynamic plan off Gaudi: attention runs on the host,
    outside any graph, over the step's real rows and blocks."""

    real_decodes: int
    """R: real decode rows (token rows [R, num_decodes) are padding, their
    attention output zero)."""
    decode_seq_lens: torch.Tensor
    """[R] int64 context length of each real decode row, current token included."""
    decode_block_table: torch.Tensor
    """[R, W] int64 block ids of the real decode rows, W their widest row's
    blocks; PAD_BLOCK past each row's last block."""
    prefill: PrefillRequests | PrefillTileInputs | None
    """The prefill rows: request by request (``PrefillRequests``); tiles over
    the padded rows for models with bidirectional image spans; None without
    prefill rows."""
    dense: DenseDecodeStep | None = None
    """The decode rows' slots in the dense decode cache
    (``attention.decode_cache``), set by the runner on the CPU where the cache
    is built; None: decode reads the paged cache."""


@dataclass(frozen=True, slots=True)
class PrefillRequests:
    """Per prefill request, for ``request_prefill_attention``."""

    rows: tuple[tuple[int, int, int], ...]  # (first prefill row, query_len, seq_len)
    block_table: torch.Tensor  # [P, >= max blocks] int64
    _masks: dict[int | None, tuple[torch.Tensor | None, ...]] = field(
        default_factory=dict
    )

    def masks_for(self, sliding_window: int | None) -> tuple[torch.Tensor | None, ...]:
        """Each request's ``[query_len, seq_len]`` bool mask for layers with
        this window: bottom-right causal, ANDed with the window; None for a
        fresh prompt without a window (SDPA's own causal mask). Built once per
        step and window, not per layer."""
        if sliding_window not in self._masks:
            device = self.block_table.device
            out: list[torch.Tensor | None] = []
            for _, q, s in self.rows:
                if q == s and sliding_window is None:
                    out.append(None)
                    continue
                q_pos = torch.arange(s - q, s, device=device)[:, None]
                k_pos = torch.arange(s, device=device)[None, :]
                mask = k_pos <= q_pos
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
                out.append(mask)
            self._masks[sliding_window] = tuple(out)
        return self._masks[sliding_window]


def build_prefill_requests(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    device: torch.device,
) -> PrefillRequests:
    """The prefill requests (``query_lens``, ``seq_lens``, ``block_table``
    rows of the prefill requests alone); their masks are built on first use."""
    starts = np.cumsum(query_lens) - query_lens
    rows = tuple(
        (int(a), int(q), int(s))
        for a, q, s in zip(starts, query_lens, seq_lens, strict=True)
    )
    table = torch.from_numpy(np.ascontiguousarray(block_table)).to(device)
    return PrefillRequests(rows, table)


def _tiles(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    shape: StepShape,
    tile: int,
    spans: np.ndarray | None,
    num_dec: int,
    t: _ToDevice,
) -> PrefillTileInputs:
    """The prefill tiles of the requests after the first ``num_dec``."""
    tiles = prefill_tiles(
        query_lens[num_dec:],
        seq_lens[num_dec:],
        block_table[num_dec:],
        block_size,
        shape.num_prefill_tokens,
        shape.prefill_blocks,
        tile,
        prefill_spans(query_lens, num_dec, spans),
    )
    return PrefillTileInputs(
        blocks=t(tiles.blocks, "prefill_tile_blocks"),
        mask=t(tiles.mask, "prefill_tile_mask"),
        query_pos=t(tiles.query_pos, "prefill_tile_query_pos"),
        key_pos=t(tiles.key_pos, "prefill_tile_key_pos"),
        span_lo=None if tiles.span_lo is None else t(tiles.span_lo, "span_lo"),
        span_hi=None if tiles.span_hi is None else t(tiles.span_hi, "span_hi"),
    )


class _ToDevice:
    """Host arrays to device tensors: views of the reused ``buffers`` (named
    per input), or fresh copies."""

    def __init__(self, device: torch.device, buffers: DeviceBuffers | None) -> None:
        self.device, self.buffers = device, buffers

    def __call__(self, a: np.ndarray, name: str) -> torch.Tensor:
        if self.buffers is not None:
            return self.buffers.put(name, a)
        return torch.from_numpy(a).to(self.device, non_blocking=True)


def build_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    shape: StepShape,
    device: torch.device,
    buffers: DeviceBuffers | None = None,
    kind: MetadataKind = "static",
    tile: int = PREFILL_TILE,
    spans: np.ndarray | None = None,
) -> StaticAttentionMetadata | DynamicAttentionMetadata:
    """Build the step's metadata of ``kind`` (the plan's
    ``attention_metadata``), padded to ``shape``.

    query_lens: [R] tokens scheduled per request, decode requests (1 token)
    first; seq_lens: [R] context length after this step's tokens;
    block_table: [R, >= max blocks] block ids per request;
    slot_mapping: [sum(query_lens)] slots of the real tokens, in token-row order.
    buffers: when given, the tensors are views of these reused device buffers.
    spans: [sum(query_lens), 2] bidirectional image spans of the real tokens
    (models with bidirectional image attention), or None.
    ``shape``'s ``decode_blocks`` counts flat-list blocks for ``static`` and
    table columns for ``dynamic`` (``layout.exact_shape``'s decode form).
    """
    real = exact_shape(query_lens, seq_lens, block_size, DECODE_FORM[kind], tile, spans)
    check_fits(real, shape)
    num_dec = real.num_decodes
    # Slots: decode rows, pad, prefill rows, pad.
    slots = np.full(shape.num_tokens, PAD_SLOT, np.int64)
    slots[:num_dec] = slot_mapping[:num_dec]
    slots[shape.num_decodes : shape.num_decodes + real.num_prefill_tokens] = (
        slot_mapping[num_dec:]
    )
    t = _ToDevice(device, buffers)
    if kind == "static":
        return build_static_metadata(
            query_lens, seq_lens, block_table, block_size, shape, tile, spans,
            t(slots, "slot_mapping"), t,
        )  # fmt: skip
    return build_dynamic_metadata(
        query_lens, seq_lens, block_table, block_size, shape, real, tile, spans,
        t(slots, "slot_mapping"), t, device,
    )  # fmt: skip


def build_static_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    shape: StepShape,
    tile: int,
    spans: np.ndarray | None,
    slot_mapping: torch.Tensor,
    t: _ToDevice,
) -> StaticAttentionMetadata:
    """The static plan's step (see ``build_metadata``): flat decode over the
    bucket's ``decode_blocks``, prefill tiles over its rows and blocks."""
    num_dec = count_leading_decodes(query_lens)
    decode = None
    if shape.num_decodes:
        seq = np.zeros(shape.num_decodes, np.int64)
        seq[:num_dec] = seq_lens[:num_dec]
        flat = flat_decode(
            seq_lens[:num_dec],
            block_table,
            block_size,
            shape.num_decodes,
            shape.decode_blocks,
        )
        decode = FlatDecodeInputs(
            seq_lens=t(seq, "decode_seq_lens"),
            block_list=t(flat.block_list, "decode_block_list"),
            block_req=t(flat.block_req, "decode_block_req"),
            block_bias=t(flat.block_bias, "decode_block_bias"),
            block_key_pos=t(flat.block_key_pos, "decode_block_key_pos"),
            block_mapping=t(flat.block_mapping, "decode_block_mapping"),
        )
    prefill: PrefillTileInputs | PrefillCausalInputs | None = None
    if shape.num_prefill_tokens and shape.prefill_form == "causal":
        blocks = causal_blocks(
            seq_lens[num_dec:], block_table[num_dec:], block_size,
            shape.num_prefill_tokens,
        )  # fmt: skip
        prefill = PrefillCausalInputs(blocks=t(blocks, "prefill_causal_blocks"))
    elif shape.num_prefill_tokens:
        if shape.prefill_form == "request":
            tile = shape.num_prefill_tokens  # one tile of all the rows
        prefill = _tiles(
            query_lens, seq_lens, block_table, block_size, shape, tile, spans,
            num_dec, t,
        )  # fmt: skip
    return StaticAttentionMetadata(
        num_decodes=shape.num_decodes,
        num_prefill_tokens=shape.num_prefill_tokens,
        slot_mapping=slot_mapping,
        decode=decode,
        prefill=prefill,
    )


def build_dynamic_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    shape: StepShape,
    real: StepShape,
    tile: int,
    spans: np.ndarray | None,
    slot_mapping: torch.Tensor,
    t: _ToDevice,
    device: torch.device,
) -> DynamicAttentionMetadata:
    """The dynamic plan's step (see ``build_metadata``): the real decode rows
    over a batched table of their real width (``real``: the step's exact
    shape), the prefill requests one by one (tiles with ``spans``)."""
    num_dec = real.num_decodes
    table = batched_decode_table(
        seq_lens[:num_dec], block_table, block_size, num_dec, real.decode_blocks
    )
    prefill: PrefillRequests | PrefillTileInputs | None = None
    if real.num_prefill_tokens and spans is None:
        prefill = build_prefill_requests(
            query_lens[num_dec:], seq_lens[num_dec:], block_table[num_dec:], device
        )
    elif shape.num_prefill_tokens:
        prefill = _tiles(
            query_lens, seq_lens, block_table, block_size, shape, tile, spans,
            num_dec, t,
        )  # fmt: skip
    return DynamicAttentionMetadata(
        num_decodes=shape.num_decodes,
        num_prefill_tokens=shape.num_prefill_tokens,
        slot_mapping=slot_mapping,
        real_decodes=num_dec,
        decode_seq_lens=t(np.ascontiguousarray(seq_lens[:num_dec]), "decode_seq_lens"),
        decode_block_table=t(table, "decode_block_table"),
        prefill=prefill,
    )


def split_metadata(
    md: StaticAttentionMetadata,
) -> tuple[StaticAttentionMetadata, StaticAttentionMetadata]:
    """A mixed step's metadata as (decode part, prefill part), each describing
    its own token rows (decode rows, then the prefill rows from row 0); the
    static plan's only (the dynamic plan runs a mixed step in one pass)."""
    n_dec = md.num_decodes
    decode = dataclasses.replace(
        md, num_prefill_tokens=0, slot_mapping=md.slot_mapping[:n_dec], prefill=None
    )
    prefill = dataclasses.replace(
        md, num_decodes=0, slot_mapping=md.slot_mapping[n_dec:], decode=None
    )
    return decode, prefill
