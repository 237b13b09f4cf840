"""Attention FLOPs of a fresh prompt in a sliding-window layer, the static
plan's causal form (``hpu_kernels.attention.causal_prefill_attention``): one
banded mask over all the rows against row tiles over overlapping key windows,
each over the windowed minimum (each row against its last W positions).
Counted with the work counter, not timed:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/window_prefill_flops.py
"""

from __future__ import annotations

import torch

from hpu_kernels.attention import KVCache, causal_prefill_attention
from vllm_hpu_mm.bench.work import WorkCounter

T, W, BS, H, HKV, D = 8192, 1024, 128, 4, 2, 16  # Gemma 3's 1024-token window


def main() -> None:
    nb = T // BS + 1
    key = torch.randn(nb * BS, HKV, D).bfloat16()
    kv = KVCache(key, torch.randn(nb * BS, HKV, D).bfloat16(), BS)
    q = torch.randn(T, H, D).bfloat16()
    blocks = torch.arange(1, nb).view(1, -1)
    minimum = sum(min(i + 1, W) for i in range(T)) * 4 * H * D
    print(f"fresh prompt of {T} rows, window {W}: attention FLOPs / minimum")
    for tile in (T + W, 128):  # T + W: too wide to tile, one banded mask
        counter = WorkCounter()
        with torch.no_grad(), counter:
            causal_prefill_attention(
                q, kv, blocks, D**-0.5, sliding_window=W, window_tile=tile
            )
        ratio = sum(counter.counts.flops.values()) / minimum
        name = "one banded mask" if tile > T else f"row tiles of {tile}"
        print(f"  {name}: {ratio:.2f}")


if __name__ == "__main__":
    main()
