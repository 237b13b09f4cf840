"""The model's weight memory by dtype, for the start-up log: an FP8
checkpoint's saving shows as ``float8_e4m3fn`` bytes next to what the same
weights would take in the serving dtype."""

from __future__ import annotations

import torch


def weight_bytes_by_dtype(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters per dtype name (``float8_e4m3fn``...)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + p.numel() * p.element_size()
    return out


def weight_memory_line(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """``Model weights: 1.23 MiB (float8_e4m3fn 0.50 MiB, float32 0.73 MiB);
    2.73 MiB unquantized in float32``: the second figure counts every FP8
    weight at the serving dtype's size."""
    by_dtype = weight_bytes_by_dtype(model)
    total = sum(by_dtype.values())
    fp8 = sum(b for name, b in by_dtype.items() if name.startswith("float8"))
    size = torch.empty((), dtype=dtype).element_size()
    unquantized = total - fp8 + fp8 * size
    parts = ", ".join(
        f"{name} {b / 2**20:.2f} MiB" for name, b in sorted(by_dtype.items())
    )
    line = f"Model weights: {total / 2**20:.2f} MiB ({parts})"
    if fp8:
        line += (
            f"; {unquantized / 2**20:.2f} MiB unquantized in "
            f"{str(dtype).removeprefix('torch.')}"
        )
    return line
