"""Preallocated device buffers for the step's inputs, reused every step.

Each named input (token ids, positions, slot mapping, block tables, ...) lives
in one flat device tensor; a step writes its padded values into the buffer's
prefix and hands out a view of it. Buffers only grow (to the largest bucket,
which warmup reaches first), so serving allocates nothing on the device for
inputs, and graph inputs keep the same storage from step to step.
"""

from __future__ import annotations

import numpy as np
import torch


class DeviceBuffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def put(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Copy ``array`` into buffer ``name``; return a view of its shape."""
        src = torch.from_numpy(np.ascontiguousarray(array))
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < src.numel() or buf.dtype != src.dtype:
            old = 0 if buf is None else buf.numel()
            buf = torch.zeros(
                max(src.numel(), 2 * old, 1), dtype=src.dtype, device=self.device
            )
            self._buffers[name] = buf
        view = buf[: src.numel()].view(src.shape)
        view.copy_(src, non_blocking=True)
        return view

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
