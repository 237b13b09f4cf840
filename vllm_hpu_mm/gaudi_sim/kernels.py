"""The simulated Habana fused kernels (``habana_frameworks.torch.hpex``).

Real signatures and restrictions, reference maths on the host:

- ``FusedSDPA.apply(q, k, v, attn_mask, dropout_p, is_causal, scale,
  softmax_mode, recompute_mode, valid_sequence_lengths, padding_side)``, layout
  ``[B, H, S, D]``, as vllm-gaudi calls it (``extension/ops.py``,
  ``extension/utils.py`` ``ModuleFusedSDPA``): a mask together with
  ``is_causal`` "is not yet supported"; GQA K/V heads are passed unrepeated.
  ``softmax_mode``: ``"None"`` (the default) is the exact softmax, computed here
  in float32; ``"fp32"`` is the float32 softmax vllm-gaudi picks for qwen2 and
  qwen2_5_vl (``extension/features.py``); ``"fast"`` is Habana's reduced
  precision softmax ("fast softmax ... with bf16 accumulation", Habana's
  optimisation guide, *Using Fused Scaled Dot Product Attention*): here the
  scores are rounded to bfloat16 and the exponentials summed in bfloat16, so
  its accuracy cost is visible next to the exact mode.
- ``FusedRMSNorm.apply(x, weight, eps)`` (vllm-gaudi ``ops/hpu_layernorm.py``:
  "requires 3D tensors as inputs").
- ``apply_rotary_pos_emb(x, cos, sin, position_ids, offset, mode)`` with
  ``RotaryPosEmbeddingMode.BLOCKWISE`` / ``PAIRWISE`` (vllm-gaudi
  ``ops/hpu_rotary_embedding.py``: cos and sin as wide as the rotated channels,
  ``position_ids=None``).
"""

from __future__ import annotations

import enum

import torch

SOFTMAX_MODES = ("None", "fast", "fp32")


class RotaryPosEmbeddingMode(enum.Enum):
    BLOCKWISE = "blockwise"  # neox: rotate the two halves
    PAIRWISE = "pairwise"  # GPT-J: rotate interleaved pairs


def _fast_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with bfloat16 scores and bfloat16 accumulation
    (the row max is exact; ``exp`` and its running sum are bfloat16)."""
    s = scores.to(torch.bfloat16)
    e = (s - s.amax(-1, keepdim=True)).exp()
    total = torch.zeros_like(e[..., :1])
    for chunk in e.split(64, dim=-1):  # a bf16 running sum, block by block
        total = total + chunk.sum(-1, keepdim=True, dtype=torch.bfloat16)
    return (e / total).float()


class FusedSDPA:
    """``habana_frameworks.torch.hpex.kernels.FusedSDPA``; ``calls`` counts the
    eager calls of the process (tests read it; a count traced into a compiled
    graph would become a guard, recompiling on every call)."""

    calls = 0

    @staticmethod
    def apply(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        softmax_mode: str = "None",
        recompute_mode: bool | None = None,
        valid_sequence_lengths: torch.Tensor | None = None,
        padding_side: str = "left",
    ) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # a traced counter is a guard
            FusedSDPA.calls += 1
        if is_causal and attn_mask is not None:
            raise RuntimeError("FusedSDPA: is_causal with attn_mask is not supported")
        if softmax_mode not in SOFTMAX_MODES:
            raise ValueError(f"FusedSDPA: unknown softmax_mode {softmax_mode!r}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"FusedSDPA: unknown padding_side {padding_side!r}")
        hq, hkv = query.shape[1], key.shape[1]
        if hq % hkv:
            raise RuntimeError(f"FusedSDPA: {hq} query heads over {hkv} KV heads")
        k = key.repeat_interleave(hq // hkv, dim=1).float()
        v = value.repeat_interleave(hq // hkv, dim=1).float()
        scores = query.float() @ k.transpose(-2, -1)
        scores = scores * (scale if scale is not None else query.shape[-1] ** -0.5)
        if attn_mask is not None:
            scores = scores + attn_mask.float()
        if is_causal:
            s, kl = scores.shape[-2:]
            keep = torch.ones(s, kl, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = _fast_softmax(scores) if softmax_mode == "fast" else scores.softmax(-1)
        return (probs @ v).to(query.dtype)


class FusedRMSNorm:
    """``habana_frameworks.torch.hpex.normalization.FusedRMSNorm``."""

    calls = 0

    @staticmethod
    def apply(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            FusedRMSNorm.calls += 1
        if x.dim() != 3:
            raise RuntimeError(f"FusedRMSNorm needs a 3-D input, got {tuple(x.shape)}")
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.float()).to(x.dtype)


def apply_rotary_pos_emb(
    p: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    offset: int = 0,
    mode: RotaryPosEmbeddingMode = RotaryPosEmbeddingMode.BLOCKWISE,
) -> torch.Tensor:
    """``habana_frameworks.torch.hpex.kernels.apply_rotary_pos_emb``."""
    if position_ids is not None:
        raise RuntimeError("apply_rotary_pos_emb: position_ids must be None here")
    if cos.shape[-1] != p.shape[-1] or sin.shape[-1] != p.shape[-1]:
        raise RuntimeError(
            f"apply_rotary_pos_emb: cos/sin width {cos.shape[-1]} != input "
            f"width {p.shape[-1]}"
        )
    if mode is RotaryPosEmbeddingMode.BLOCKWISE:
        x1, x2 = p.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif mode is RotaryPosEmbeddingMode.PAIRWISE:
        x1, x2 = p[..., 0::2], p[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        raise ValueError(f"apply_rotary_pos_emb: unknown mode {mode!r}")
    return p * cos + rotated * sin
