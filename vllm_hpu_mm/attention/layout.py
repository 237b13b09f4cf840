"""The step's layout on the host: its bucket (``StepShape``) and the pure
functions over ints and numpy arrays that lay out its attention inputs.

Index spaces used below:

- *token rows*: rows of the step's flattened token batch, decode rows first
  (``[0, num_decodes)``), then prefill rows (``[num_decodes, num_tokens)``);
- *positions*: a token's absolute position inside its request;
- *slots*: rows of a layer's KV cache seen as ``[num_blocks * block_size]``;
- *tiles*: the prefill rows cut into ``NT`` tiles of ``tq`` consecutive rows
  (``tq = min(PREFILL_TILE, num_prefill_tokens)``).

Bidirectional image spans (Gemma 3): ``spans`` arguments below are ``[N, 2]``
int64, per real token (token order), the positions ``[start, end)`` of the span
(an image's run of embedding tokens) whose tokens attend to each other both ways,
on top of causal attention; ``(0, 0)`` outside any span. A prefill tile then
also shows each request's keys up to the end of its rows' spans, and each row
carries its span in the tile's key columns (``span_lo``/``span_hi``).

Every array has a length fixed by the step's bucket (``StepShape``); padding
entries are described field by field and never touch a real KV slot. The
attention metadata (``attention.metadata``) turns these arrays into tensors
once per step (on the host), not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from hpu_kernels.attention import MASKED_SCORE, PAD_QUERY_POS

# The slot padding tokens write to: slot 0 of vLLM's null block, owned by no request.
PAD_SLOT = 0
PAD_BLOCK = 0

PREFILL_TILE = 128
"""Prefill rows per attention tile. Larger tiles gather each request's context
fewer times; smaller ones let a tile read fewer other requests' keys."""

PrefillForm = Literal["tiles", "request", "causal"]
"""How a step's prefill rows run attention (``StepShape.prefill_form``):

- ``tiles``: any prefill part: ``NT`` tiles of ``tq`` rows, each gathering the
  blocks of the requests with rows in it (``prefill_blocks``: the widest
  tile's);
- ``request``: a part of one request: one tile of all its rows, so the
  request's blocks (``prefill_blocks``: all of them) are gathered once;
- ``causal``: a part of one fresh request (no context before this step, none
  of its rows in a bidirectional span): its blocks gathered once and SDPA's causal
  mask (``is_causal``, FusedSDPA's prompt form), so the kernel skips the
  masked half; ``prefill_blocks`` is 0 (the gather covers the bucket's rows).

``request`` and ``causal`` are keyed apart from ``tiles``, so each is a graph
of its own (``bucketing.buckets.one_request_shapes``)."""

DecodeForm = Literal["flat", "batched"]
"""``flat``: the decode rows' real blocks as one list (``decode_blocks`` is the
list's length); ``batched``: a ``[num_decodes, decode_blocks]`` block table."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """Padded sizes of one step (a bucket). Real sizes must not exceed them.

    With attention inside the compiled graph, this is the graph key: a decode
    part ``(num_decodes, decode_blocks)`` and a prefill part
    ``(num_prefill_tokens, prefill_blocks)``; a mixed step runs as two passes
    (``decode_part``, ``prefill_part``), so graphs add up instead of multiplying.
    """

    num_decodes: int  # decode rows (one token each)
    decode_blocks: int  # flat: blocks of all decode rows; batched: table width
    num_prefill_tokens: int  # flattened prefill tokens
    prefill_blocks: int  # context blocks read by one prefill tile (widest tile)
    prefill_form: PrefillForm = "tiles"  # see PrefillForm

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + self.num_prefill_tokens

    @property
    def is_mixed(self) -> bool:
        return self.num_decodes > 0 and self.num_prefill_tokens > 0

    def decode_part(self) -> StepShape:
        return StepShape(self.num_decodes, self.decode_blocks, 0, 0)

    def prefill_part(self) -> StepShape:
        return StepShape(
            0, 0, self.num_prefill_tokens, self.prefill_blocks, self.prefill_form
        )


def tile_rows(num_prefill_tokens: int, tile: int = PREFILL_TILE) -> tuple[int, int]:
    """(tiles, rows per tile) of a prefill part of ``num_prefill_tokens`` rows."""
    if num_prefill_tokens == 0:
        return 0, 0
    tq = min(tile, num_prefill_tokens)
    return -(-num_prefill_tokens // tq), tq


def _ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(n) for each n in lengths."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts


def count_leading_decodes(query_lens: np.ndarray) -> int:
    """Requests at the front of the batch with exactly one query token."""
    not_decode = np.flatnonzero(query_lens != 1)
    return int(not_decode[0]) if not_decode.size else int(query_lens.size)


# --------------------------------------------------------------------------
# Prefill tiles
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _TileKeys:
    """Keys of one tile: for each request with rows in it, (request, blocks)."""

    reqs: tuple[int, ...]
    blocks: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks)


def _prefill_rows(
    query_lens: np.ndarray, seq_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(request, position) of each real prefill row, request after request."""
    local = np.arange(query_lens.size, dtype=np.int64)
    req = np.repeat(local, query_lens)
    pos = np.repeat(seq_lens - query_lens, query_lens) + _ragged_arange(query_lens)
    return req, pos


def _row_reach(
    row_pos: np.ndarray, row_seq: np.ndarray, spans: np.ndarray | None
) -> np.ndarray:
    """[N] last position each prefill row reads: its own, or the last computed
    position of its bidirectional span (``row_seq``: its request's length
    after this step; a span never reaches keys not computed yet)."""
    if spans is None:
        return row_pos
    end = np.minimum(spans[:, 1], row_seq)
    return np.where(spans[:, 1] > spans[:, 0], np.maximum(row_pos, end - 1), row_pos)


def _tile_keys(
    row_req: np.ndarray, row_pos: np.ndarray, block_size: int, tq: int
) -> list[_TileKeys]:
    """Per tile of ``tq`` rows: its requests and the blocks each must show
    (``row_pos``: the last position each row reads)."""
    out = []
    for start in range(0, row_req.size, tq):
        req, pos = row_req[start : start + tq], row_pos[start : start + tq]
        reqs, last = np.unique(req, return_index=False), []
        for r in reqs:
            last.append(int(pos[req == r].max()) // block_size + 1)
        out.append(_TileKeys(tuple(int(r) for r in reqs), tuple(last)))
    return out


def prefill_context_blocks(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    tile: int = PREFILL_TILE,
    spans: np.ndarray | None = None,
) -> int:
    """Blocks the widest tile reads (the exact ``prefill_blocks``) for prefill
    requests with these query and context lengths (padding only adds tiles
    with no real rows, so the real tiles are those of ``tile`` rows).
    ``spans``: [sum(query_lens), 2] bidirectional spans of the rows, or None."""
    if query_lens.size == 0:
        return 0
    row_req, row_pos = _prefill_rows(query_lens, seq_lens)
    reach = _row_reach(row_pos, seq_lens[row_req], spans)
    return max(t.num_blocks for t in _tile_keys(row_req, reach, block_size, tile))


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """Host arrays of the prefill tiles (``attention.metadata.PrefillTileInputs``
    describes each)."""

    blocks: np.ndarray  # [NT, CB] int64
    mask: np.ndarray  # [NT, tq, CB * BS] bool
    query_pos: np.ndarray  # [NT, tq] int64
    key_pos: np.ndarray  # [NT, CB * BS] int64
    span_lo: np.ndarray | None = None  # [NT, tq] int64 key column, or None
    span_hi: np.ndarray | None = None  # [NT, tq] int64


def prefill_tiles(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    num_tokens: int,
    num_blocks: int,
    tile: int = PREFILL_TILE,
    spans: np.ndarray | None = None,
) -> PrefillTiles:
    """The prefill tiles of requests with these lengths, padded to
    ``num_tokens`` rows and ``num_blocks`` blocks per tile.

    query_lens, seq_lens: [P] of the prefill requests; block_table: [P, >= max
    blocks] their block ids; spans: [sum(query_lens), 2] the rows' bidirectional
    spans (positions), or None (then ``span_lo``/``span_hi`` are None).
    """
    num_tiles, tq = tile_rows(num_tokens, tile)
    keys_per_tile = num_blocks * block_size
    blocks = np.full((num_tiles, num_blocks), PAD_BLOCK, np.int64)
    mask = np.zeros((num_tiles, tq, keys_per_tile), bool)
    key_pos = np.zeros((num_tiles, keys_per_tile), np.int64)
    key_req = np.full((num_tiles, keys_per_tile), -2, np.int64)
    query_pos = np.full(num_tiles * tq, PAD_QUERY_POS, np.int64)
    query_req = np.full(num_tiles * tq, -1, np.int64)
    span_lo = np.zeros(num_tiles * tq, np.int64)
    span_hi = np.zeros(num_tiles * tq, np.int64)
    if query_lens.size:
        row_req, row_pos = _prefill_rows(query_lens, seq_lens)
        query_pos[: row_req.size] = row_pos
        query_req[: row_req.size] = row_req
        offsets = np.arange(block_size, dtype=np.int64)
        reach = _row_reach(row_pos, seq_lens[row_req], spans)
        for t, tk in enumerate(_tile_keys(row_req, reach, block_size, tq)):
            col = 0
            for r, n in zip(tk.reqs, tk.blocks, strict=True):
                blocks[t, col : col + n] = block_table[r, :n]
                keys = slice(col * block_size, (col + n) * block_size)
                key_pos[t, keys] = (
                    np.arange(n)[:, None] * block_size + offsets
                ).ravel()
                key_req[t, keys] = r
                if spans is not None:
                    _span_columns(
                        spans, row_req, seq_lens[r], r, t * tq, tq, keys.start,
                        span_lo, span_hi,
                    )  # fmt: skip
                col += n
    q_pos = query_pos.reshape(num_tiles, tq)
    q_req = query_req.reshape(num_tiles, tq)
    mask[:] = (q_req[:, :, None] == key_req[:, None, :]) & (
        key_pos[:, None, :] <= q_pos[:, :, None]
    )
    if keys_per_tile:
        mask[:, :, 0] |= q_req < 0  # a padding row reads key 0 (never NaN)
    if spans is None:
        return PrefillTiles(blocks, mask, q_pos, key_pos)
    return PrefillTiles(
        blocks,
        mask,
        q_pos,
        key_pos,
        span_lo.reshape(num_tiles, tq),
        span_hi.reshape(num_tiles, tq),
    )


def causal_blocks(
    seq_lens: np.ndarray, block_table: np.ndarray, block_size: int, num_tokens: int
) -> np.ndarray:
    """[1, ceil(num_tokens / BS)] int64: the blocks of a ``causal`` prefill
    part (one fresh request, ``seq_lens`` [1] or [0] on a padding-only step):
    its blocks in order, then PAD_BLOCK."""
    width = -(-num_tokens // block_size)
    out = np.full((1, width), PAD_BLOCK, np.int64)
    if seq_lens.size:
        n = -(-int(seq_lens[0]) // block_size)
        out[0, :n] = block_table[0, :n]
    return out


def _span_columns(
    spans: np.ndarray,
    row_req: np.ndarray,
    seq_len: int,
    req: int,
    first_row: int,
    tq: int,
    first_col: int,
    span_lo: np.ndarray,
    span_hi: np.ndarray,
) -> None:
    """Write, for request ``req``'s rows in the tile of rows ``[first_row,
    first_row + tq)``, their span as key columns of the tile: the request's keys
    start at column ``first_col`` (key position p at column ``first_col + p``).
    The span is clipped to the ``seq_len`` keys computed so far."""
    rows = np.arange(first_row, min(first_row + tq, row_req.size))
    rows = rows[row_req[rows] == req]
    start, end = spans[rows, 0], np.minimum(spans[rows, 1], seq_len)
    has = end > start
    span_lo[rows] = np.where(has, first_col + start, 0)
    span_hi[rows] = np.where(has, first_col + end, 0)


# --------------------------------------------------------------------------
# Decode rows
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlatDecode:
    """Host arrays of flat decode (``attention.metadata.FlatDecodeInputs``
    describes each)."""

    block_list: np.ndarray  # [NB] int64
    block_req: np.ndarray  # [NB] int64
    block_bias: np.ndarray  # [NB, BS] float32
    block_key_pos: np.ndarray  # [NB, BS] int64
    block_mapping: np.ndarray  # [B, NB] float32


def flat_decode(
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    num_rows: int,
    num_blocks: int,
) -> FlatDecode:
    """The decode rows' real blocks as one list padded to ``num_blocks``.

    seq_lens: [R] context lengths (current token included) of the real decode
    rows; block_table: [R, >= max blocks]; num_rows: padded decode rows.
    """
    per_req = -(-seq_lens // block_size)
    n = int(per_req.sum())
    block_list = np.full(num_blocks, PAD_BLOCK, np.int64)
    block_req = np.full(num_blocks, max(num_rows - 1, 0), np.int64)
    key_pos = np.zeros((num_blocks, block_size), np.int64)
    bias = np.full((num_blocks, block_size), MASKED_SCORE, np.float32)
    mapping = np.zeros((num_rows, num_blocks), np.float32)
    req = np.repeat(np.arange(seq_lens.size, dtype=np.int64), per_req)
    idx = _ragged_arange(per_req)
    block_list[:n] = block_table[req, idx]
    block_req[:n] = req
    key_pos[:n] = idx[:, None] * block_size + np.arange(block_size)
    bias[:n] = np.where(key_pos[:n] < seq_lens[req][:, None], 0.0, MASKED_SCORE)
    mapping[req, np.arange(n)] = 1.0
    return FlatDecode(block_list, block_req, bias, key_pos, mapping)


def batched_decode_table(
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    num_rows: int,
    width: int,
) -> np.ndarray:
    """[num_rows, width] block table of the decode rows, PAD_BLOCK past ends."""
    per_req = -(-seq_lens // block_size)
    table = np.full((num_rows, width), PAD_BLOCK, np.int64)
    real = int(per_req.max(initial=0))
    r = seq_lens.size
    table[:r, :real] = block_table[:r, :real]
    cols = np.arange(real)[None, :]
    table[:r, :real][cols >= per_req[:, None]] = PAD_BLOCK
    return table


# --------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------


def exact_shape(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    decode_form: DecodeForm = "flat",
    tile: int = PREFILL_TILE,
    spans: np.ndarray | None = None,
) -> StepShape:
    """The unpadded StepShape of a batch ordered decodes first (``spans``:
    [sum(query_lens), 2] bidirectional spans of the real tokens, or None).
    Its ``prefill_blocks`` are the widest tile's (for one request: all its
    blocks) whatever its ``prefill_form`` (``natural_prefill_form``)."""
    num_decodes = count_leading_decodes(query_lens)
    blocks = -(-seq_lens // block_size)
    dec = blocks[:num_decodes]
    pre_spans = prefill_spans(query_lens, num_decodes, spans)
    return StepShape(
        num_decodes=num_decodes,
        decode_blocks=int(dec.sum() if decode_form == "flat" else dec.max(initial=0)),
        num_prefill_tokens=int(query_lens[num_decodes:].sum()),
        prefill_blocks=prefill_context_blocks(
            query_lens[num_decodes:],
            seq_lens[num_decodes:],
            block_size,
            tile,
            pre_spans,
        ),
        prefill_form=natural_prefill_form(
            query_lens[num_decodes:], seq_lens[num_decodes:], pre_spans, tile
        ),
    )


def natural_prefill_form(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    spans: np.ndarray | None,
    tile: int = PREFILL_TILE,
) -> PrefillForm:
    """The form a prefill part (``query_lens``, ``seq_lens`` of its requests;
    ``spans`` its rows' or None) runs best in: ``tiles`` for several requests
    or rows that fit one tile anyway; else ``causal`` for a fresh request
    none of whose rows is in a bidirectional span, ``request`` otherwise."""
    if query_lens.size != 1 or int(query_lens[0]) <= tile:
        return "tiles"
    no_span = spans is None or not bool((spans[:, 1] > spans[:, 0]).any())
    if no_span and int(seq_lens[0]) == int(query_lens[0]):
        return "causal"
    return "request"


_FORM_RANK: dict[str, int] = {"tiles": 0, "request": 1, "causal": 2}


def form_runs(bucket_form: PrefillForm, step_form: PrefillForm) -> bool:
    """Whether a bucket of ``bucket_form`` can run a prefill part whose natural
    form is ``step_form``: ``tiles`` runs any, ``request`` any one request,
    ``causal`` only a fresh one."""
    return _FORM_RANK[step_form] >= _FORM_RANK[bucket_form]


def spans_from_doc_ranges(
    ranges: dict[int, list[tuple[int, int]]] | None,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
) -> np.ndarray | None:
    """[sum(query_lens), 2] per-token spans from vLLM's ``mm_req_doc_ranges``
    (request index -> inclusive ``(start, end)`` position ranges, as vLLM's
    GPU runner computes them for prefix-LM models); None without ranges."""
    if ranges is None:
        return None
    out = np.zeros((int(query_lens.sum()), 2), np.int64)
    first = np.cumsum(query_lens) - query_lens
    for req, req_ranges in ranges.items():
        start_pos = int(seq_lens[req] - query_lens[req])
        for lo, hi in req_ranges:
            a, b = max(lo, start_pos), min(hi + 1, int(seq_lens[req]))
            if lo < hi + 1 and a < b:
                rows = slice(first[req] + a - start_pos, first[req] + b - start_pos)
                out[rows] = (lo, hi + 1)
    return out


def prefill_spans(
    query_lens: np.ndarray, num_decodes: int, spans: np.ndarray | None
) -> np.ndarray | None:
    """The prefill rows' part of per-token ``spans`` (decode rows come first)."""
    if spans is None:
        return None
    if spans.shape != (int(query_lens.sum()), 2):
        raise ValueError(
            f"spans must be [{int(query_lens.sum())}, 2] (one per real token), "
            f"got {list(spans.shape)}"
        )
    return spans[int(query_lens[:num_decodes].sum()) :]


_SIZES = ("num_decodes", "decode_blocks", "num_prefill_tokens", "prefill_blocks")


def check_fits(real: StepShape, shape: StepShape) -> None:
    """Raise unless ``shape`` holds the step ``real`` (its exact shape)."""
    for name in _SIZES:
        if name == "prefill_blocks" and shape.prefill_form == "causal":
            continue  # the causal gather covers the bucket's rows
        if getattr(real, name) > getattr(shape, name):
            raise ValueError(
                f"step needs {name}={getattr(real, name)} but its bucket "
                f"{shape} has only {getattr(shape, name)}"
            )
    if real.num_prefill_tokens and not form_runs(shape.prefill_form, real.prefill_form):
        raise ValueError(
            f"a {real.prefill_form!r} prefill part cannot run in a "
            f"{shape.prefill_form!r} bucket {shape}"
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
