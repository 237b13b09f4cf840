"""Encoder outputs in one preallocated device tensor, by item.

The compiled merge (``worker.multimodal.merge_rows``) gathers encoder rows by
index from a tensor whose shape never changes, so it is compiled once per token
shape whatever the step's items are. This module owns that tensor:

- ``rows``: ``[1 + capacity, width]`` in the model's dtype. Row 0 is the
  scratch row (zeros): padding entries of a placeholder map read it. An item's
  output ``[num_embeds, width]`` occupies ``num_embeds`` consecutive rows
  (*store rows*), found first-fit in a list of free ranges.
- ``capacity`` is vLLM's encoder cache size in embedding rows, the same number
  the scheduler's ``EncoderCacheManager`` admits items against, so what the
  scheduler believes cached always fits in total. Variable-sized items (Qwen's
  dynamic resolution) can leave the free rows in pieces: then the live items
  are moved down to close the gaps (one device copy each, rare). Should an item
  still not fit (the scheduler and this store disagree), the tensor grows,
  which compiles the merge again: it is logged, and the compilation counter
  shows it.

The scheduler decides what stays cached (``free_encoder_mm_hashes``); the store
never evicts on its own.
"""

from __future__ import annotations

import bisect
import logging

import torch

from vllm_hpu_mm import metrics

logger = logging.getLogger("vllm.hpu_mm.encoder_store")

SCRATCH_ROW = 0
"""The store row padding entries read (zeros, owned by no item)."""


class EncoderStore:
    def __init__(
        self, capacity: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if capacity < 1 or width < 1:
            raise ValueError(
                f"encoder store needs capacity >= 1 and width >= 1 rows, got "
                f"capacity={capacity}, width={width}"
            )
        self.width = width
        self.rows = torch.zeros(1 + capacity, width, dtype=dtype, device=device)
        self.items: dict[str, tuple[int, int]] = {}  # key -> (first row, rows)
        self._free: list[tuple[int, int]] = [(1, capacity)]  # (start, length), sorted

    @property
    def capacity(self) -> int:
        return int(self.rows.shape[0]) - 1

    @property
    def used_rows(self) -> int:
        return sum(n for _, n in self.items.values())

    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def __contains__(self, key: str) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def first_row(self, key: str) -> int:
        """Store row of the item's embedding row 0."""
        try:
            return self.items[key][0]
        except KeyError:
            raise RuntimeError(
                f"encoder output of item {key!r} is needed by this step but was "
                "never computed or was already freed"
            ) from None

    def __getitem__(self, key: str) -> torch.Tensor:
        """The item's rows, ``[num_embeds, width]`` (a view of the store)."""
        start = self.first_row(key)
        return self.rows[start : start + self.items[key][1]]

    def put(self, key: str, output: torch.Tensor) -> None:
        """Copy one item's encoder output ``[num_embeds, width]`` (leading dims
        are flattened) into free rows."""
        if key in self.items:
            self.free([key])
        output = output.reshape(-1, output.shape[-1])
        if output.shape[1] != self.width:
            raise RuntimeError(
                f"encoder output of item {key!r} is {output.shape[1]} wide; the "
                f"encoder store was sized for {self.width} (hidden size, plus "
                "deep-stack levels where the model has them)"
            )
        n = int(output.shape[0])
        start = self._allocate(n)
        self.rows[start : start + n].copy_(output.to(self.rows.dtype))
        self.items[key] = (start, n)
        metrics.ENCODER_CACHE_ITEMS.set(len(self.items))

    def free(self, keys: list[str]) -> None:
        for key in keys:
            span = self.items.pop(key, None)
            if span is not None:
                self._release(*span)
        metrics.ENCODER_CACHE_ITEMS.set(len(self.items))

    def clear(self) -> int:
        """Drop every output (the scheduler's side is reset with it); how many."""
        dropped = len(self.items)
        self.items.clear()
        self._free = [(1, self.capacity)]
        metrics.ENCODER_CACHE_ITEMS.set(0)
        return dropped

    # ---- free ranges --------------------------------------------------------------
    def _allocate(self, n: int) -> int:
        start = self._first_fit(n)
        if start is None and self.capacity - self.used_rows >= n:
            self._compact()
            start = self._first_fit(n)
        if start is None:
            self._grow(n)
            start = self._first_fit(n)
        assert start is not None
        return start

    def _first_fit(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def _release(self, start: int, n: int) -> None:
        i = bisect.bisect(self._free, (start, n))
        self._free.insert(i, (start, n))
        # Join with the neighbours it touches.
        if i + 1 < len(self._free) and start + n == self._free[i + 1][0]:
            self._free[i] = (start, n + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            s, m = self._free.pop(i - 1)
            self._free[i - 1] = (s, m + self._free[i - 1][1])

    def _compact(self) -> None:
        """Move the live items down to rows 1.. in order, leaving one free range."""
        row = 1
        for key, (start, n) in sorted(self.items.items(), key=lambda kv: kv[1][0]):
            if start != row:
                self.rows[row : row + n] = self.rows[start : start + n].clone()
                self.items[key] = (row, n)
            row += n
        self._free = [(row, self.capacity - row + 1)] if row <= self.capacity else []
        logger.debug(
            "Encoder store compacted: %d items in rows 1..%d of %d",
            len(self.items),
            row - 1,
            self.capacity,
        )

    def _grow(self, n: int) -> None:
        old = self.capacity
        new = max(2 * old, self.used_rows + n)
        rows = self.rows.new_zeros(1 + new, self.width)
        rows[: 1 + old] = self.rows
        self.rows = rows
        self._release(1 + old, new - old)
        logger.warning(
            "Encoder store grew from %d to %d rows: an item of %d rows did not "
            "fit beside %d cached rows (more than vLLM's encoder cache size); "
            "the merge compiles again for the new size",
            old,
            new,
            n,
            self.used_rows,
        )
