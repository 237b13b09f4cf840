"""Dense decode cache: a per-request copy of the decoding requests' K/V.

Paged decode attention gathers every decode row's blocks out of the paged
cache in every layer of every step: on the CPU, for 32 requests of ~300
tokens, that gather was 0.8 of the 1.35 ms a layer spent in decode attention,
bandwidth-bound (2 x 5 MB copied and read again by SDPA). The dense cache keeps,
per layer, ``[2, S, Hkv, L, D]`` (``S`` slots = max_num_seqs, ``L`` =
max_model_len rounded up to a block): one slot per decoding request, holding
its keys and values at their positions. A request's blocks are copied into
its slot once, when it starts decoding (or whenever its slot does not hold
exactly its first ``seq_len - 1`` positions); after that each step appends
its one new token, and attention reads the slots directly
(``hpu_kernels.attention.dense_decode_attention``).

An FP8 paged cache (``--kv-cache-dtype fp8``) is copied in dequantized, in
the model's dtype: the dense cache exists to make the CPU's decode reads
cheap, and an FP8 copy would be dequantized again by every layer at every
step (the whole ``[S, Hkv, W, D]`` slab); the values are the same (each step
appends its token as the paged cache holds it, quantized and read back), so
the tokens are those of the paged path. It costs the model dtype's bytes, not
FP8's, and is sized against the paged cache's bytes as usual.

The paged cache stays the source of truth (prefix caching, preemption, the
prefill path and Gaudi all use it); the dense copy is rebuilt from it, so a
slot is only ever a cache of it. Used where attention runs outside any
compiled graph on the CPU (eager mode, or graph mode with opaque attention): a
traced graph never reads host-side state, on Gaudi every shape must be a
warmed-up graph, and on an accelerator the paged cache already fills the
memory left. It costs ``S * L`` tokens of K/V per layer,
so the runner builds it only when that is at most
``hpu_mm.memory.decode_cache_fraction`` of the paged cache.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hpu_kernels.attention import KVCache
from hpu_kernels.kv_fp8 import FP8_KV_DTYPE
from vllm_hpu_mm.attention.metadata import PAD_BLOCK

logger = logging.getLogger("vllm.hpu_mm.decode_cache")

WIDTH_STEP = 64
"""Key columns attended are the longest row's length rounded up to this."""


@dataclass
class DenseDecodeStep:
    """What one step's decode rows need of the dense cache (host-built once
    per step, read by every layer)."""

    cache: DecodeCache
    slots: torch.Tensor  # [R] int64 slot of each real decode row
    positions: torch.Tensor  # [R] int64 position of each row's new token
    fill_slots: torch.Tensor | None  # [F] int64 slots rebuilt this step
    fill_blocks: torch.Tensor | None  # [F, M] int64 their paged blocks
    lengths: torch.Tensor  # [U] int64 keys of each of the first U slots
    width: int  # W: key columns read
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[U, 1, 1, W] bool: slot u may attend key w. Built once per step
        and window (layers with and without a sliding window differ)."""
        if sliding_window not in self._masks:
            col = torch.arange(self.width, device=self.lengths.device)[None, :]
            lens = self.lengths[:, None]
            keep = col < lens
            if sliding_window is not None:
                keep &= col > lens - 1 - sliding_window
            keep |= (lens <= 0) & (col == 0)  # a free slot: key 0, never NaN
            self._masks[sliding_window] = keep[:, None, None, :]
        return self._masks[sliding_window]


def _held_len(max_model_len: int, block_size: int) -> int:
    """Positions a slot holds: max_model_len rounded up to whole blocks."""
    return -(-max_model_len // block_size) * block_size


class DecodeCache:
    """Slots and per-layer dense tensors of the dense decode cache."""

    def __init__(
        self,
        num_slots: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self.max_len = _held_len(max_model_len, block_size)
        self.device = device
        # What an FP8 paged cache's copy holds (None: FP8 caches not expected).
        self.compute_dtype = compute_dtype
        self._tensors: dict[int, torch.Tensor] = {}
        self._slot_of: dict[str, int] = {}
        self._length: dict[str, int] = {}  # positions the slot holds
        self._free = list(range(num_slots))  # a heap: lowest free slot first
        self.fills = 0  # requests copied in from the paged cache, in total

    @staticmethod
    def dense_dtype(
        kv_cache: KVCache, compute_dtype: torch.dtype | None
    ) -> torch.dtype:
        """The paged cache's dtype; for an FP8 one, ``compute_dtype``."""
        if kv_cache.key.dtype == FP8_KV_DTYPE:
            if compute_dtype is None:
                raise ValueError("an FP8 paged cache needs the compute dtype")
            return compute_dtype
        return kv_cache.key.dtype

    @staticmethod
    def bytes_per_layer(
        num_slots: int,
        max_model_len: int,
        block_size: int,
        kv_cache: KVCache,
        compute_dtype: torch.dtype | None = None,
    ) -> int:
        """Bytes of one layer's dense tensor for a paged ``kv_cache`` layer."""
        max_len = _held_len(max_model_len, block_size)
        dtype = DecodeCache.dense_dtype(kv_cache, compute_dtype)
        per_elem = torch.empty((), dtype=dtype).element_size()
        heads, head = kv_cache.num_kv_heads, kv_cache.head_size
        return 2 * num_slots * heads * max_len * head * per_elem

    def tensor_for(self, kv_cache: KVCache) -> torch.Tensor:
        """The dense ``[2, S, Hkv, L, D]`` tensor of the layer whose paged
        cache is ``kv_cache`` (allocated, zeroed, on its first step)."""
        key = kv_cache.key.data_ptr()
        dense = self._tensors.get(key)
        if dense is None:
            dense = torch.zeros(
                (2, self.num_slots, kv_cache.num_kv_heads, self.max_len,
                 kv_cache.head_size),
                dtype=self.dense_dtype(kv_cache, self.compute_dtype),
                device=kv_cache.key.device,
            )  # fmt: skip
            self._tensors[key] = dense
        return dense

    @property
    def active(self) -> int:
        """Requests holding a slot."""
        return len(self._slot_of)

    def drop(self, req_id: str) -> None:
        """Forget a request (finished, or prefilling again): its slot is free."""
        slot = self._slot_of.pop(req_id, None)
        self._length.pop(req_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)

    def clear(self) -> None:
        """Forget every request (the paged cache was replaced)."""
        for req_id in list(self._slot_of):
            self.drop(req_id)
        self._tensors.clear()

    def _slot(self, req_id: str, keep: set[str]) -> int:
        if req_id in self._slot_of:
            return self._slot_of[req_id]
        if not self._free:  # a preempted request still holds one: evict it
            victim = next(r for r in self._slot_of if r not in keep)
            self.drop(victim)
        slot = heapq.heappop(self._free)
        self._slot_of[req_id] = slot
        return slot

    def plan(
        self,
        decode_ids: Sequence[str],
        seq_lens: np.ndarray,
        block_ids: Sequence[Sequence[int]],
        prefill_ids: Sequence[str] = (),
    ) -> DenseDecodeStep | None:
        """The step's decode rows: ``decode_ids`` with context lengths
        ``seq_lens`` (this step's token included) and their paged blocks;
        ``prefill_ids``, the step's other requests, lose their slots (their
        K/V are being written afresh). None when the step has no decode row.
        """
        for req_id in prefill_ids:
            self.drop(req_id)
        rows = len(decode_ids)
        if rows == 0:
            return None
        if rows > self.num_slots:
            raise ValueError(f"{rows} decode rows but {self.num_slots} slots")
        if int(seq_lens.max()) > self.max_len:
            raise ValueError(
                f"context of {int(seq_lens.max())} tokens exceeds the dense "
                f"decode cache's {self.max_len}"
            )
        keep = set(decode_ids)
        slots = np.empty(rows, np.int64)
        fills: list[tuple[int, Sequence[int], int]] = []
        for i, (req_id, seq_len) in enumerate(zip(decode_ids, seq_lens, strict=True)):
            slot = self._slot(req_id, keep)
            slots[i] = slot
            held = int(seq_len) - 1  # positions before this step's token
            if self._length.get(req_id) != held and held > 0:
                fills.append((slot, block_ids[i], -(-held // self.block_size)))
            self._length[req_id] = int(seq_len)
        used = int(slots.max()) + 1
        lengths = np.zeros(used, np.int64)
        lengths[slots] = seq_lens
        width = min(self.max_len, -(-int(seq_lens.max()) // WIDTH_STEP) * WIDTH_STEP)
        fill_slots = fill_blocks = None
        if fills:
            self.fills += len(fills)
            widest = max(n for _, _, n in fills)
            table = np.full((len(fills), widest), PAD_BLOCK, np.int64)
            for j, (_, blocks, n) in enumerate(fills):
                table[j, :n] = blocks[:n]
            fill_slots = self._tensor(np.array([s for s, _, _ in fills], np.int64))
            fill_blocks = self._tensor(table)
        return DenseDecodeStep(
            cache=self,
            slots=self._tensor(slots),
            positions=self._tensor(np.asarray(seq_lens, np.int64) - 1),
            fill_slots=fill_slots,
            fill_blocks=fill_blocks,
            lengths=self._tensor(lengths),
            width=width,
        )

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)
