"""The simulated Habana FP8 ops, ``torch.ops.hpu.cast_to_fp8_v2``,
``torch.ops.hpu.cast_from_fp8`` and ``torch.ops.hpu.fp8_gemm_v2``, with the
bridge's schema and the official plugin's conventions (vllm-gaudi
``extension/ops.py``: ``dynamic_quant`` and ``apply_fp8_linear_hpu``;
``extension/utils.py`` ``VLLMFP8KVCache``: ``cast_to_fp8_v2(x, 1 / scale, ...)``
on the KV write, ``cast_from_fp8(x, scale, dtype)`` on the read)::

    cast_to_fp8_v2(Tensor input, Tensor? scale=None, bool stochastic_rounding=False,
                   bool is_amax=False, ScalarType dtype=float8_e4m3fn,
                   int[]? scale_shape=None) -> (Tensor, Tensor)
    cast_from_fp8(Tensor input, Tensor? scale, ScalarType out_dtype,
                  int[]? scale_shape=None) -> Tensor
    fp8_gemm_v2(Tensor A, bool trans_A, Tensor B, bool trans_B, Tensor? D,
                ScalarType out_dtype, Tensor? A_scale_inv=None,
                Tensor? B_scale_inv=None, Tensor? bias=None,
                bool accumulate=False, int[]? B_scale_shape=None) -> Tensor

``cast_from_fp8`` multiplies the FP8 input by ``scale`` in float32 and returns
``out_dtype`` (the bridge's meta function: same shape, ``out_dtype``); an input
that is not FP8 is refused. ``cast_to_fp8_v2`` multiplies by ``scale`` (the
official plugin passes ``1.0 / input_scale``) and rounds to nearest;
``fp8_gemm_v2`` multiplies ``op(A) * A_scale_inv`` by ``op(B) * B_scale_inv``
with float32 accumulation and returns ``out_dtype``. ``A_scale_inv`` is one
scale or one per row of ``A`` (``[M, 1]``: "A_scale_inv MUST be passed as
[T,1]", vllm-gaudi's FP8 MoE notes); ``B_scale_inv`` one scale or one per
output column (per-channel).

Refused as the real ones refuse: ``out_dtype`` other than float32 or bfloat16
(Habana's transformer-engine wrapper ``fp8_gemm_v2``: "Output tensor must have
torch.float or torch.bfloat16 dtype"); operands that are not FP8 (the GEMM's
inputs are ``cast_to_fp8_v2`` outputs); scale shapes other than those above.
Stochastic rounding is not simulated (refused).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GEMM_OUT_DTYPES = (torch.float32, torch.bfloat16)


class Counts:
    """Calls of ``fp8_gemm_v2`` in this process (tests read it; the op's body
    runs eagerly, also when a compiled graph calls the op)."""

    gemm = 0


def cast_to_fp8_v2(
    input: torch.Tensor,
    scale: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    is_amax: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
    scale_shape: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype not in FP8_DTYPES:
        raise RuntimeError(f"cast_to_fp8_v2: dtype {dtype} is not an FP8 type")
    if stochastic_rounding:
        raise NotImplementedError("cast_to_fp8_v2: stochastic rounding not simulated")
    x = input.float()
    if scale is not None:
        x = x * scale.float()
    top = float(torch.finfo(dtype).max)
    out = x.clamp(-top, top).to(dtype)
    amax = input.abs().amax().float() if is_amax else input.new_empty(0).float()
    return out, amax


def cast_from_fp8(
    input: torch.Tensor,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    scale_shape: list[int] | None = None,
) -> torch.Tensor:
    if input.dtype not in FP8_DTYPES:
        raise RuntimeError(f"cast_from_fp8: input must be FP8, got {input.dtype}")
    x = input.float()
    if scale is not None:
        x = x * scale.float()
    return x.to(out_dtype)


def _scale(
    scale: torch.Tensor | None, rows: int, what: str, along: str
) -> torch.Tensor:
    """The scale as a column ``[rows, 1]`` or a scalar ``[1, 1]``."""
    if scale is None:
        return torch.ones(1, 1)
    if scale.numel() == 1:
        return scale.float().reshape(1, 1)
    if scale.numel() == rows and scale.dim() <= 2:
        return scale.float().reshape(rows, 1)
    raise RuntimeError(
        f"fp8_gemm_v2: {what} of shape {tuple(scale.shape)} is neither one scale "
        f"nor one per {along} ({rows})"
    )


def fp8_gemm_v2(
    A: torch.Tensor,
    trans_A: bool,
    B: torch.Tensor,
    trans_B: bool,
    D: torch.Tensor | None,
    out_dtype: torch.dtype,
    A_scale_inv: torch.Tensor | None = None,
    B_scale_inv: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    accumulate: bool = False,
    B_scale_shape: list[int] | None = None,
) -> torch.Tensor:
    Counts.gemm += 1
    if out_dtype not in GEMM_OUT_DTYPES:
        raise TypeError(
            "fp8_gemm_v2: Output tensor must have torch.float or torch.bfloat16 "
            f"dtype, got {out_dtype}"
        )
    for name, t in (("A", A), ("B", B)):
        if t.dtype not in FP8_DTYPES or t.dim() != 2:
            raise RuntimeError(
                f"fp8_gemm_v2: {name} must be a 2-D FP8 tensor, got "
                f"{t.dtype} of shape {tuple(t.shape)}"
            )
    if accumulate and D is None:
        raise RuntimeError("fp8_gemm_v2: accumulate needs D")
    a = (A.t() if trans_A else A).float()  # [M, K]
    b = (B if trans_B else B.t()).float()  # [N, K]
    if a.shape[1] != b.shape[1]:
        raise RuntimeError(
            f"fp8_gemm_v2: inner dimensions differ: {tuple(a.shape)} x "
            f"{tuple(b.shape)}{'^T' if trans_B else ''}"
        )
    a = a * _scale(A_scale_inv, a.shape[0], "A_scale_inv", "row of A")
    b = b * _scale(B_scale_inv, b.shape[0], "B_scale_inv", "output column")
    out = a @ b.t()  # [M, N], float32 accumulation
    if bias is not None:
        out = out + bias.float()
    if accumulate and D is not None:
        out = out + D.float()
    return out.to(out_dtype)


_REGISTERED = False


def register() -> None:
    """Register both as ``torch.ops.hpu.*`` (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    cast = torch.library.custom_op("hpu::cast_to_fp8_v2", mutates_args=())(
        cast_to_fp8_v2
    )
    uncast = torch.library.custom_op("hpu::cast_from_fp8", mutates_args=())(
        cast_from_fp8
    )
    gemm = torch.library.custom_op("hpu::fp8_gemm_v2", mutates_args=())(fp8_gemm_v2)

    @uncast.register_fake  # type: ignore[misc]
    def _(input, scale, out_dtype, scale_shape=None):  # fmt: skip
        return torch.empty_like(input, dtype=out_dtype)

    @cast.register_fake  # type: ignore[misc]
    def _(input, scale=None, stochastic_rounding=False, is_amax=False,
          dtype=torch.float8_e4m3fn, scale_shape=None):  # fmt: skip
        amax = input.new_empty(() if is_amax else (0,), dtype=torch.float32)
        return torch.empty_like(input, dtype=dtype), amax

    @gemm.register_fake  # type: ignore[misc]
    def _(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv=None, B_scale_inv=None,
          bias=None, accumulate=False, B_scale_shape=None):  # fmt: skip
        m = A.shape[1] if trans_A else A.shape[0]
        n = B.shape[0] if trans_B else B.shape[1]
        return A.new_empty((m, n), dtype=out_dtype)

    _REGISTERED = True
