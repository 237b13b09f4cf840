"""Static-shape vision-encoder attention (``hpu_kernels.encoder_attention``,
``vllm_hpu_mm.attention.encoder``): one masked SDPA a layer over the whole
padded patch sequence, checked against the per-segment definition in
float64, and compiled through the simulated ``hpu_backend`` once for every
segment layout of one padded size."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.model_executor.custom_op import op_registry_oot

from hpu_kernels.encoder_attention import (
    band_bias,
    banded_attention,
    encoder_attention,
    reference_attention,
    segment_bias,
    segment_ids,
)
from hpu_kernels.fused import fused_sdpa, sdpa_native
from tests.fakes.habana import FakeHabana, cpu_only_host
from vllm_hpu_mm import device
from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.gaudi_sim import compiler
from vllm_hpu_mm.plan import build_plan

HEADS, KV_HEADS, HEAD = 4, 2, 16
N = 32  # the padded patch count

# Offsets ([S + 1]) of several layouts over N = 32 patches: one segment; mixed
# sizes; empty segments (the fixed-length list repeats the last offset); real
# patches short of N (padding rows past the last offset); Qwen2.5-VL window
# layers' finer cut of the same images (windows of 4, clipped).
LAYOUTS = {
    "one": [0, 32],
    "mixed": [0, 4, 20, 32],
    "empty": [0, 8, 8, 24, 32, 32, 32],
    "padding": [0, 12, 20],
    "windows": [0, 4, 8, 12, 16, 18, 20, 24, 28, 32],
    "windows2": [0, 3, 7, 8, 12, 14, 18, 22, 26, 29, 32],
}


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with cpu_only_host(monkeypatch):
        yield


def _qkv(n: int = N, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, HEADS, HEAD, generator=g)
    k = torch.randn(1, n, KV_HEADS, HEAD, generator=g)
    v = torch.randn(1, n, KV_HEADS, HEAD, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _offsets(name: str) -> torch.Tensor:
    return torch.tensor(LAYOUTS[name], dtype=torch.int32)


def test_segment_ids_follow_the_offsets_and_pad_into_one_segment() -> None:
    ids = segment_ids(torch.tensor([0, 2, 2, 5], dtype=torch.int32), 7)
    # segments [0, 2), (empty), [2, 5); rows 5 and 6 past the last offset
    assert ids.tolist() == [0, 0, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_masked_attention_matches_per_segment_float64(layout: str) -> None:
    q, k, v = _qkv()
    cu = _offsets(layout)
    bias = segment_bias(cu, N, torch.float32)
    got = encoder_attention(q, k, v, bias, HEAD**-0.5, sdpa_native)
    want = reference_attention(q, k, v, cu, HEAD**-0.5)
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_mask_changes_the_answer() -> None:
    """The layouts differ in their outputs (a mask that did nothing would
    pass the comparison for "one" segment only)."""
    q, k, v = _qkv()
    full = encoder_attention(q, k, v, None, HEAD**-0.5, sdpa_native)
    cut = encoder_attention(
        q, k, v, segment_bias(_offsets("mixed"), N, q.dtype), HEAD**-0.5, sdpa_native
    )
    assert not torch.allclose(full, cut, atol=1e-3)


@pytest.mark.parametrize("layout", ["mixed", "padding", "windows"])
def test_fused_sdpa_with_the_mask_matches_float64_in_bf16(
    layout: str, habana: FakeHabana
) -> None:
    """The simulated FusedSDPA (exact softmax) in bfloat16: within bfloat16's
    rounding of inputs and output (|out| < 4: a few 2^-7 spacings)."""
    kernels = habana.modules["habana_frameworks.torch.hpex.kernels"]
    sdpa = fused_sdpa(kernels.FusedSDPA, "None")  # type: ignore[attr-defined]
    q, k, v = _qkv(dtype=torch.bfloat16)
    cu = _offsets(layout)
    got = encoder_attention(
        q, k, v, segment_bias(cu, N, torch.bfloat16), HEAD**-0.5, sdpa
    )
    want = reference_attention(q, k, v, cu, HEAD**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=3 * 2**-7)


WINDOW = 8  # the most rows a window holds in the banded tests


def _windows(n: int, seed: int) -> torch.Tensor:
    """Offsets of random windows of 1..WINDOW rows covering ``n`` rows."""
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < n:
        step = int(torch.randint(1, WINDOW + 1, (1,), generator=g))
        bounds.append(min(n, bounds[-1] + step))
    return torch.tensor(bounds, dtype=torch.int32)


@pytest.mark.parametrize(
    ("n", "tile", "seed"), [(45, WINDOW, 0), (48, WINDOW, 1), (45, 4, 2), (5, 8, 3)]
)
def test_banded_attention_matches_per_window_float64(
    n: int, tile: int, seed: int
) -> None:
    """Query tiles against the keys around them: the per-window answer when
    no window exceeds WINDOW rows, whether or not ``n`` fills the last tile
    (45) and whatever the tile (4, 8, wider than the sequence)."""
    q, k, v = _qkv(n, seed=seed)
    cu = _windows(n, seed)
    bias = band_bias(cu, n, tile, WINDOW, torch.float32)
    tiles = -(-n // tile)
    assert bias.shape == (tiles, tile, tile + 2 * (WINDOW - 1))
    got = banded_attention(q, k, v, bias, HEAD**-0.5, sdpa_native)
    want = reference_attention(q, k, v, cu, HEAD**-0.5)
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_banded_rows_past_the_last_offset_form_one_window() -> None:
    n = 20
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)  # rows 14..19: padding
    q, k, v = _qkv(n)
    bias = band_bias(cu, n, WINDOW, WINDOW, torch.float32)
    got = banded_attention(q, k, v, bias, HEAD**-0.5, sdpa_native)
    torch.testing.assert_close(
        got.double(), reference_attention(q, k, v, cu, HEAD**-0.5), rtol=1e-5, atol=1e-5
    )


def test_window_patches_of_a_qwen_tower() -> None:
    from types import SimpleNamespace

    from vllm_hpu_mm.attention.encoder import window_patches

    # released Qwen2.5-VL: 112 px windows of 14 px patches, merged 2x2
    tower = SimpleNamespace(window_size=112, patch_size=14, spatial_merge_size=2)
    assert window_patches(tower) == 64
    assert window_patches(SimpleNamespace(patch_size=14)) is None


def _layer(monkeypatch: pytest.MonkeyPatch, execution: str) -> Any:
    """vLLM's ``MMEncoderAttention`` built with ours registered, under a plan
    of ``execution`` on the CPU; the registry restored after the test."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.mm_encoder_attention import (
        MMEncoderAttention,
    )

    from vllm_hpu_mm import plan as plan_module
    from vllm_hpu_mm.attention.encoder import register_encoder_attention

    config = HpuMMConfig.from_mapping({"execution": execution}, source="a test")
    plan = build_plan(config, "cpu", False)
    monkeypatch.setattr(plan_module, "current_plan", lambda: plan)
    saved = dict(op_registry_oot)
    try:
        register_encoder_attention()
        with set_current_vllm_config(VllmConfig()):
            layer = MMEncoderAttention(
                HEADS, HEAD, scale=HEAD**-0.5, num_kv_heads=KV_HEADS
            )
    finally:
        op_registry_oot.clear()
        op_registry_oot.update(saved)
    return layer


def test_static_plan_layer_is_one_call_without_a_host_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under the static plan the layer never reads the offsets on the host
    (``tolist`` / ``item`` would raise here) and calls SDPA once; its output
    is vLLM's per-segment form's, in both input layouts."""
    from vllm_hpu_mm.attention.encoder import HpuMMEncoderAttention

    layer = _layer(monkeypatch, "static")
    assert isinstance(layer, HpuMMEncoderAttention) and layer.static
    q, k, v = _qkv()
    cu = _offsets("windows")
    want = layer._forward_sdpa(q, k, v, cu)  # vLLM's per-segment form
    calls = []

    def counting(*args: Any) -> torch.Tensor:
        calls.append(1)
        return sdpa_native(*args)

    layer.sdpa = counting

    def no_host_read(*_: Any, **__: Any) -> Any:
        raise AssertionError("the offsets were read on the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_host_read)
    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    got = layer(q, k, v, cu_seqlens=cu)
    flat = layer(q.flatten(2), k.flatten(2), v.flatten(2), cu_seqlens=cu)
    monkeypatch.undo()
    assert len(calls) == 2  # one per call, whatever the segment count
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat, want.flatten(2), rtol=1e-5, atol=1e-5)


def test_dynamic_plan_layer_keeps_vllms_form(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer(monkeypatch, "dynamic")
    assert not layer.static
    q, k, v = _qkv()
    cu = _offsets("mixed")
    calls = []
    layer.sdpa = lambda *a: calls.append(1)  # the static form must not run
    got = layer(q, k, v, cu_seqlens=cu)
    assert calls == []
    torch.testing.assert_close(got, layer._forward_sdpa(q, k, v, cu))


def test_step_masks_replace_the_offsets_and_give_the_same_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_hpu_mm.attention.encoder import attach_step_masks

    layer = _layer(monkeypatch, "static")
    metadata = {
        "cu_seqlens": _offsets("mixed"),
        "cu_window_seqlens": _offsets("windows"),
        "window_index": torch.arange(N // 4),
    }
    masks = attach_step_masks(metadata, N, torch.float32)
    assert masks["window_index"] is metadata["window_index"]
    assert masks["cu_seqlens"].shape == masks["cu_window_seqlens"].shape == (N, N)
    q, k, v = _qkv()
    for key in ("cu_seqlens", "cu_window_seqlens"):
        torch.testing.assert_close(
            layer(q, k, v, cu_seqlens=masks[key]),
            layer(q, k, v, cu_seqlens=metadata[key]),
        )


def test_two_layouts_at_one_padded_size_compile_once(
    monkeypatch: pytest.MonkeyPatch, habana: FakeHabana
) -> None:
    """Two layers (sharing the step's mask) compiled through the simulated
    ``hpu_backend`` with ``fullgraph`` (a host read would break the graph):
    a second step with other segment lengths at the same padded size reuses
    the graph, and its answer is the per-segment one."""
    from torch._dynamo import lookup_backend

    from vllm_hpu_mm.attention.encoder import attach_step_masks

    assert device.device_kind() == "hpu"
    layer = _layer(monkeypatch, "static")
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return lookup_backend(device.compile_backend())(gm, example_inputs)

    def tower(q: Any, k: Any, v: Any, metadata: dict[str, Any]) -> torch.Tensor:
        metadata = attach_step_masks(metadata, q.shape[1], q.dtype, window=4)
        assert metadata["cu_window_seqlens"].dim() == 3  # the banded form
        x = layer(q, k, v, cu_seqlens=metadata["cu_window_seqlens"])
        return layer(x, k, v, cu_seqlens=metadata["cu_seqlens"])

    compiled = torch.compile(tower, backend=backend, dynamic=False, fullgraph=True)
    before = compiler.Compilations.count
    q, k, v = _qkv()
    # windows of at most 4 rows: the window layer runs the banded form
    for full, window in (("mixed", "windows"), ("empty", "windows2")):
        metadata = {"cu_seqlens": _offsets(full), "cu_window_seqlens": _offsets(window)}
        # same padded length of the offsets lists: pad with the last offset
        for key, value in metadata.items():
            metadata[key] = torch.cat([value, value[-1:].expand(12 - len(value))])
        got = compiled(q, k, v, metadata)
        mid = reference_attention(q, k, v, metadata["cu_window_seqlens"], HEAD**-0.5)
        want = reference_attention(
            mid.float(), k, v, metadata["cu_seqlens"], HEAD**-0.5
        )
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert len(graphs) == 1 and compiler.Compilations.count == before + 1
