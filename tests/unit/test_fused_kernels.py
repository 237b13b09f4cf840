"""Gaudi's fused kernels behind ``vllm_hpu_mm.device``, checked on the CPU.

Each adapter of ``hpu_kernels.fused`` runs against the fake kernels of
``tests.fakes.habana`` (the real signatures and restrictions, float32 reference
maths) and must match the pure-PyTorch op it replaces: PyTorch's SDPA, and
vLLM's own ``RMSNorm`` / ``RotaryEmbedding`` ``forward_native``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import CompilationConfig
from vllm.model_executor import custom_op
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.llama3_rope import (
    Llama3RotaryEmbedding,
)

from hpu_kernels.fused import (
    additive_mask,
    fused_rms_norm,
    fused_rope,
    fused_sdpa,
    sdpa_native,
)
from tests.fakes.habana import (
    FakeFusedRMSNorm,
    FakeFusedSDPA,
    FakeHabana,
    RotaryPosEmbeddingMode,
    cpu_only_host,
    fake_apply_rotary_pos_emb,
)
from vllm_hpu_mm import device
from vllm_hpu_mm.fused_ops import (
    FUSED_OP_NAMES,
    FusedGemmaRMSNorm,
    FusedLlama3RotaryEmbedding,
    FusedRMSNorm,
    FusedRotaryEmbedding,
    register_fused_ops,
)
from vllm_hpu_mm.platform_config import _enable_fused_ops

# FusedSDPA's exact softmax mode (its default): compared with torch's SDPA exactly.
EXACT = "None"


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with cpu_only_host(monkeypatch):
        yield


@pytest.fixture
def vllm_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """vLLM's op registry, restored afterwards, and the compilation config its
    CustomOps read, with the fused ops enabled as the HPU platform does."""
    saved = dict(custom_op.op_registry_oot)
    config = SimpleNamespace(compilation_config=CompilationConfig(custom_ops=["none"]))
    _enable_fused_ops(config, "hpu")  # type: ignore[arg-type]
    compilation = config.compilation_config
    monkeypatch.setattr(custom_op, "get_cached_compilation_config", lambda: compilation)
    yield compilation.custom_ops
    custom_op.op_registry_oot.clear()
    custom_op.op_registry_oot.update(saved)


def _qkv(
    b: int = 2, hq: int = 4, hkv: int = 2, s: int = 5, k: int = 7, d: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(b, hq, s, d, generator=g),
        torch.randn(b, hkv, k, d, generator=g),
        torch.randn(b, hkv, k, d, generator=g),
    )


# ---- SDPA ------------------------------------------------------------------------


def _visible_mask(b: int, s: int, k: int) -> torch.Tensor:
    """A boolean mask [B, 1, S, K] where every query row sees at least one key."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(b, 1, s, k, generator=g) > 0.5
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize("scale", [None, 0.3])
def test_fused_sdpa_matches_torch_with_a_mask_and_gqa(scale: float | None) -> None:
    q, k, v = _qkv()
    mask = _visible_mask(2, 5, 7)
    calls = FakeFusedSDPA.calls
    got = fused_sdpa(FakeFusedSDPA, EXACT)(q, k, v, mask, False, scale, True)
    want = sdpa_native(q, k, v, mask, False, scale, True)
    assert FakeFusedSDPA.calls == calls + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_sdpa_matches_torch_causal() -> None:
    q, k, v = _qkv(s=6, k=6)
    got = fused_sdpa(FakeFusedSDPA, EXACT)(q, k, v, None, True, None, True)
    want = sdpa_native(q, k, v, None, True, None, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_sdpa_takes_an_additive_mask_as_is() -> None:
    q, k, v = _qkv(hq=2)
    bias = additive_mask(_visible_mask(2, 5, 7), torch.float32)
    got = fused_sdpa(FakeFusedSDPA, EXACT)(q, k, v, bias, False, None, False)
    want = sdpa_native(q, k, v, bias, False, None, False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_additive_mask_is_finite_where_nothing_is_seen() -> None:
    mask = torch.tensor([[True, False], [False, False]])
    bias = additive_mask(mask, torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and torch.isfinite(bias).all()
    assert bias[0, 0] == 0 and bias[0, 1] == torch.finfo(torch.bfloat16).min


def test_fused_sdpa_keeps_the_native_contract() -> None:
    q, k, v = _qkv()
    sdpa = fused_sdpa(FakeFusedSDPA)
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        sdpa(q, k, v, _visible_mask(2, 5, 7), True, None, True)
    with pytest.raises(ValueError, match="needs enable_gqa=True"):
        sdpa(q, k, v, None, False, None, False)


def test_the_fake_kernel_refuses_a_mask_with_causal() -> None:
    q, k, v = _qkv(hq=2)
    with pytest.raises(RuntimeError, match="is_causal with attn_mask"):
        FakeFusedSDPA.apply(q, k, v, torch.zeros(2, 1, 5, 7), 0.0, True)


def test_device_picks_the_sdpa_kernel(habana: FakeHabana) -> None:
    q, k, v = _qkv()
    calls = FakeFusedSDPA.calls
    out = device.sdpa_kernel(EXACT)(q, k, v, None, False, None, True)
    assert FakeFusedSDPA.calls == calls + 1
    torch.testing.assert_close(out, sdpa_native(q, k, v, None, False, None, True))


def test_device_picks_torch_sdpa_elsewhere() -> None:
    assert device.sdpa_kernel() is sdpa_native
    assert device.rms_norm_kernel() is None
    assert device.rope_kernel() is None


def test_attention_runs_on_the_device_sdpa(habana: FakeHabana) -> None:
    # The backend takes its kernel from the device module: FusedSDPA on Gaudi, and
    # the prefill kernel's call (mask, scale, grouped K/V) goes through it.
    from hpu_kernels.attention import kv_cache_of_stacked, prefill_attention
    from vllm_hpu_mm.attention.backend import HpuMMAttentionImpl

    impl = HpuMMAttentionImpl(num_heads=4, head_size=8, scale=0.35, num_kv_heads=2)
    g = torch.Generator().manual_seed(1)
    kv_cache = kv_cache_of_stacked(torch.randn(2, 3, 4, 2, 8, generator=g))
    query = torch.randn(5, 4, 8, generator=g)  # 5 rows, one tile
    tile_blocks = torch.tensor([[1, 2]])
    key_pos = torch.arange(8)[None, :]  # [1, K]
    query_pos = torch.arange(3, 8)[None, :]  # [1, 5]: rows at positions 3..7
    mask = key_pos[:, None, :] <= query_pos[:, :, None]  # [1, 5, K]
    args = (query, kv_cache, tile_blocks, mask, query_pos, key_pos, 0.35)
    calls = FakeFusedSDPA.calls
    fused = prefill_attention(*args, sdpa=impl.sdpa)
    assert FakeFusedSDPA.calls == calls + 1
    # Llama's default softmax is "fast" (bfloat16 accumulation): close, not equal.
    want = prefill_attention(*args, sdpa=sdpa_native)
    torch.testing.assert_close(fused, want, atol=2e-2, rtol=0)


def test_attention_runs_on_torch_sdpa_elsewhere() -> None:
    from vllm_hpu_mm.attention.backend import HpuMMAttentionImpl

    impl = HpuMMAttentionImpl(num_heads=4, head_size=8, scale=0.35, num_kv_heads=2)
    assert impl.sdpa is sdpa_native


# ---- RMSNorm ------------------------------------------------------------------------


def test_fused_rms_norm_matches_vllm(vllm_ops: list[str]) -> None:
    norm = RMSNorm(16, eps=1e-5)  # vLLM's layer, native path on the CPU host
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x, residual = torch.randn(6, 16), torch.randn(6, 16)
    calls = FakeFusedRMSNorm.calls
    got = fused_rms_norm(FakeFusedRMSNorm, x, norm.weight.data, 1e-5)
    torch.testing.assert_close(got, norm.forward_native(x))
    got_out, got_res = fused_rms_norm(
        FakeFusedRMSNorm, x, norm.weight.data, 1e-5, residual.clone()
    )
    want_out, want_res = norm.forward_native(x.clone(), residual.clone())
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_res, want_res)
    assert FakeFusedRMSNorm.calls == calls + 2


def test_the_fake_norm_wants_3d_input() -> None:
    with pytest.raises(RuntimeError, match="3-D input"):
        FakeFusedRMSNorm.apply(torch.ones(4, 8), torch.ones(8), 1e-6)


def test_registered_norm_uses_the_fused_kernel(
    habana: FakeHabana, vllm_ops: list[str]
) -> None:
    assert "+RMSNorm" in vllm_ops
    assert set(register_fused_ops()) == set(FUSED_OP_NAMES)
    assert register_fused_ops() == []  # idempotent
    norm = RMSNorm(16, eps=1e-6)  # what a model builds
    assert type(norm) is FusedRMSNorm
    assert norm._forward_method == norm.forward_oot  # vLLM's dispatch picks it
    x = torch.randn(3, 16)
    calls = FakeFusedRMSNorm.calls
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    assert FakeFusedRMSNorm.calls == calls + 1


def test_registered_gemma_norm_uses_the_fused_kernel(
    habana: FakeHabana, vllm_ops: list[str]
) -> None:
    """Gemma's ``x * (1 + w)`` norm through the fused kernel, against vLLM's
    own ``forward_native``, in bfloat16 (as Gaudi serves it), with and without
    the residual add."""
    assert "+GemmaRMSNorm" in vllm_ops
    register_fused_ops()
    norm = GemmaRMSNorm(16, eps=1e-6)  # what Gemma 3 builds
    assert type(norm) is FusedGemmaRMSNorm
    assert norm._forward_method == norm.forward_oot
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(16, generator=g))
    norm = norm.to(torch.bfloat16)
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    residual = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    calls = FakeFusedRMSNorm.calls
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    got = norm(x, residual.clone())
    want = norm.forward_native(x, residual.clone())
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert FakeFusedRMSNorm.calls == calls + 2


def test_norm_without_weight_falls_back(
    habana: FakeHabana, vllm_ops: list[str]
) -> None:
    register_fused_ops()
    norm = RMSNorm(16, has_weight=False)
    x = torch.randn(3, 16)
    calls = FakeFusedRMSNorm.calls
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    assert FakeFusedRMSNorm.calls == calls


def test_fused_norm_on_the_cpu_is_vllms(vllm_ops: list[str]) -> None:
    norm = FusedRMSNorm(16)  # no habana_frameworks: no kernel
    assert norm.fused_kernel is None
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm.forward_oot(x), norm.forward_native(x))


# ---- RoPE -------------------------------------------------------------------------


def _rope_kernel() -> object:
    from hpu_kernels.fused import RopeKernel

    return RopeKernel(
        apply=fake_apply_rotary_pos_emb,
        blockwise=RotaryPosEmbeddingMode.BLOCKWISE,
        pairwise=RotaryPosEmbeddingMode.PAIRWISE,
    )


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_fused_rope_matches_vllm(
    vllm_ops: list[str], neox: bool, rotary_dim: int
) -> None:
    rope = RotaryEmbedding(16, rotary_dim, 64, 10000.0, neox, torch.float32)
    positions = torch.tensor([0, 3, 7, 63, 5])
    query, key = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16)
    got_q, got_k = fused_rope(
        _rope_kernel(),  # type: ignore[arg-type]
        positions,
        query,
        key,
        16,
        rotary_dim,
        rope.cos_sin_cache,
        neox,
    )
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def test_the_fake_rope_wants_full_width_cos_sin() -> None:
    with pytest.raises(RuntimeError, match="cos/sin width"):
        fake_apply_rotary_pos_emb(
            torch.ones(2, 1, 8), torch.ones(2, 1, 4), torch.ones(2, 1, 4)
        )


def test_registered_ropes_use_the_fused_kernel(
    habana: FakeHabana, vllm_ops: list[str]
) -> None:
    # Count the kernel's calls: forward_oot falls back to forward_native when it
    # has no kernel, so equal outputs alone would not show the kernel ran.
    calls: list[int] = []

    def counting_rope(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return fake_apply_rotary_pos_emb(*args, **kwargs)

    kernels = habana.modules["habana_frameworks.torch.hpex.kernels"]
    kernels.apply_rotary_pos_emb = counting_rope  # type: ignore[attr-defined]
    register_fused_ops()
    rope = RotaryEmbedding(16, 16, 64, 10000.0, True, torch.float32)
    llama3 = Llama3RotaryEmbedding(
        16, 16, 64, 500000.0, True, torch.float32, 8.0, 1.0, 4.0, 32
    )
    assert type(rope) is FusedRotaryEmbedding
    assert type(llama3) is FusedLlama3RotaryEmbedding
    positions = torch.tensor([1, 2, 40])
    for layer in (rope, llama3):
        assert layer._forward_method == layer.forward_oot
        assert layer.fused_kernel is not None
        q, k = torch.randn(3, 32), torch.randn(3, 16)
        before = len(calls)
        got = layer(positions, q.clone(), k.clone())
        assert len(calls) == before + 2  # query and key
        want = layer.forward_native(positions, q.clone(), k.clone())
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
