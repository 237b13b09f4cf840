"""Adapters from the plugin's kernel calls to Gaudi's fused kernels.

Each adapter takes the fused kernel as an argument (``vllm_hpu_mm.device``
imports it on HPU and hands it over), so this module is device-free and its
arithmetic is tested on the CPU against the pure-PyTorch ops through fakes with
the real signatures.

- ``sdpa_native`` / ``fused_sdpa(FusedSDPA)``: one attention call,
  ``sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa)``, on
  ``q [B, Hq, S, D]`` and ``k``/``v`` ``[B, Hkv, K, D]`` -> ``[B, Hq, S, D]``.
- ``fused_rms_norm(FusedRMSNorm, ...)``: vLLM's RMSNorm (with the fused
  residual add) through ``FusedRMSNorm.apply(x, weight, eps)``.
- ``fused_rope(RopeKernel, ...)``: vLLM's rotary embedding (neox and GPT-J
  styles, partial rotary dims) through ``apply_rotary_pos_emb``; split in two,
  ``rope_cos_sin`` (the gather from the cos/sin cache, M-RoPE's sections
  included, done once per step) and ``rotate_fused`` (the kernel, per layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa) -> out [B, Hq, S, D]
SdpaFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        bool,
        float | None,
        bool,
    ],
    torch.Tensor,
]

# FusedSDPA arguments as the official Gaudi plugin passes them for prefill:
# "fast" softmax (bf16 accumulate) unless the model needs float32, recompute on,
# no valid-length shortcut, right padding.
FSDPA_SOFTMAX_MODE = "fast"
FSDPA_RECOMPUTE = True
FSDPA_PADDING_SIDE = "right"
# hpu_mm.fused.softmax_mode -> FusedSDPA's softmax_mode argument.
SOFTMAX_MODES = {"fast": "fast", "fp32": "fp32", "exact": "None"}
# The official plugin's per-model choices (vllm-gaudi extension/features.py):
# float32 softmax for these, no FusedSDPA for Mllama.
FP32_SOFTMAX_MODELS = frozenset({"qwen2", "qwen2_5_vl"})
NATIVE_SDPA_MODELS = frozenset({"mllama"})


def fused_softmax_mode(setting: str, model_type: str | None) -> str | None:
    """FusedSDPA's ``softmax_mode`` for ``hpu_mm.fused.softmax_mode`` =
    ``setting`` and the model's ``model_type``; None: PyTorch's SDPA instead of
    FusedSDPA (``auto`` for Mllama)."""
    if setting != "auto":
        return SOFTMAX_MODES[setting]
    if model_type in NATIVE_SDPA_MODELS:
        return None
    return "fp32" if model_type in FP32_SOFTMAX_MODELS else FSDPA_SOFTMAX_MODE


def sdpa_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """PyTorch's SDPA (boolean mask: True = attend; or an additive float mask)."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive bias FusedSDPA takes: 0
    where attended, the dtype's lowest finite value elsewhere (finite, so a
    padding row that sees nothing stays finite instead of NaN)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill(~mask, torch.finfo(dtype).min)


def fused_sdpa(kernel: Any, softmax_mode: str = FSDPA_SOFTMAX_MODE) -> SdpaFn:
    """``sdpa`` through Habana's ``FusedSDPA`` (``kernel``), called as
    ``kernel.apply(q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode,
    recompute_mode, valid_sequence_lengths, padding_side)``.

    The contract is ``sdpa_native``'s: a mask and ``is_causal`` together, or
    fewer query than key heads without ``enable_gqa``, are errors; FusedSDPA
    reads grouped K/V heads natively (no repeat).
    """

    def sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor:
        if attn_mask is not None and is_causal:
            raise ValueError("sdpa: pass either attn_mask or is_causal, not both")
        if q.shape[1] != k.shape[1] and not enable_gqa:
            raise ValueError(
                f"sdpa: {q.shape[1]} query heads but {k.shape[1]} key heads "
                "needs enable_gqa=True"
            )
        bias = None if attn_mask is None else additive_mask(attn_mask, q.dtype)
        return kernel.apply(
            q,
            k,
            v,
            bias,
            0.0,  # dropout_p
            is_causal,
            scale,
            softmax_mode,
            FSDPA_RECOMPUTE,
            None,  # valid_sequence_lengths
            FSDPA_PADDING_SIDE,
        )

    return sdpa


def fused_rms_norm(
    kernel: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``RMSNorm.forward`` through ``FusedRMSNorm.apply(x, weight, eps)``.

    ``x [..., H]``; with ``residual`` (same shape) returns
    ``(norm(x + residual), x + residual)``, as vLLM's fused add does. The kernel
    takes 3-D input, so the rows are viewed as ``[1, T, H]``.
    """
    if residual is not None:
        residual = x + residual
        x = residual
    shape = x.shape
    out = kernel.apply(x.reshape(1, -1, shape[-1]), weight, eps).reshape(shape)
    return out if residual is None else (out, residual)


@dataclass(frozen=True, slots=True)
class RopeKernel:
    """Habana's fused rotary embedding: ``apply(x, cos, sin, position_ids,
    offset, mode)`` and its two modes (blockwise = neox halves, pairwise =
    GPT-J interleaved pairs)."""

    apply: Callable[..., torch.Tensor]
    blockwise: Any
    pairwise: Any


def mrope_channel_rows(
    mrope_section: list[int], interleaved: bool, half: int
) -> list[int]:
    """Which position row (0 = T, 1 = H, 2 = W) each of the ``half`` =
    ``rotary_dim / 2`` frequency channels of M-RoPE reads, as vLLM's
    ``MRotaryEmbedding.forward_native`` picks them: consecutive sections
    (Qwen2-VL, Qwen2.5-VL: ``[t, h, w]`` channels in turn) or interleaved
    (Qwen3-VL: ``T H W T H W ...``, H and W while their sections last, T for
    the rest)."""
    if sum(mrope_section) != half:
        raise ValueError(
            f"M-RoPE sections {mrope_section} sum to {sum(mrope_section)}, "
            f"but rotary_dim / 2 = {half}"
        )
    if not interleaved:
        return [row for row, n in enumerate(mrope_section) for _ in range(n)]
    rows = []
    for c in range(half):
        if c % 3 == 1 and c < 3 * mrope_section[1]:
            rows.append(1)
        elif c % 3 == 2 and c < 3 * mrope_section[2]:
            rows.append(2)
        else:
            rows.append(0)
    return rows


def rope_cos_sin(
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
    mrope_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos and sin, widened to the rotary dim as the fused kernel
    needs: ``[T, 1, rotary_dim]`` each (``cos_sin_cache [P, rotary_dim]`` holds
    cos then sin, ``rotary_dim / 2`` each).

    ``positions [T]``; or (M-RoPE) ``[3, T]`` with ``mrope_rows [rotary_dim / 2]``
    (``mrope_channel_rows``): channel ``c`` of a token takes its angle from
    position row ``mrope_rows[c]``. One gather from the cache either way; the
    scaled variants (Llama 3, linear, NTK, YaRN) differ only in the cache.
    """
    tokens = positions.shape[-1]
    cos_sin = cos_sin_cache.index_select(0, positions.flatten())
    if positions.dim() == 2:
        if mrope_rows is None:
            raise ValueError("M-RoPE positions [3, T] need the channel rows")
        half = cos_sin.shape[-1] // 2
        rows = positions.shape[0]
        cos_sin = cos_sin.view(rows, tokens, -1)  # [3, T, rotary_dim]
        pick = torch.cat((mrope_rows, mrope_rows))  # cos and sin channels alike
        pick = pick.view(1, 1, 2 * half).expand(1, tokens, 2 * half)
        cos_sin = cos_sin.gather(0, pick)[0]  # [T, rotary_dim]
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, rotary_dim / 2]
    if is_neox_style:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    else:
        cos = torch.repeat_interleave(cos, 2, dim=-1)
        sin = torch.repeat_interleave(sin, 2, dim=-1)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def fused_rope(
    kernel: RopeKernel,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    rotary_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's ``RotaryEmbedding.forward_static`` through the fused kernel."""
    cos, sin = rope_cos_sin(positions, cos_sin_cache, is_neox_style)
    return rotate_fused(
        kernel, cos, sin, query, key, head_size, rotary_dim, is_neox_style
    )


def rotate_fused(
    kernel: RopeKernel,
    cos: torch.Tensor,
    sin: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rotation with precomputed ``cos``/``sin [T, 1, rotary_dim]``
    (``rope_cos_sin``): ``query [T, Hq * head_size]``, ``key
    [T, Hkv * head_size]`` (or None); the first ``rotary_dim`` channels of
    each head rotate."""
    mode = kernel.blockwise if is_neox_style else kernel.pairwise
    tokens = cos.shape[0]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.view(tokens, -1, head_size)  # [T, H, head_size]
        if rotary_dim == head_size:
            return kernel.apply(heads, cos, sin, None, 0, mode).reshape(x.shape)
        rot = kernel.apply(heads[..., :rotary_dim], cos, sin, None, 0, mode)
        return torch.cat((rot, heads[..., rotary_dim:]), dim=-1).reshape(x.shape)

    return rotate(query), None if key is None else rotate(key)
