"""Tiny FP8 checkpoints, quantized offline from a tiny model's float32 weights.

``write_fp8_checkpoint`` copies a model directory and replaces the language
model's projection weights (``q/k/v/o_proj``, ``gate/up/down_proj``) by
``float8_e4m3fn`` weights and float32 scales, in the layout of the format:

- ``fp8`` (vLLM's ``Fp8Config``, as FP8 exporters and the published Qwen FP8
  checkpoints write it): ``weight`` + ``weight_scale`` (per tensor, ``[]``) or,
  with ``weight_block_size``, ``weight_scale_inv`` (``[ceil(N/bn), ceil(K/bk)]``);
  a static activation scheme adds ``input_scale`` (``[]``);
- ``compressed-tensors`` (``format: float-quantized``): ``weight`` +
  ``weight_scale`` (``[1]`` per tensor, ``[N, 1]`` per channel) and, for static
  activations, ``input_scale`` (``[1]``); the vision tower and projector are
  listed in ``ignore``.

``dequantized`` is the oracle's checkpoint: the same model with every quantized
weight replaced by ``weight.float() * scale`` in float32, which HF transformers
loads as an ordinary model.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
PROJ = re.compile(
    r"^(?!.*vision_tower)(?!.*multi_modal_projector)"
    r".*\.(q|k|v|o|gate|up|down)_proj\.weight$"
)
# A static activation scale as a calibration would give for activations up to
# about |x| = 4 (only Gaudi's fp8_gemm_v2 path uses it).
STATIC_INPUT_SCALE = 4.0 / FP8_MAX


@dataclass(frozen=True)
class Fp8Format:
    method: str  # "fp8" | "compressed-tensors"
    strategy: str  # "tensor" | "channel" | "block"
    static_input: bool = False
    block: tuple[int, int] | None = None  # (bn, bk) for "block"

    @property
    def name(self) -> str:
        act = "static" if self.static_input else "dynamic"
        return f"{self.method}-{self.strategy}-{act}"


def _amax_scale(w: torch.Tensor) -> torch.Tensor:
    return (w.abs().amax().clamp(min=1e-12) / FP8_MAX).float()


def quantize(
    w: torch.Tensor, fmt: Fp8Format
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale in the checkpoint's layout, dequantized float32)."""
    n, k = w.shape
    if fmt.strategy == "tensor":
        scale = _amax_scale(w)
        full = scale.reshape(1, 1)
    elif fmt.strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX).float()
        full = scale  # [N, 1]
    else:
        assert fmt.block is not None
        bn, bk = fmt.block
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.empty(rows, cols)
        for i in range(rows):
            for j in range(cols):
                scale[i, j] = _amax_scale(
                    w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
                )
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if fmt.method == "compressed-tensors" and fmt.strategy == "tensor":
        scale = scale.reshape(1)
    return q, scale, q.float() * full


def _quant_config(fmt: Fp8Format) -> dict[str, object]:
    if fmt.method == "fp8":
        config: dict[str, object] = {
            "quant_method": "fp8",
            "activation_scheme": "static" if fmt.static_input else "dynamic",
        }
        if fmt.block is not None:
            config["weight_block_size"] = list(fmt.block)
        return config
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": fmt.strategy,
    }
    if fmt.block is not None:
        weights["block_structure"] = list(fmt.block)
    acts = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": not fmt.static_input,
        "strategy": "tensor" if fmt.static_input else "token",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
            }
        },
        "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
    }


def write_fp8_checkpoint(src: str, dst: Path, fmt: Fp8Format) -> tuple[str, str]:
    """(the FP8 checkpoint, its dequantized float32 twin) under ``dst``."""
    quantized, dequantized = dst / fmt.name, dst / f"{fmt.name}-dequantized"
    for out in (quantized, dequantized):
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = load_file(str(Path(src) / "model.safetensors"))
    q_tensors: dict[str, torch.Tensor] = {}
    d_tensors: dict[str, torch.Tensor] = {}
    scale_key = (
        "weight_scale_inv" if fmt.method == "fp8" and fmt.block else "weight_scale"
    )
    for key, w in tensors.items():
        if not PROJ.match(key):
            q_tensors[key] = d_tensors[key] = w
            continue
        q, scale, deq = quantize(w.float(), fmt)
        base = key[: -len("weight")]
        q_tensors[key] = q
        q_tensors[base + scale_key] = scale
        if fmt.static_input:
            shape = () if fmt.method == "fp8" else (1,)
            q_tensors[base + "input_scale"] = torch.full(shape, STATIC_INPUT_SCALE)
        d_tensors[key] = deq.to(w.dtype)
    save_file(q_tensors, str(quantized / "model.safetensors"), {"format": "pt"})
    save_file(d_tensors, str(dequantized / "model.safetensors"), {"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = _quant_config(fmt)
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return str(quantized), str(dequantized)
