"""The merge of encoder rows into token embeddings, as one compiled region.

A pass over ``T`` token rows (a step, or one part of a mixed step) reads, per
modality, one ``MergeMap`` from its attention metadata (``mm_maps``): ``T``
entries, each copying one row of the encoder store (``worker.encoder_store``)
into one token row. Real entries come first; padding entries read the store's
scratch row and write token row ``T``, a scratch row past the pass's rows that
is dropped. Every shape is fixed by ``T`` (the map length, the store's rows),
so ``merge_rows`` is one graph per token shape, prepared at warmup with the
decoder layers, and a step's items change only tensor values. The text
embeddings come in from the model's own ``embed_input_ids``, run eagerly beside
the compiled regions as the rest of the embedding is (tracing it would guard
on vLLM's module-level language-model cache).

Index spaces: *store rows* (rows of the encoder store; an item's embedding row
``k`` is store row ``first_row + k``) and *pass rows* (token rows of the pass,
from 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hpu_mm.worker.encoder_store import SCRATCH_ROW

Put = Callable[[str, np.ndarray], torch.Tensor]
"""Copies a host array to the device (a ``DeviceBuffers`` buffer, by name)."""


def to_device(device: torch.device) -> Put:
    return lambda _name, a: torch.from_numpy(np.ascontiguousarray(a)).to(device)


@dataclass(frozen=True, eq=False)
class MergeMap:
    """One modality's placeholder map of a pass: entry i copies store row
    ``src[i]`` to pass row ``dst[i]``."""

    src: torch.Tensor
    """[T] int64 store rows; SCRATCH_ROW on padding."""
    dst: torch.Tensor
    """[T] int64 pass rows; T (the scratch row) on padding."""
    host_src: np.ndarray
    """[num_real] int64 the real entries' store rows (host copy, for splitting)."""
    host_dst: np.ndarray
    """[num_real] int64 their pass rows, distinct."""
    name: str
    """Buffer name prefix of ``src``/``dst``."""
    put: Put

    @property
    def num_real(self) -> int:
        return int(self.host_dst.shape[0])

    @property
    def rows(self) -> int:
        """T, the pass's token rows."""
        return int(self.dst.shape[0])

    def split(self, at: int) -> tuple[MergeMap, MergeMap]:
        """The maps of pass rows [0, at) and [at, T), each from its row 0."""
        low = self.host_dst < at
        first = merge_map(
            f"{self.name}.d", self.host_src[low], self.host_dst[low], at, self.put
        )
        second = merge_map(
            f"{self.name}.p",
            self.host_src[~low],
            self.host_dst[~low] - at,
            self.rows - at,
            self.put,
        )
        return first, second


def merge_map(
    name: str, host_src: np.ndarray, host_dst: np.ndarray, rows: int, put: Put
) -> MergeMap:
    """The ``rows``-entry map of the given real entries, padded."""
    n = int(host_dst.shape[0])
    if n > rows:
        raise ValueError(f"{n} placeholder entries for a pass of {rows} token rows")
    if n and (host_dst.min() < 0 or host_dst.max() >= rows):
        raise ValueError(f"placeholder destinations outside pass rows [0, {rows})")
    src = np.full(rows, SCRATCH_ROW, np.int64)
    dst = np.full(rows, rows, np.int64)
    src[:n] = host_src
    dst[:n] = host_dst
    return MergeMap(
        src=put(f"{name}.src", src),
        dst=put(f"{name}.dst", dst),
        host_src=np.asarray(host_src, np.int64),
        host_dst=np.asarray(host_dst, np.int64),
        name=name,
        put=put,
    )


def split_maps(
    maps: dict[str, MergeMap], at: int
) -> tuple[dict[str, MergeMap], dict[str, MergeMap]]:
    """A mixed step's maps as (decode rows, prefill rows)."""
    parts = {k: m.split(at) for k, m in maps.items()}
    return {k: p[0] for k, p in parts.items()}, {k: p[1] for k, p in parts.items()}


def merge_rows(
    text: torch.Tensor,
    store: torch.Tensor,
    srcs: tuple[torch.Tensor, ...],
    dsts: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token embeddings with the mapped encoder rows in place.

    text: [T, H] the pass's text embeddings; store: [1 + capacity, W] (W = H,
    or H plus the deep-stack levels); srcs, dsts: per modality, [T] each.
    Returns embeddings [T, H] and, when W > H, the rows' remaining columns
    [T, W - H] (zeros on text rows)."""
    t, hidden = text.shape
    out = torch.cat([text, text.new_zeros(1, hidden)])  # row T: scratch
    width = store.shape[1]
    extra = text.new_zeros(t + 1, width - hidden) if width > hidden else None
    for src, dst in zip(srcs, dsts, strict=True):
        rows = store.index_select(0, src).to(out.dtype)  # [T, W]
        out.index_copy_(0, dst, rows[:, :hidden])
        if extra is not None:
            extra.index_copy_(0, dst, rows[:, hidden:])
    return out[:t], None if extra is None else extra[:t]
