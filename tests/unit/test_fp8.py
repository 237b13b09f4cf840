"""FP8 linear layers without an engine: the dequantizing matmul
(``hpu_kernels.fp8``) and the simulated ``torch.ops.hpu.fp8_gemm_v2`` against
float64, the weights' scales after loading, the Gaudi path of a layer through
the simulated ops, what is refused, and the start-up log's weight memory.

References are float64 products of the same FP8 values and scales: the float32
results must agree to float32 rounding (``rtol=1e-5``), bfloat16 outputs to one
bfloat16 rounding of the result (``rtol=2**-8``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from hpu_kernels import fp8
from vllm_hpu_mm import device
from vllm_hpu_mm.gaudi_sim import fp8_ops
from vllm_hpu_mm.quant import fp8_linear
from vllm_hpu_mm.quant.fp8_linear import Fp8Scheme
from vllm_hpu_mm.quant.memory import weight_memory_line

N, K = 40, 70  # not multiples of the blocks below: partial edge blocks


def _weight(seed: int, n: int = N, k: int = K) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 0.3).to(fp8.FP8_DTYPE)


def _x(seed: int, t: int = 5, k: int = K) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed))


def _block_reference(w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int):
    out = w.double().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= float(scale[i, j])
    return out


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_dequantizing_matmul_matches_float64(kind: str) -> None:
    w, x = _weight(0), _x(1)
    gen = torch.Generator().manual_seed(2)
    block = (16, 32) if kind == "block" else None
    if kind == "tensor":
        scale = torch.tensor(0.013)
        ref_w = w.double() * 0.013
    elif kind == "channel":
        scale = torch.rand(N, 1, generator=gen) * 0.02 + 0.001
        ref_w = w.double() * scale.double()
    else:
        scale = (
            torch.rand(3, 3, generator=gen) * 0.02 + 0.001
        )  # ceil(40/16), ceil(70/32)
        ref_w = _block_reference(w, scale, 16, 32)
    bias = torch.randn(N, generator=gen)
    got = fp8.linear_dequantized(x, w, scale, block, bias)
    want = x.double() @ ref_w.t() + bias.double()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert w.dtype == fp8.FP8_DTYPE  # the weight itself is untouched


def test_block_scale_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"expected \[ceil\(40/16\), ceil\(70/32\)\]"):
        fp8.dequantize(_weight(0), torch.ones(2, 3), (16, 32), torch.float32)
    with pytest.raises(ValueError, match="one per output row"):
        fp8.dequantize(_weight(0), torch.ones(7), None, torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_sim_fp8_gemm_v2_matches_float64(out_dtype: torch.dtype) -> None:
    w, x = _weight(3), _x(4)
    w_scale = torch.rand(N, 1, generator=torch.Generator().manual_seed(5)) * 0.02
    x_fp8, x_scale = fp8.quantize_per_token(x)  # [T, K], [T, 1]
    bias = torch.randn(N)
    got = fp8_ops.fp8_gemm_v2(
        A=x_fp8,
        trans_A=False,
        B=w,
        trans_B=True,
        D=None,
        out_dtype=out_dtype,
        A_scale_inv=x_scale,
        B_scale_inv=w_scale,
        bias=bias,
        accumulate=False,
    )
    want = (x_fp8.double() * x_scale.double()) @ (
        w.double() * w_scale.double()
    ).t() + bias.double()
    assert got.dtype == out_dtype
    rtol = 1e-5 if out_dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5)
    # B given as [K, N] without the transpose: the same product
    again = fp8_ops.fp8_gemm_v2(
        x_fp8, False, w.t().contiguous(), False, None, out_dtype, x_scale, w_scale, bias
    )
    torch.testing.assert_close(again, got)


def test_per_token_quantization_error_is_within_half_an_e4m3_step() -> None:
    x = _x(6, t=9)
    x_fp8, scale = fp8.quantize_per_token(x)
    back = x_fp8.double() * scale.double()
    # e4m3 keeps 3 mantissa bits: round-to-nearest errs by at most 2**-4 of
    # the value for normal numbers, and by half the smallest subnormal step
    # (2**-10 of the row's scale) below them.
    bound = x.double().abs() * 2**-4 + scale.double() * 2**-10
    assert bool(((back - x.double()).abs() <= bound + 1e-12).all())


def test_sim_fp8_gemm_v2_refuses_what_the_real_op_refuses() -> None:
    a = _weight(7, 4, K)
    b = _weight(8)
    with pytest.raises(TypeError, match=r"torch\.float or torch\.bfloat16"):
        fp8_ops.fp8_gemm_v2(a, False, b, True, None, torch.float16)
    with pytest.raises(RuntimeError, match="2-D FP8 tensor"):
        fp8_ops.fp8_gemm_v2(a.float(), False, b, True, None, torch.float32)
    with pytest.raises(RuntimeError, match="B_scale_inv of shape"):
        fp8_ops.fp8_gemm_v2(
            a, False, b, True, None, torch.float32, None, torch.ones(3, 3)
        )
    with pytest.raises(RuntimeError, match="inner dimensions"):
        fp8_ops.fp8_gemm_v2(a, False, b, False, None, torch.float32)


def test_sim_ops_register_as_torch_ops_hpu() -> None:
    fp8_ops.register()
    x = _x(9)
    scale = torch.tensor(0.01)
    out, _ = torch.ops.hpu.cast_to_fp8_v2(x, 1.0 / scale, False, False, fp8.FP8_DTYPE)
    torch.testing.assert_close(out.float(), fp8.quantize_static(x, scale).float())


@pytest.fixture(autouse=True)
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's weight parameters ask for their tensor-parallel rank when made:
    one rank of one, without starting a process group."""
    import vllm.model_executor.parameter as parameter

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)


def _loaded_layer(scheme: Fp8Scheme, widths: list[int]) -> Any:
    """A layer with the parameters ``fp8_linear.create_weights`` makes, filled
    as a checkpoint would fill them."""
    layer = torch.nn.Module()
    fp8_linear.create_weights(scheme, layer, K, widths, K, sum(widths), None)
    layer.weight.data.copy_(_weight(10, sum(widths)))
    getattr(layer, scheme.scale_name).data.copy_(
        torch.tensor([0.01 * (i + 1) for i in range(len(widths))])
    )
    if scheme.static_input:
        layer.input_scale.data.copy_(torch.tensor([0.02, 0.03, 0.025])[: len(widths)])
    return layer


def test_per_shard_scales_become_exact_per_row_scales() -> None:
    scheme = Fp8Scheme("tensor", None, static_input=True, quantize_input=True)
    widths = [16, 8, 16]  # a fused QKV layer: three shards, a scale each
    layer = _loaded_layer(scheme, widths)
    fp8_weight = layer.weight.data.clone()
    fp8_linear.process_weights(scheme, layer)
    assert layer.weight.dtype == fp8.FP8_DTYPE
    assert torch.equal(layer.weight.view(torch.uint8), fp8_weight.view(torch.uint8))
    want = torch.tensor([0.01] * 16 + [0.02] * 8 + [0.03] * 16).reshape(-1, 1)
    torch.testing.assert_close(layer.weight_scale.data, want)
    assert float(layer.input_scale) == pytest.approx(0.03)  # the largest


@pytest.mark.parametrize("static_input", [False, True])
def test_gaudi_path_quantizes_activations_and_calls_fp8_gemm_v2(
    static_input: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheme = Fp8Scheme("tensor", None, static_input, quantize_input=True)
    layer = _loaded_layer(scheme, [16, 8, 16])
    calls: list[dict[str, object]] = []

    def gemm(**kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return fp8_ops.fp8_gemm_v2(**kwargs)  # type: ignore[arg-type]

    sim = device.Fp8Ops(cast=fp8_ops.cast_to_fp8_v2, gemm=gemm)
    monkeypatch.setattr(fp8_linear.device, "fp8_ops", lambda: sim)
    fp8_linear.process_weights(scheme, layer)
    x = _x(11, t=6).reshape(2, 3, K) * 0.5
    got = fp8_linear.apply(scheme, layer, x, None)
    assert got.shape == (2, 3, 40) and len(calls) == 1
    assert calls[0]["trans_B"] is True and calls[0]["B"] is layer.weight
    x2 = x.reshape(6, K)
    if static_input:
        x_scale = layer.input_scale.reshape(1, 1)
        x_fp8 = fp8.quantize_static(x2, x_scale)
    else:
        x_fp8, x_scale = fp8.quantize_per_token(x2)
    w = layer.weight.double() * layer.weight_scale.double()
    want = (x_fp8.double() * x_scale.double()) @ w.t()
    torch.testing.assert_close(got.reshape(6, -1).double(), want, rtol=1e-5, atol=1e-6)
    # and the quantized product stays near the unquantized one: each activation
    # errs by at most 2**-4 of itself (plus the subnormal floor)
    exact = x2.double() @ w.t()
    bound = (x2.double().abs() * 2**-4 + x_scale.double() * 2**-10) @ w.abs().t()
    assert bool(((got.reshape(6, -1).double() - exact).abs() <= bound + 1e-9).all())


def test_off_gaudi_and_block_scales_dequantize(monkeypatch: pytest.MonkeyPatch) -> None:
    scheme = Fp8Scheme("tensor", None, static_input=False, quantize_input=True)
    layer = _loaded_layer(scheme, [40])
    monkeypatch.setattr(fp8_linear.device, "fp8_ops", lambda: None)
    fp8_linear.process_weights(scheme, layer)
    x = _x(12)
    want = x.double() @ (layer.weight.double() * 0.01).t()
    got = fp8_linear.apply(scheme, layer, x, None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_compressed_tensors_schemes_other_than_fp8_are_refused() -> None:
    from vllm_hpu_mm.quant.methods import HpuMMCompressedTensorsConfig

    config = HpuMMCompressedTensorsConfig.from_config(
        {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {},
            "ignore": [],
        }
    )
    int8 = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    act = QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
    )
    with pytest.raises(NotImplementedError, match=r"FP8 weights only.*'model\.x'"):
        config._get_scheme_from_parts(int8, act, layer_name="model.x")
    fp8w = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy="channel"
    )
    fp8a = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True
    )
    scheme = config._get_scheme_from_parts(fp8w, fp8a, layer_name="model.y")
    assert scheme.scheme == Fp8Scheme("channel", None, False, True)  # type: ignore[attr-defined]


def test_weight_memory_line_counts_fp8_bytes() -> None:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1024, 1024, dtype=fp8.FP8_DTYPE), False)
    model.norm = torch.nn.Parameter(torch.zeros(1024 * 256), False)  # 1 MiB float32
    line = weight_memory_line(model, torch.bfloat16)
    assert line == (
        "Model weights: 2.00 MiB (float32 1.00 MiB, float8_e4m3fn 1.00 MiB); "
        "3.00 MiB unquantized in bfloat16"
    )
