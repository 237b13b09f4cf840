"""RoPE's work per step on Gaudi's path: cos/sin per layer against once per step.

Runs the fused rotary modules (``vllm_hpu_mm.fused_ops``) on the simulated
Habana stack at the text-model shapes of published checkpoints, once as a
model called bare (every layer gathers its cos/sin from the cache, as before
issue 29 item 3) and once through ``StepRope`` (the graph runner gathers once
per step, the layers only rotate), and counts under a dispatch mode: gathers
from a cos/sin cache, ATen ops, and bytes those ops write (the rotation's
included, the projections' not). No timing: the simulated kernel is PyTorch on
the host, and Gaudi's cost of an op is not the host's.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/rope_step.py
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    layers: int
    head: int
    q_heads: int
    kv_heads: int
    kind: str  # "llama3", "mrope", "mrope_interleaved", "gemma3"


SHAPES = (
    Shape("Llama-3.1-8B", 32, 128, 32, 8, "llama3"),
    Shape("Qwen2.5-VL-7B", 28, 128, 28, 4, "mrope"),
    Shape("Qwen3-VL-8B", 36, 128, 32, 8, "mrope_interleaved"),
    Shape("Gemma-3-4B", 34, 256, 8, 4, "gemma3"),
)


def _ropes(shape: Shape, dtype: Any) -> list[Any]:
    """The model's rotary modules, one per layer (shared where get_rope
    shares them): Gemma 3 alternates 5 local layers and 1 global."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    h, p = shape.head, 8192
    if shape.kind == "llama3":
        params = {
            "rope_theta": 500000.0,
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        return [get_rope(h, p, True, params, dtype)] * shape.layers
    if shape.kind.startswith("mrope"):
        section = [16, 24, 24] if shape.kind == "mrope" else [24, 20, 20]
        params = {
            "rope_theta": 1000000.0,
            "mrope_section": section,
            "mrope_interleaved": shape.kind == "mrope_interleaved",
        }
        return [get_rope(h, p, True, params, dtype)] * shape.layers
    local = get_rope(h, p, True, {"rope_theta": 10000.0}, dtype)
    linear = {"rope_theta": 1000000.0, "rope_type": "linear", "factor": 8.0}
    glob = get_rope(h, p, True, linear, dtype)
    return [glob if (i + 1) % 6 == 0 else local for i in range(shape.layers)]


def _count(fn: Any) -> tuple[int, int, int]:
    """(cos/sin gathers, ATen ops, bytes written) of ``fn()``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Counter(TorchDispatchMode):
        gathers = ops = written = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            if func in (torch.ops.aten.index_select.default,) and (
                args[0].is_floating_point()
            ):
                self.gathers += 1
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.written += t.numel() * t.element_size()
            return out

    with Counter() as c:
        fn()
    return c.gathers, c.ops, c.written


def measure(shape: Shape, tokens: int) -> dict[str, Any]:
    import torch

    from vllm_hpu_mm.fused_ops import StepRope

    dtype = torch.bfloat16
    ropes = _ropes(shape, dtype)
    g = torch.Generator().manual_seed(0)
    mm = shape.kind.startswith("mrope")
    positions = torch.randint(0, 4096, (3, tokens) if mm else (tokens,), generator=g)
    q = torch.randn(tokens, shape.q_heads * shape.head, generator=g).to(dtype)
    k = torch.randn(tokens, shape.kv_heads * shape.head, generator=g).to(dtype)

    def layers() -> None:
        for rope in ropes:
            rope(positions, q, k)

    holder = torch.nn.ModuleList(dict.fromkeys(ropes))  # the distinct modules
    steps = StepRope(holder)
    assert len(steps.modules) == len(holder), "no fused kernel: not on HPU"

    def stepped() -> None:
        with steps.step(positions):
            layers()

    with torch.no_grad():
        return {"bare": _count(layers), "step": _count(stepped)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[128, 2048], help="rows per step"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_HPU_MM_DEVICE", "hpu")
    os.environ.setdefault("VLLM_HPU_MM_GAUDI_SIM", "1")
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    from vllm_hpu_mm import device
    from vllm_hpu_mm.fused_ops import FUSED_OP_NAMES, register_fused_ops

    assert device.device_kind() == "hpu"
    register_fused_ops()
    ops = [f"+{n}" for n in FUSED_OP_NAMES]
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=ops))
    print(
        "| model | rows | cos/sin gathers (per layer / per step) | ATen ops | "
        "MiB written |"
    )
    print("|---|---|---|---|---|")
    with set_current_vllm_config(config):
        for shape in SHAPES:
            for tokens in args.tokens:
                r = measure(shape, tokens)
                b, s = r["bare"], r["step"]
                print(
                    f"| {shape.name} ({shape.layers} layers) | {tokens} | "
                    f"{b[0]} / {s[0]} | {b[1]} / {s[1]} | "
                    f"{b[2] / 2**20:.1f} / {s[2] / 2**20:.1f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
