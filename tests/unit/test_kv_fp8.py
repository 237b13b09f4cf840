"""The FP8 KV cache's conversions and reads (``hpu_kernels.kv_fp8``), the
kernels over an FP8 cache, Habana's casts on the simulated Gaudi, and the
start-up refusal of the KV-cache dtypes the plugin does not serve.

The kernels are checked against themselves over a float32 cache holding the
dequantized values (``x_fp8 * scale``): reading an FP8 cache must give
exactly those values, so the outputs are bit-identical; a read that forgot
the scale (or a write that forgot to divide by it) differs at once.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from vllm.engine.arg_utils import EngineArgs

from hpu_kernels import attention
from hpu_kernels.attention import KVCache
from hpu_kernels.kv_fp8 import (
    FP8_KV_DTYPE,
    KVQuant,
    dequantize_kv,
    quantize_kv,
)
from tests.fakes.habana import FakeHabana, cpu_only_host
from tests.unit.test_attention_kernels import (
    DECODE_SEQ_LENS,
    HEAD,
    PREFILL_SPECS,
    block_table_of,
    decode_inputs,
    flat_inputs,
    make_scenario,
    prefill_inputs,
    write_step,
)
from vllm_hpu_mm import device
from vllm_hpu_mm.attention.decode_cache import DecodeCache
from vllm_hpu_mm.attention.kv_dtype import kv_cache_dtype_problem
from vllm_hpu_mm.attention.layout import causal_blocks
from vllm_hpu_mm.attention.metadata import build_prefill_requests
from vllm_hpu_mm.gaudi_sim import compiler, fp8_ops
from vllm_hpu_mm.worker.kv_cache import zero_blocks

K_SCALE, V_SCALE = 0.05, 0.02


def _s(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# --- the conversions ------------------------------------------------------------


def test_quantize_saturates_and_never_makes_nan() -> None:
    """Out of range (and infinite) values become +-448, the e4m3 maximum.
    (PyTorch 2.13's CPU cast saturates by itself; the clamp keeps the rule on
    devices whose cast makes NaN of an out-of-range value.)"""
    x = torch.tensor([1e6, -1e6, math.inf, -math.inf, 500.0, 448.0, 3.3, 1e-5])
    q = quantize_kv(x, _s(1.0))
    assert q.dtype == FP8_KV_DTYPE
    assert q.float().tolist() == [448, -448, 448, -448, 448, 448, 3.25, 0.0]
    # Through a small scale: 30 / 0.05 = 600 is out of range too.
    out = dequantize_kv(
        quantize_kv(torch.tensor([30.0, -30.0]), _s(K_SCALE)),
        _s(K_SCALE),
        torch.float32,
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, torch.tensor([448 * K_SCALE, -448 * K_SCALE]))


def test_write_divides_by_the_scale_and_read_multiplies() -> None:
    x = torch.tensor([3.0, -0.75, 0.1])
    q = quantize_kv(x, _s(0.5))
    assert q.float().tolist() == [6.0, -1.5, 0.203125]  # 0.2 rounded to e4m3
    for dtype in (torch.float32, torch.bfloat16):
        back = dequantize_kv(q, _s(0.5), dtype)
        assert back.dtype == dtype
        assert back.float().tolist() == [3.0, -0.75, 0.1015625]


def test_round_trip_error_is_within_half_an_e4m3_step() -> None:
    """3 mantissa bits: a normal value errs by at most 2^-4 of itself; below
    the smallest normal (2^-6 x scale) by half the subnormal step (2^-10)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    back = dequantize_kv(quantize_kv(x, _s(K_SCALE)), _s(K_SCALE), torch.float64)
    bound = x.double().abs() * 2**-4 + K_SCALE * 2**-10
    assert ((back - x.double()).abs() <= bound).all()
    assert (back != x.double()).any()  # it does round


# --- the kernels over an FP8 cache ----------------------------------------------


def _fp8_and_reference(
    stacked: torch.Tensor, block_size: int
) -> tuple[KVCache, torch.Tensor]:
    """The FP8 cache of a stacked float32 cache, and a stacked float32 cache
    holding exactly what the FP8 one stands for."""
    kv = attention.kv_cache_of_stacked(stacked)
    key = quantize_kv(kv.key, _s(K_SCALE))
    value = quantize_kv(kv.value, _s(V_SCALE))
    fp8 = KVCache(key, value, block_size, KVQuant(_s(K_SCALE), _s(V_SCALE)))
    ref = torch.stack(
        [
            dequantize_kv(key, _s(K_SCALE), torch.float32),
            dequantize_kv(value, _s(V_SCALE), torch.float32),
        ]
    ).view(stacked.shape)
    assert not torch.equal(ref, stacked)  # the rounding shows
    return fp8, ref


@pytest.mark.parametrize("window", [None, 5])
def test_tiled_prefill_reads_the_fp8_cache_dequantized(window: int | None) -> None:
    block_size = 4
    stacked, reqs = make_scenario(PREFILL_SPECS, block_size, 4, 2)
    write_step(stacked, reqs)
    fp8, ref = _fp8_and_reference(stacked, block_size)
    query = torch.cat([r.queries for r in reqs])
    inputs = prefill_inputs(reqs, block_size)
    scale = 1 / math.sqrt(HEAD)
    got = attention.prefill_attention(
        query, fp8, **inputs, scale=scale, sliding_window=window
    )
    want = attention.prefill_attention(
        query,
        attention.kv_cache_of_stacked(ref),
        **inputs,
        scale=scale,
        sliding_window=window,
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("window", [None, 5])
def test_causal_prefill_reads_the_fp8_cache_dequantized(window: int | None) -> None:
    block_size = 4
    stacked, reqs = make_scenario([(0, 11)], block_size, 4, 2)
    write_step(stacked, reqs)
    fp8, ref = _fp8_and_reference(stacked, block_size)
    query = reqs[0].queries
    table = np.array([reqs[0].block_ids], np.int64)
    blocks = torch.from_numpy(causal_blocks(np.array([11]), table, block_size, 11))
    scale = 1 / math.sqrt(HEAD)
    got = attention.causal_prefill_attention(
        query, fp8, blocks, scale, sliding_window=window
    )
    want = attention.causal_prefill_attention(
        query, attention.kv_cache_of_stacked(ref), blocks, scale, window
    )
    assert torch.equal(got, want)


def test_decode_forms_read_the_fp8_cache_dequantized() -> None:
    block_size = 4
    specs = [(s - 1, 1) for s in DECODE_SEQ_LENS]
    stacked, reqs = make_scenario(specs, block_size, 4, 2, seed=5)
    write_step(stacked, reqs)
    fp8, ref = _fp8_and_reference(stacked, block_size)
    ref_kv = attention.kv_cache_of_stacked(ref)
    query = torch.cat([r.queries for r in reqs])
    scale = 1 / math.sqrt(HEAD)
    flat = flat_inputs(reqs, block_size)
    assert torch.equal(
        attention.decode_attention(query, fp8, **flat, scale=scale),
        attention.decode_attention(query, ref_kv, **flat, scale=scale),
    )
    width = math.ceil(max(DECODE_SEQ_LENS) / block_size)
    table, seq_lens = decode_inputs(reqs, block_size, width)
    assert torch.equal(
        attention.batched_decode_attention(query, fp8, table, seq_lens, scale),
        attention.batched_decode_attention(query, ref_kv, table, seq_lens, scale),
    )


def test_per_request_prefill_reads_prior_context_dequantized() -> None:
    block_size = 4
    stacked, reqs = make_scenario(PREFILL_SPECS, block_size, 4, 2)
    write_step(stacked, reqs)
    fp8, ref = _fp8_and_reference(stacked, block_size)
    q = np.array([r.query_len for r in reqs], np.int64)
    seq = np.array([r.seq_len for r in reqs], np.int64)
    info = build_prefill_requests(q, seq, block_table_of(reqs), torch.device("cpu"))
    query = torch.cat([r.queries for r in reqs])
    keys = torch.cat([r.keys[r.prior :] for r in reqs])
    values = torch.cat([r.values[r.prior :] for r in reqs])
    args = (info.rows, info.block_table, info.masks_for(None), 1 / math.sqrt(HEAD))
    got = attention.request_prefill_attention(query, keys, values, fp8, *args)
    want = attention.request_prefill_attention(
        query, keys, values, attention.kv_cache_of_stacked(ref), *args
    )
    assert torch.equal(got, want)


def test_write_kv_stores_fp8_rows_on_the_cpu() -> None:
    """PyTorch's CPU ``index_copy_`` has no FP8 kernel: the custom op writes
    through the cache's uint8 view."""
    cache = KVCache(
        torch.zeros(16, 2, HEAD, dtype=FP8_KV_DTYPE),
        torch.zeros(16, 2, HEAD, dtype=FP8_KV_DTYPE),
        4,
    )
    key = torch.randn(3, 2, HEAD)
    value = torch.randn(3, 2, HEAD)
    slots = torch.tensor([5, 9, 2])
    kq, vq = quantize_kv(key, _s(K_SCALE)), quantize_kv(value, _s(V_SCALE))
    attention.write_kv(cache, kq, vq, slots)
    assert torch.equal(cache.key[slots].view(torch.uint8), kq.view(torch.uint8))
    assert torch.equal(cache.value[slots].view(torch.uint8), vq.view(torch.uint8))
    assert (cache.key[[0, 1, 3, 4]].float() == 0).all()
    zero_blocks({"layer": cache}, [1, 2])  # rows 4-11: slots 5 and 9
    assert (cache.key[[5, 9]].float() == 0).all()
    assert torch.equal(cache.key[2].view(torch.uint8), kq[2].view(torch.uint8))


def test_dense_decode_cache_holds_dequantized_values() -> None:
    """The dense copy of an FP8 cache is in the compute dtype, filled with
    the dequantized blocks (``attention.decode_cache``)."""
    block_size = 4
    specs = [(s - 1, 1) for s in (6, 9)]
    stacked, reqs = make_scenario(specs, block_size, 4, 2, seed=3)
    fp8, ref = _fp8_and_reference(stacked, block_size)
    cache = DecodeCache(2, 16, block_size, torch.device("cpu"), torch.float32)
    assert DecodeCache.bytes_per_layer(2, 16, block_size, fp8, torch.float32) == (
        2 * 2 * 2 * 16 * HEAD * 4
    )
    dense = cache.tensor_for(fp8)
    assert dense.dtype == torch.float32
    seq = np.array([r.seq_len for r in reqs], np.int64)
    step = cache.plan(["a", "b"], seq, [r.block_ids for r in reqs])
    assert step is not None and step.fill_slots is not None
    new_k = torch.stack([r.keys[-1] for r in reqs])
    new_v = torch.stack([r.values[-1] for r in reqs])
    query = torch.stack([r.queries[0] for r in reqs])
    attention.dense_decode_attention(
        query, new_k, new_v, fp8, dense, step.slots, step.positions,
        step.fill_slots, step.fill_blocks, step.mask(None), 1 / math.sqrt(HEAD),
    )  # fmt: skip
    ref_kv = attention.kv_cache_of_stacked(ref)
    for slot, r in zip(step.slots.tolist(), reqs, strict=True):
        for pos in range(r.prior):
            row = r.block_ids[pos // block_size] * block_size + pos % block_size
            assert torch.equal(dense[0, slot, :, pos], ref_kv.key[row])
            assert torch.equal(dense[1, slot, :, pos], ref_kv.value[row])


# --- Habana's casts on the simulated Gaudi --------------------------------------


def test_gaudi_casts_match_the_pytorch_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """On HPU the cache converts through ``cast_to_fp8_v2(x, 1 / scale)`` and
    ``cast_from_fp8(x, scale, dtype)`` (the official plugin's FP8 KV cache):
    the simulated ops give the pure-PyTorch forms' bytes and values."""
    fp8_ops.register()
    monkeypatch.setattr(device, "device_kind", lambda: "hpu")
    monkeypatch.setattr(device, "_habana", lambda: None)
    quantize, dequantize = device.kv_fp8_casts()
    assert quantize is not quantize_kv
    x = torch.randn(64, 2, HEAD, generator=torch.Generator().manual_seed(1)) * 30
    q = quantize(x, _s(K_SCALE))
    assert q.dtype == FP8_KV_DTYPE
    assert torch.equal(
        q.view(torch.uint8), quantize_kv(x, _s(K_SCALE)).view(torch.uint8)
    )
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(
            dequantize(q, _s(K_SCALE), dtype), dequantize_kv(q, _s(K_SCALE), dtype)
        )


def test_fp8_write_casts_and_decode_read_compile_on_the_simulated_hpu_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Gaudi forms inside a graph of the simulated ``hpu_backend`` (which
    refuses what Habana's graph compiler refuses): the write's
    ``cast_to_fp8_v2`` and a flat decode over an FP8 cache read through
    ``cast_from_fp8``, equal to the eager PyTorch forms."""
    block_size = 4
    specs = [(s - 1, 1) for s in DECODE_SEQ_LENS]
    stacked, reqs = make_scenario(specs, block_size, 4, 2, seed=5)
    write_step(stacked, reqs)
    fp8, _ = _fp8_and_reference(stacked, block_size)
    query = torch.cat([r.queries for r in reqs])
    flat = flat_inputs(reqs, block_size)
    scale = 1 / math.sqrt(HEAD)
    want_read = attention.decode_attention(query, fp8, **flat, scale=scale)
    x = torch.randn(5, 2, HEAD, generator=torch.Generator().manual_seed(2)) * 30
    want_q = quantize_kv(x, _s(K_SCALE))
    with cpu_only_host(monkeypatch):
        fake = FakeHabana().install(monkeypatch)
        device.select_device.cache_clear()
        torch._dynamo.reset()
        try:
            assert device.device_kind() == "hpu"
            fp8_ops.register()
            quantize, dequantize = device.kv_fp8_casts()

            def read(key: torch.Tensor, value: torch.Tensor, ks: torch.Tensor,
                     vs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # fmt: skip
                kv = KVCache(
                    key, value, block_size, KVQuant(ks, vs, quantize, dequantize)
                )
                return attention.decode_attention(q, kv, **flat, scale=scale)

            before = compiler.Compilations.count
            backend = device.compile_backend()
            got_q = torch.compile(quantize, backend=backend)(x, _s(K_SCALE))
            got_read = torch.compile(read, backend=backend)(
                fp8.key, fp8.value, _s(K_SCALE), _s(V_SCALE), query
            )
            assert compiler.Compilations.count == before + 2
        finally:
            torch._dynamo.reset()
            fake.uninstall()
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_read, want_read)


def test_sim_cast_from_fp8_refuses_a_non_fp8_input() -> None:
    fp8_ops.register()
    with pytest.raises(RuntimeError, match="input must be FP8"):
        torch.ops.hpu.cast_from_fp8(torch.ones(3), _s(1.0), torch.bfloat16)


# --- refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "why"),
    [
        ("fp8_e5m2", "E5M2"),
        ("fp8_inc", "Neural Compressor"),
        ("int8_per_token_head", None),
    ],
)
def test_unsupported_kv_cache_dtypes_are_named_with_what_is_served(
    dtype: str, why: str | None
) -> None:
    problem = kv_cache_dtype_problem(dtype, [])
    assert problem is not None and f"--kv-cache-dtype {dtype!r}" in problem
    assert "supported: auto, bfloat16, float16, float32, fp8, fp8_e4m3" in problem
    if why:
        assert why in problem


def test_fp8_with_skipped_layers_is_refused_and_fp8_is_served() -> None:
    assert kv_cache_dtype_problem("fp8", []) is None
    assert kv_cache_dtype_problem("fp8_e4m3", []) is None
    problem = kv_cache_dtype_problem("fp8", ["0"])
    assert problem is not None and "skip-layers" in problem


def test_refused_at_config_time_before_the_engine_core(tiny_llama_dir: str) -> None:
    """``EngineArgs.create_engine_config`` runs the platform's config check
    in the process that parses the arguments: the refusal comes before any
    engine process starts."""
    with pytest.raises(Exception, match="vllm-hpu-mm does not support") as info:
        EngineArgs(
            model=tiny_llama_dir, kv_cache_dtype="fp8_e5m2"
        ).create_engine_config()
    assert "fp8, fp8_e4m3" in str(info.value)
    config = EngineArgs(
        model=tiny_llama_dir, kv_cache_dtype="fp8"
    ).create_engine_config()
    assert config.cache_config.cache_dtype == "fp8"


def test_attention_impl_refuses_e5m2() -> None:
    from vllm_hpu_mm.attention.backend import HpuMMAttentionImpl

    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8_e5m2'"):
        HpuMMAttentionImpl(4, HEAD, 1.0, 2, kv_cache_dtype="fp8_e5m2")
