"""Which encoder-output rows go to which token rows in one engine step.

A multimodal prompt reserves, per item (an image, ...), a run of placeholder
tokens; the model replaces their input embeddings with rows of the item's
encoder output. With chunked prefill a step computes only part of a request,
so only the part of each item that falls inside the step's chunk is merged.
This module turns the step's chunks into flat gather/scatter maps; it is pure
(ints and numpy only, no torch, no vLLM).

Index spaces used below:

- *positions*: a token's absolute position inside its request. An item's
  placeholder tokens occupy positions ``[offset, offset + length)``; a step
  computes positions ``[chunk_start, chunk_start + chunk_len)`` of a request.
- *item-local indices*: ``position - offset``, in ``[0, length)``; ``is_embed``
  is indexed by them.
- *embedding rows*: rows of one item's encoder output, ``[0, num_embeds)``.
  The k-th item-local index whose ``is_embed`` is True takes embedding row k
  (every index when ``is_embed`` is None, so then embedding row = local index).
- *token rows*: rows of the step's flattened token batch (decode requests
  first, then the prefill requests' chunk tokens); a request's chunk occupies
  token rows ``[row_start, row_start + chunk_len)``, position ``p`` of the
  chunk at token row ``row_start + p - chunk_start``.
- *global source rows*: rows of the concatenation of several items' encoder
  outputs (see ``flat_source_rows``), for a single ``index_select``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ItemPlacement",
    "PlaceholderMap",
    "RequestChunk",
    "bidirectional_spans",
    "build_placeholder_maps",
    "flat_source_rows",
    "needed_items",
    "request_chunks",
]


@dataclass(frozen=True, slots=True)
class ItemPlacement:
    """Where one multimodal item's placeholder tokens sit in its request."""

    key: str
    """The item's hash: identifies its (cached) encoder output."""
    modality: str
    """"image", ...: items of different modalities get separate maps."""
    offset: int
    """Position of the first placeholder token."""
    length: int
    """Placeholder tokens: positions ``[offset, offset + length)``."""
    is_embed: tuple[bool, ...] | None = None
    """Per item-local index, whether that position takes an embedding row;
    None means every position does. Any sequence of bools (list, numpy array,
    ...) is accepted and stored as a tuple."""
    _embed_pos: np.ndarray | None = field(
        init=False, default=None, repr=False, compare=False, hash=False
    )
    """Cache: item-local index of each embedding row (ascending), or None."""

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(
                f"item {self.key!r}: placeholder length must be >= 1, got {self.length}"
            )
        if self.offset < 0:
            raise ValueError(
                f"item {self.key!r}: placeholder offset must be >= 0, got {self.offset}"
            )
        if self.is_embed is None:
            return
        mask = tuple(bool(x) for x in self.is_embed)
        if len(mask) != self.length:
            raise ValueError(
                f"item {self.key!r}: is_embed has {len(mask)} entries but the "
                f"placeholder length is {self.length}"
            )
        object.__setattr__(self, "is_embed", mask)
        pos = np.flatnonzero(np.asarray(mask, dtype=bool)).astype(np.int64)
        pos.setflags(write=False)
        object.__setattr__(self, "_embed_pos", pos)

    @classmethod
    def from_range(cls, key: str, modality: str, rng: Any) -> ItemPlacement:
        """From anything shaped like vLLM's ``PlaceholderRange`` (``offset``,
        ``length``, ``is_embed``: None or a bool tensor / array / sequence)."""
        mask = rng.is_embed
        if mask is not None and hasattr(mask, "tolist"):
            mask = mask.tolist()
        return cls(key, modality, int(rng.offset), int(rng.length), mask)

    @property
    def end(self) -> int:
        """One past the last placeholder position."""
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Rows of the item's encoder output (True entries of is_embed)."""
        if self._embed_pos is None:
            return self.length
        return int(self._embed_pos.size)

    def embed_rows_in(self, start: int, end: int) -> tuple[int, int]:
        """The embedding rows ``[k0, k1)`` taken by positions ``[start, end)``.

        Positions outside the placeholder contribute nothing; ``k0 == k1``
        when the range holds no embedding position. Consecutive position
        ranges give consecutive embedding-row ranges.
        """
        lo = min(max(start - self.offset, 0), self.length)
        hi = min(max(end - self.offset, lo), self.length)
        if self._embed_pos is None:
            return lo, hi
        k0 = int(np.searchsorted(self._embed_pos, lo, side="left"))
        k1 = int(np.searchsorted(self._embed_pos, hi, side="left"))
        return k0, k1

    def embed_runs(self) -> list[tuple[int, int]]:
        """Positions ``[start, end)`` of each run of consecutive embedding
        positions (one run, the whole placeholder, when is_embed is None)."""
        if self._embed_pos is None:
            return [(self.offset, self.end)]
        pos = self._embed_pos
        if pos.size == 0:
            return []
        cuts = np.flatnonzero(np.diff(pos) != 1) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [pos.size]])
        return [
            (self.offset + int(pos[a]), self.offset + int(pos[b - 1]) + 1)
            for a, b in zip(starts, ends, strict=True)
        ]

    def embed_positions(self, k0: int, k1: int) -> np.ndarray:
        """[k1 - k0] int64 position of each embedding row in ``[k0, k1)``."""
        if self._embed_pos is None:
            return np.arange(self.offset + k0, self.offset + k1, dtype=np.int64)
        return self._embed_pos[k0:k1] + self.offset


@dataclass(frozen=True, slots=True)
class RequestChunk:
    """The part of one request that the step computes, and its items."""

    chunk_start: int
    """First position computed this step."""
    chunk_len: int
    """Positions ``[chunk_start, chunk_start + chunk_len)`` are computed."""
    row_start: int
    """Token row of position ``chunk_start`` in the step batch."""
    items: tuple[ItemPlacement, ...] = ()
    """The request's items, in prompt order (all of them: those outside the
    chunk are skipped). Their embedding positions must not overlap."""

    def __post_init__(self) -> None:
        if self.chunk_start < 0 or self.chunk_len < 0 or self.row_start < 0:
            raise ValueError(
                "chunk_start, chunk_len and row_start must be >= 0, got "
                f"{self.chunk_start}, {self.chunk_len}, {self.row_start}"
            )
        items = tuple(self.items)
        object.__setattr__(self, "items", items)
        # Placeholders may share positions that take no embedding (vLLM's
        # Gemma 3 joins the "\n\n" after one image and before the next into
        # one token that both ranges hold); embedding positions may not.
        spans = sorted((a, b, it.key) for it in items for a, b in it.embed_runs())
        for (_, a_end, a_key), (b_off, _, b_key) in itertools.pairwise(spans):
            if b_off < a_end:
                raise ValueError(
                    f"items {a_key!r} and {b_key!r} overlap: embedding positions "
                    f"up to {a_end} and from {b_off}"
                )

    @property
    def chunk_end(self) -> int:
        """One past the last position computed this step."""
        return self.chunk_start + self.chunk_len


@dataclass(frozen=True, eq=False)
class PlaceholderMap:
    """One modality's scatter map of a step: entry i copies row ``src_row[i]``
    of the encoder output of item ``item_keys[src_item[i]]`` (embedding-row
    space) to token row ``dst_row[i]``.

    Real entries ``[0, num_real)`` come request after request (batch order),
    item after item (request order), position after position; they hit
    distinct token rows. Padding entries ``[num_real, N)`` read row 0 of item
    0 and write the scratch token row given to ``build_placeholder_maps``.
    """

    item_keys: tuple[str, ...]
    """Distinct items with at least one entry, in first-use order."""
    src_item: np.ndarray
    """[N] int64 index into item_keys; 0 on padding."""
    src_row: np.ndarray
    """[N] int64 row within that item's encoder output; 0 on padding."""
    dst_row: np.ndarray
    """[N] int64 token row; the scratch row on padding."""
    num_real: int
    """Entries that are not padding."""

    def __post_init__(self) -> None:
        n = self.dst_row.shape[0]
        for name in ("src_item", "src_row", "dst_row"):
            a = getattr(self, name)
            if a.dtype != np.int64 or a.shape != (n,):
                raise ValueError(
                    f"{name} must be int64 of shape ({n},), got {a.dtype} {a.shape}"
                )
        if not 0 <= self.num_real <= n:
            raise ValueError(f"num_real={self.num_real} outside [0, {n}]")

    def __len__(self) -> int:
        """N, the padded number of entries."""
        return int(self.dst_row.shape[0])


def _check_consistent(seen: dict[str, ItemPlacement], item: ItemPlacement) -> None:
    """Items sharing a key share one encoder output: same modality and size."""
    prev = seen.setdefault(item.key, item)
    if prev is item:
        return
    if prev.modality != item.modality or prev.num_embeds != item.num_embeds:
        raise ValueError(
            f"item {item.key!r} appears as {prev.modality} with "
            f"{prev.num_embeds} embedding rows and as {item.modality} with "
            f"{item.num_embeds}"
        )


def needed_items(chunks: Iterable[RequestChunk]) -> dict[str, ItemPlacement]:
    """Items whose encoder output this step reads, by key, in first-use order:
    those with an embedding position inside their request's chunk. Items
    wholly before or after the chunk, or meeting it only at is_embed holes,
    are left out. Per key, the first placement met is returned."""
    seen: dict[str, ItemPlacement] = {}
    out: dict[str, ItemPlacement] = {}
    for ch in chunks:
        for item in ch.items:
            _check_consistent(seen, item)
            if item.key in out:
                continue
            k0, k1 = item.embed_rows_in(ch.chunk_start, ch.chunk_end)
            if k1 > k0:
                out[item.key] = item
    return out


def build_placeholder_maps(
    chunks: Sequence[RequestChunk],
    *,
    scratch_row: int,
    pad_to: Callable[[int], int] | None = None,
    modalities: Iterable[str] = (),
) -> dict[str, PlaceholderMap]:
    """Per modality, the scatter map of this step's chunks (see PlaceholderMap).

    chunks: the step's requests in batch order (their token-row ranges must
    not overlap). scratch_row: the token row padding entries write (a padding
    row whose embedding is never used; it must not be a real destination).
    pad_to: bucket function, N = pad_to(num_real) >= num_real (identity when
    None). modalities: modalities always present in the result, empty ones
    padded to pad_to(0); other modalities appear only when they have entries.
    """
    if scratch_row < 0:
        raise ValueError(f"scratch_row must be >= 0, got {scratch_row}")
    _check_rows_disjoint(chunks)
    seen: dict[str, ItemPlacement] = {}
    keys: dict[str, dict[str, int]] = {m: {} for m in modalities}
    parts: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {
        m: [] for m in modalities
    }
    for ch in chunks:
        shift = ch.row_start - ch.chunk_start  # position -> token row
        for item in ch.items:
            _check_consistent(seen, item)
            k0, k1 = item.embed_rows_in(ch.chunk_start, ch.chunk_end)
            if k1 <= k0:
                continue
            mkeys = keys.setdefault(item.modality, {})
            idx = mkeys.setdefault(item.key, len(mkeys))
            src = np.arange(k0, k1, dtype=np.int64)
            dst = item.embed_positions(k0, k1) + shift
            parts.setdefault(item.modality, []).append((idx, src, dst))

    out: dict[str, PlaceholderMap] = {}
    for modality, plist in parts.items():
        n_real = sum(src.size for _, src, _ in plist)
        n = n_real if pad_to is None else int(pad_to(n_real))
        if n < n_real:
            raise ValueError(
                f"{modality}: pad_to({n_real}) returned {n}, fewer than the "
                f"{n_real} placeholder entries"
            )
        src_item = np.zeros(n, np.int64)
        src_row = np.zeros(n, np.int64)
        dst_row = np.full(n, scratch_row, np.int64)
        if plist:
            sizes = np.fromiter((s.size for _, s, _ in plist), np.int64, len(plist))
            idxs = np.fromiter((i for i, _, _ in plist), np.int64, len(plist))
            src_item[:n_real] = np.repeat(idxs, sizes)
            src_row[:n_real] = np.concatenate([s for _, s, _ in plist])
            dst_row[:n_real] = np.concatenate([d for _, _, d in plist])
        if n > n_real and np.any(dst_row[:n_real] == scratch_row):
            raise ValueError(
                f"{modality}: scratch_row {scratch_row} is a real placeholder "
                "destination"
            )
        out[modality] = PlaceholderMap(
            item_keys=tuple(keys[modality]),
            src_item=src_item,
            src_row=src_row,
            dst_row=dst_row,
            num_real=n_real,
        )
    return out


def _check_rows_disjoint(chunks: Sequence[RequestChunk]) -> None:
    spans = sorted(
        (ch.row_start, ch.row_start + ch.chunk_len) for ch in chunks if ch.chunk_len
    )
    for (a0, a1), (b0, b1) in itertools.pairwise(spans):
        if b0 < a1:
            raise ValueError(
                f"chunks' token rows overlap: [{a0}, {a1}) and [{b0}, {b1})"
            )


def flat_source_rows(
    m: PlaceholderMap, item_row_offsets: Mapping[str, int]
) -> np.ndarray:
    """[N] int64 rows into the concatenation of the items' encoder outputs:
    ``item_row_offsets[key]`` is the first row of item ``key`` there, so entry
    i reads global row ``item_row_offsets[item_keys[src_item[i]]] +
    src_row[i]``. Padding entries read row 0."""
    missing = [k for k in m.item_keys if k not in item_row_offsets]
    if missing:
        raise KeyError(f"no encoder-output row offset for items {missing}")
    offs = np.fromiter(
        (item_row_offsets[k] for k in m.item_keys), np.int64, len(m.item_keys)
    )
    out = np.zeros(len(m), np.int64)
    if m.num_real:
        real = slice(0, m.num_real)
        out[real] = offs[m.src_item[real]] + m.src_row[real]
    return out


def request_chunks(
    states: Sequence[Any],
    query_lens: Sequence[int] | np.ndarray,
    row_starts: Sequence[int] | np.ndarray,
) -> list[RequestChunk]:
    """The step's chunks of the requests that have multimodal items.

    states: objects with ``num_computed_tokens`` and ``mm_features`` (vLLM's
    ``MultiModalFeatureSpec``: ``identifier``, ``modality``, ``mm_position``),
    in batch order; query_lens: tokens each computes this step; row_starts: the
    row (in whatever row space the caller uses) of each request's first token.
    """
    return [
        RequestChunk(
            chunk_start=int(s.num_computed_tokens),
            chunk_len=int(n),
            row_start=int(r),
            items=tuple(
                ItemPlacement.from_range(f.identifier, f.modality, f.mm_position)
                for f in s.mm_features
            ),
        )
        for s, n, r in zip(states, query_lens, row_starts, strict=True)
        if s.mm_features
    ]


def bidirectional_spans(chunks: Sequence[RequestChunk], num_rows: int) -> np.ndarray:
    """[num_rows, 2] int64: for each row, the positions ``[start, end)`` of the
    bidirectional span holding its token, ``(0, 0)`` for a row in none.

    A span is one run of consecutive embedding positions of one item (Gemma 3:
    an image's soft tokens; its ``<start_of_image>`` and ``<end_of_image>``
    tokens are text and stay causal), as transformers' ``token_type_ids``
    blocks mark them. A span may reach past the chunk (a later chunk computes
    the rest); the attention metadata clips it to the keys computed so far.
    """
    out = np.zeros((num_rows, 2), np.int64)
    _check_rows_disjoint(chunks)
    for ch in chunks:
        shift = ch.row_start - ch.chunk_start  # position -> row
        for item in ch.items:
            for start, end in item.embed_runs():
                lo, hi = max(start, ch.chunk_start), min(end, ch.chunk_end)
                if lo >= hi:
                    continue
                if hi + shift > num_rows:
                    raise ValueError(
                        f"item {item.key!r}: rows up to {hi + shift} but the step "
                        f"has {num_rows}"
                    )
                out[lo + shift : hi + shift] = (start, end)
    return out
