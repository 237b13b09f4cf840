"""The simulated Gaudi (``vllm_hpu_mm.gaudi_sim``): each refusal of the real
stack it models makes the corresponding mistake fail, and each issue-28 fix
passes where the unfixed code fails.

The stack is installed per test through ``tests.fakes.habana.FakeHabana``
(undone afterwards); the whole-process installation (``VLLM_HPU_MM_DEVICE=hpu
VLLM_HPU_MM_GAUDI_SIM=1``) runs in a fresh interpreter.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hpu_kernels.attention import (
    KVCache,
    kv_cache_of_stacked,
    write_kv,
    write_kv_plain,
)
from hpu_kernels.cross_attention import (
    CrossCache,
    CrossRequest,
    cross_attention_decode,
    cross_attention_prefill,
    cross_attention_requests,
    cross_cache_of_stacked,
    new_cross_cache,
    write_cross_kv,
)
from hpu_kernels.fused import fused_sdpa, fused_softmax_mode, sdpa_native
from tests.fakes.habana import FakeHabana, cpu_only_host
from vllm_hpu_mm import device, patches
from vllm_hpu_mm.gaudi_sim import card, compiler, grammar, kernels, stack

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with cpu_only_host(monkeypatch):
        yield


def _hpu_compile(fn: Any, **kwargs: Any) -> Any:
    return torch.compile(fn, backend=device.compile_backend(), **kwargs)


# ---- hpu_backend: what Habana's graph compiler refuses -----------------------------


def _cache() -> KVCache:
    # K and V [blocks * BS, Hkv, D]: 3 blocks of 4
    return KVCache(torch.zeros(12, 2, 8), torch.zeros(12, 2, 8), 4)


def _kv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 5, 2, 8, generator=g)
    return key, value, torch.tensor([4, 5, 6, 9, 0])


def test_the_custom_op_kv_write_is_refused_by_hpu_backend(habana: FakeHabana) -> None:
    """Issue 28 item 4: the mutating custom op becomes auto_functionalized."""
    key, value, slots = _kv()
    fn = _hpu_compile(lambda c, k, v, s: write_kv(c, k, v, s))
    with pytest.raises(Exception, match="auto_functionalized"):
        fn(_cache(), key, value, slots)


def test_the_plain_kv_write_compiles_and_writes_the_slots(habana: FakeHabana) -> None:
    key, value, slots = _kv()
    before = compiler.Compilations.count
    cache, want = _cache(), _cache()
    _hpu_compile(lambda c, k, v, s: write_kv_plain(c, k, v, s))(
        cache, key, value, slots
    )
    write_kv(want, key, value, slots)
    assert torch.equal(cache.key, want.key) and torch.equal(cache.value, want.value)
    assert compiler.Compilations.count == before + 1
    assert habana.calls == ["compile"]


def test_a_write_through_views_of_one_cache_is_counted_as_whole_copies(
    habana: FakeHabana, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 28 item 4's cost: Habana reinplaces index_copy on a non-view input
    only. K and V as two halves of one [2, ...] cache (the layout before)
    cost a whole copy of it per write: counted and logged. Separate K and V
    tensors (``KVCache``, the layout now) cost none: written in place."""
    key, value, slots = _kv()
    before = compiler.InputCopies.count
    stacked = torch.zeros(2, 3, 4, 2, 8)  # [2, blocks, BS, Hkv, D]
    with caplog.at_level("WARNING", logger="vllm.hpu_mm.gaudi_sim"):
        _hpu_compile(
            lambda c, k, v, s: write_kv_plain(kv_cache_of_stacked(c), k, v, s)
        )(stacked, key, value, slots)
    assert compiler.InputCopies.count > before
    assert compiler.INPUT_COPY_LOG in caplog.text
    assert torch.equal(stacked[0].view(12, 2, 8)[slots], key)
    caplog.clear()
    before = compiler.InputCopies.count
    cache = _cache()
    with caplog.at_level("WARNING", logger="vllm.hpu_mm.gaudi_sim"):
        _hpu_compile(lambda c, k, v, s: write_kv_plain(c, k, v, s))(
            cache, key, value, slots
        )
    assert compiler.InputCopies.count == before
    assert compiler.INPUT_COPY_LOG not in caplog.text
    assert torch.equal(cache.key[slots], key)
    assert torch.equal(cache.value[slots], value)


def test_the_reinplaced_write_is_in_place_and_reads_see_it(habana: FakeHabana) -> None:
    """The rewritten graph writes the input's own storage (no copy) and a read
    after the write in the same graph sees the new rows."""
    key, _, slots = _kv()
    flat = torch.zeros(12, 2, 8)
    ptr = flat.data_ptr()

    def write_then_read(
        c: torch.Tensor, k: torch.Tensor, s: torch.Tensor
    ) -> torch.Tensor:
        c.index_copy_(0, s, k)
        return c.index_select(0, s) * 2

    before = compiler.InputCopies.count
    out = _hpu_compile(write_then_read)(flat, key, slots)
    assert compiler.InputCopies.count == before  # the copy_ was reinplaced
    assert flat.data_ptr() == ptr
    assert torch.equal(flat[slots], key) and torch.equal(out, key * 2)


def test_a_clone_of_an_input_is_counted(habana: FakeHabana) -> None:
    before = compiler.InputCopies.count
    _hpu_compile(lambda c: c.clone().add_(1).sum())(torch.zeros(12, 2, 8))
    assert compiler.InputCopies.count == before + 1


def test_the_attention_backend_writes_plainly_on_hpu(habana: FakeHabana) -> None:
    from vllm_hpu_mm.attention.backend import HpuMMAttentionImpl

    impl = HpuMMAttentionImpl(num_heads=4, head_size=8, scale=0.35, num_kv_heads=2)
    key, value, slots = _kv()
    cache = _cache()
    _hpu_compile(lambda c, k, v, s: impl.write_kv(c, k, v, s))(cache, key, value, slots)
    assert cache.key.abs().sum() > 0 and cache.value.abs().sum() > 0


# ---- issue 28 item 4 for Mllama: the cross-attention cache --------------------------

X_TILES, X_PATCHES, X_PADDED, X_HKV, X_D = 2, 3, 4, 2, 8
X_ROWS = X_TILES * X_PADDED
CPU = torch.device("cpu")


def _cross_step(
    cache: CrossCache,
    slots: torch.Tensor,  # [N]
    key: torch.Tensor,  # [N, rows, Hkv, D]
    value: torch.Tensor,
    query: torch.Tensor,  # [T, H, D]
    key_rows: torch.Tensor,  # [K] rows of the flattened cache
) -> tuple[torch.Tensor, ...]:
    """What Mllama's graphs do to the cache: store the encoder's K/V
    (``write_cross_kv``), then read it in each layout (decode, flat prefill,
    per request)."""
    write_cross_kv(cache, slots, key, value)
    t = query.shape[0]
    dec = cross_attention_decode(
        query,
        cache,
        slots.view(1, -1).expand(t, -1),
        torch.ones(t, slots.shape[0], X_TILES, dtype=torch.bool),
        0.5,
        X_PATCHES,
    )
    pre = cross_attention_prefill(
        query,
        cache,
        slots,
        torch.ones(t, slots.shape[0], X_TILES, dtype=torch.bool),
        0.5,
        X_PATCHES,
    )
    per_request = cross_attention_requests(
        query, cache, [CrossRequest(0, t, key_rows, None)], 0.5
    )
    return dec, pre, per_request


def _cross_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(2, 2, X_ROWS, X_HKV, X_D, generator=g)
    query = torch.randn(3, 4, X_D, generator=g)
    return torch.tensor([2, 1]), key, value, query, torch.tensor([8, 9, 12, 13])


def test_mllamas_cross_cache_is_written_and_read_without_whole_copies(
    habana: FakeHabana, caplog: pytest.LogCaptureFixture
) -> None:
    """The cross-attention cache as the runner allocates it
    (``new_cross_cache``: K and V apart) is written in place by the encoder's
    K/V store and read by every kernel layout inside an ``hpu_backend`` graph
    with no whole copy of it; as two halves of one ``[2, ...]`` tensor (the
    layout before) the same graph copies it whole."""
    inputs = _cross_inputs()
    want = _cross_step(
        new_cross_cache(3, X_ROWS, X_HKV, X_D, torch.float32, CPU), *inputs
    )
    cache = new_cross_cache(3, X_ROWS, X_HKV, X_D, torch.float32, CPU)
    ptrs = [t.data_ptr() for t in cache]
    before = compiler.InputCopies.count
    with caplog.at_level("WARNING", logger="vllm.hpu_mm.gaudi_sim"):
        got = _hpu_compile(_cross_step, dynamic=False)(cache, *inputs)
    assert compiler.InputCopies.count == before, compiler.InputCopies.names[before:]
    assert compiler.INPUT_COPY_LOG not in caplog.text
    assert [t.data_ptr() for t in cache] == ptrs
    slots, key, value = inputs[:3]
    assert torch.equal(cache.key[slots], key) and torch.equal(cache.value[slots], value)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    # The layout before: K and V views of one [2, slots, rows, Hkv, D] tensor.
    torch._dynamo.reset()
    stacked = torch.zeros(2, 3, X_ROWS, X_HKV, X_D)
    before = compiler.InputCopies.count
    _hpu_compile(
        lambda c, *rest: _cross_step(cross_cache_of_stacked(c), *rest), dynamic=False
    )(stacked, *inputs)
    assert compiler.InputCopies.count > before
    assert torch.equal(stacked[0][slots], key)


def test_symbolic_sizes_are_refused(habana: FakeHabana) -> None:
    fn = _hpu_compile(lambda x: x * 2 + 1, dynamic=True)
    with pytest.raises(Exception, match="Cannot convert symbols to int"):
        fn(torch.arange(6.0))


def test_unbacked_sizes_are_refused(habana: FakeHabana) -> None:
    x = torch.arange(6.0)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    with pytest.raises(Exception, match="Cannot convert symbols to int"):
        _hpu_compile(lambda t: t.sum(-1))(x)


def test_static_graphs_compile_once_per_shape(habana: FakeHabana) -> None:
    before = compiler.Compilations.count
    fn = _hpu_compile(lambda x: x * 2 + 1, dynamic=False)
    for _ in range(2):
        assert torch.equal(fn(torch.arange(3.0)), torch.arange(3.0) * 2 + 1)
    fn(torch.arange(4.0))
    assert compiler.Compilations.count == before + 2


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_a_compiled_frame_building_a_user_class_compiles(habana: FakeHabana) -> None:
    """Dynamo asks ``torch.hpu`` for ``Stream`` / ``Event`` when a compiled
    frame calls a user-defined class (a VLM's image-input schema does)."""
    from torch._dynamo.variables.user_defined import UserDefinedClassVariable

    UserDefinedClassVariable._in_graph_classes.cache_clear()  # read torch.hpu now
    fn = _hpu_compile(lambda x: _Box(x * 2).t + 1, dynamic=False)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 3.0))


def test_cond_is_accepted(habana: FakeHabana) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))

    assert torch.equal(_hpu_compile(f)(torch.ones(3)), torch.full((3,), 2.0))


def test_inductor_is_refused_on_hpu_tensors(
    monkeypatch: pytest.MonkeyPatch, habana: FakeHabana
) -> None:
    import torch._inductor.compile_fx as compile_fx

    monkeypatch.setattr(compile_fx, "compile_fx", compiler.inductor_refusing_hpu())
    with pytest.raises(Exception, match="Device hpu not supported"):
        torch.compile(lambda x: x + 1, backend="inductor")(torch.ones(2))


# ---- issue 28 item 2: vLLM's symbolic-shape compiled helpers -----------------------


def test_vllms_compiled_logprob_rank_fails_on_hpu_backend_and_the_patch_runs(
    habana: FakeHabana,
) -> None:
    import vllm.v1.sample.ops.logprobs as logprobs_ops

    # vLLM's helper as vLLM compiles it on HPU (backend=simple_compile_backend),
    # called after mark_unbacked as the sampler does.
    compiled = patches.REPLACED_HELPERS.get(  # an earlier test may have patched it
        "batched_count_greater_than", logprobs_ops.batched_count_greater_than
    )
    original = compiled._torchdynamo_orig_callable
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 11, generator=g).log_softmax(-1)
    chosen = scores.gather(-1, torch.tensor([[1], [4], [7]]))
    torch._dynamo.decorators.mark_unbacked(scores, 0)
    torch._dynamo.decorators.mark_unbacked(chosen, 0)
    with pytest.raises(Exception, match="Cannot convert symbols to int"):
        _hpu_compile(original)(scores, chosen)
    want = (scores >= chosen).sum(-1)
    assert torch.equal(patches.batched_count_greater_than(scores, chosen), want)


def test_vllms_compiled_vocab_mask_fails_on_hpu_backend_and_the_patch_runs(
    habana: FakeHabana,
) -> None:
    import vllm.model_executor.layers.vocab_parallel_embedding as embedding

    ids = torch.tensor([0, 5, 9, 12, 17, 20])
    args = (ids, 5, 10, 2, 16, 18)
    compiled = patches.REPLACED_HELPERS.get(
        "get_masked_input_and_mask", embedding.get_masked_input_and_mask
    )
    original = compiled._torchdynamo_orig_callable
    with pytest.raises(Exception, match="Cannot convert symbols to int"):
        _hpu_compile(original, dynamic=True)(*args)
    got = patches.get_masked_input_and_mask(*args)
    want = original(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_helpers_patch_applies_on_hpu_once_the_sampler_is_loaded(
    monkeypatch: pytest.MonkeyPatch, habana: FakeHabana
) -> None:
    import vllm.model_executor.layers.vocab_parallel_embedding as embedding
    import vllm.v1.sample.ops.logprobs as logprobs_ops
    import vllm.v1.sample.sampler as sampler

    for module, name in (
        (logprobs_ops, "batched_count_greater_than"),
        (sampler, "batched_count_greater_than"),
        (embedding, "get_masked_input_and_mask"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setattr(torch.accelerator, "empty_cache", torch.accelerator.empty_cache)
    monkeypatch.setattr(
        torch.accelerator, "empty_host_cache", torch.accelerator.empty_host_cache
    )
    patches.apply_patches()
    assert sampler.batched_count_greater_than is patches.batched_count_greater_than  # type: ignore[attr-defined]
    assert logprobs_ops.batched_count_greater_than is patches.batched_count_greater_than
    assert embedding.get_masked_input_and_mask is patches.get_masked_input_and_mask
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 9, generator=g).log_softmax(-1)
    out = sampler.Sampler.gather_logprobs(scores, 2, torch.tensor([3, 5]))
    assert out.selected_token_ranks.tolist() == [
        int((scores[r] >= scores[r, t]).sum()) for r, t in ((0, 3), (1, 5))
    ]


# ---- issue 28 item 1: torch.accelerator.empty_cache ---------------------------------


def test_the_bridge_refuses_accelerator_empty_cache_and_the_patch_skips_it(
    monkeypatch: pytest.MonkeyPatch, habana: FakeHabana
) -> None:
    monkeypatch.setattr(
        torch.accelerator, "empty_cache", stack._accelerator_empty_cache
    )
    monkeypatch.setattr(
        torch.accelerator, "empty_host_cache", torch.accelerator.empty_host_cache
    )
    with pytest.raises(
        RuntimeError, match="Allocator for hpu is not a DeviceAllocator"
    ):
        torch.accelerator.empty_cache()  # what vLLM's model loader calls
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setitem(sys.modules, "vllm.v1.sample.sampler", None)  # only item 1
    monkeypatch.delitem(sys.modules, "vllm.v1.sample.sampler")
    patches.apply_patches()
    torch.accelerator.empty_cache()
    torch.accelerator.empty_host_cache()


# ---- issue 28 item 3: xgrammar's bitmask kernel on card logits ----------------------


VOCAB = 40


def _bitmask_step() -> tuple[Any, Any, Any, torch.Tensor]:
    """vLLM's inputs to ``apply_grammar_bitmask``: rows ``a`` (constrained to
    tokens 0-4 and 33) and ``b`` (free), and their logits [2, VOCAB]."""
    import numpy as np

    allowed = np.zeros((1, 2), np.int32)  # [requests, ceil(VOCAB / 32)]
    allowed[0, 0] = 0b11111
    allowed[0, 1] = 0b10
    grammar_output = SimpleNamespace(
        structured_output_request_ids=["a"], grammar_bitmask=allowed
    )
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens={})
    batch = SimpleNamespace(req_ids=["a", "b"])
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    return scheduler_output, grammar_output, batch, logits


def _check_masked(got: torch.Tensor, before: torch.Tensor) -> None:
    kept = [0, 1, 2, 3, 4, 33]
    assert torch.equal(got[0, kept], before[0, kept])
    others = [i for i in range(VOCAB) if i not in kept]
    assert torch.isneginf(got[0, others]).all()
    assert torch.equal(got[1], before[1])  # the free row is untouched


@pytest.fixture
def card_xgrammar(monkeypatch: pytest.MonkeyPatch, habana: FakeHabana) -> FakeHabana:
    """xgrammar and Inductor as the simulated stack leaves them, with
    ``habana`` installed as the process's simulated Gaudi."""
    import torch._inductor.compile_fx as compile_fx
    import xgrammar

    from vllm_hpu_mm import gaudi_sim

    monkeypatch.setattr(compile_fx, "compile_fx", compiler.inductor_refusing_hpu())
    entry = grammar.on_card(xgrammar.apply_token_bitmask_inplace, habana.host_copies)
    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", entry)
    monkeypatch.setattr(gaudi_sim, "_installed", habana)
    return habana


def test_xgrammar_compiles_for_card_logits_and_masks_host_copies(
    card_xgrammar: FakeHabana,
) -> None:
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    scheduler_output, grammar_output, batch, logits = _bitmask_step()
    before = logits.clone()
    # Logits on the card: xgrammar's torch.compile(dynamic=True) kernel.
    with pytest.raises(Exception, match="Device hpu not supported"):
        apply_grammar_bitmask(scheduler_output, grammar_output, batch, logits)
    assert torch.equal(logits, before)
    # The device module's host copy: a new tensor, known to be on the host.
    host = device.to_host(logits, torch.float32)
    assert host is not logits and card_xgrammar.host_copies.holds(host)
    assert not card_xgrammar.host_copies.holds(logits)
    apply_grammar_bitmask(scheduler_output, grammar_output, batch, host)
    _check_masked(host, before)
    assert torch.equal(logits, before)  # a copy, not the card's tensor


def test_the_runner_applies_the_bitmask_to_a_host_copy_on_hpu(
    card_xgrammar: FakeHabana,
) -> None:
    from vllm_hpu_mm.worker.model_runner import HpuMMModelRunner

    scheduler_output, grammar_output, batch, logits = _bitmask_step()
    before = logits.clone()
    runner = SimpleNamespace(input_batch=batch)
    HpuMMModelRunner._apply_grammar_bitmask(
        runner,  # type: ignore[arg-type]
        scheduler_output,
        grammar_output,
        logits,
    )
    _check_masked(logits, before)  # written back into the card's logits


# ---- FusedSDPA's softmax modes (issue 28 item 6) ------------------------------------


def _attention_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 64, 32, generator=g) * 2
    k = torch.randn(2, 2, 256, 32, generator=g) * 2
    v = torch.randn(2, 2, 256, 32, generator=g)
    return q, k, v


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_fast_softmax_costs_accuracy_and_exact_modes_do_not() -> None:
    q, k, v = _attention_inputs()
    want = sdpa_native(q, k, v, None, True, None, True)
    errors = {
        mode: _rel_err(
            fused_sdpa(kernels.FusedSDPA, mode)(q, k, v, None, True, None, True), want
        )
        for mode in ("None", "fp32", "fast")
    }
    assert errors["None"] < 1e-5 and errors["fp32"] < 1e-5
    assert 1e-3 < errors["fast"] < 5e-2, errors


def test_softmax_mode_defaults_follow_the_official_plugin() -> None:
    assert fused_softmax_mode("auto", "llama") == "fast"
    assert fused_softmax_mode("auto", "qwen2_5_vl") == "fp32"
    assert fused_softmax_mode("auto", "qwen2") == "fp32"
    assert fused_softmax_mode("auto", "mllama") is None  # PyTorch's SDPA
    assert fused_softmax_mode("exact", "mllama") == "None"
    assert fused_softmax_mode("fp32", "llama") == "fp32"


def test_the_backend_takes_the_models_softmax_mode(habana: FakeHabana) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_hpu_mm.attention.backend import HpuMMAttentionImpl

    q, k, v = _attention_inputs()
    want = sdpa_native(q, k, v, None, True, None, True)
    config = VllmConfig(
        additional_config={"hpu_mm": {"fused": {"softmax_mode": "exact"}}}
    )
    with set_current_vllm_config(config):
        impl = HpuMMAttentionImpl(num_heads=4, head_size=32, scale=0.2, num_kv_heads=2)
    assert _rel_err(impl.sdpa(q, k, v, None, True, None, True), want) < 1e-5


# ---- the card's memory statistics ---------------------------------------------------


def test_card_memory_counts_the_live_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    hpu = card.SimHost(memory=2**34).process("worker")
    hpu.reset_peak_memory_stats()
    start = hpu.memory_allocated()
    block = torch.empty(16 * 2**20, dtype=torch.uint8)  # 16 MiB
    view = block[4:]  # a view adds nothing
    assert hpu.memory_allocated() - start == 16 * 2**20
    free, total = hpu.mem_get_info()
    assert total == 2**34 and free == total - hpu.memory_allocated()
    del block, view
    assert hpu.memory_allocated() == start
    assert hpu.max_memory_allocated() >= start + 16 * 2**20
    hpu.reset_peak_memory_stats()
    assert hpu.max_memory_allocated() == start


def test_card_memory_counts_parameter_subclasses_not_fake_tensors() -> None:
    """vLLM's linear weights are ``torch.nn.Parameter`` subclasses
    (``ModelWeightParameter``, keeping PyTorch's dispatch): on the card as any
    weight. Dynamo's fake tensors (their own ``__torch_dispatch__``) are not."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from vllm.model_executor.parameter import ModelWeightParameter

    assert issubclass(ModelWeightParameter, torch.nn.Parameter)
    assert ModelWeightParameter.__torch_dispatch__ is torch.Tensor.__torch_dispatch__

    class WeightParameter(torch.nn.Parameter):  # as vLLM's, without its TP state
        pass

    mib = 2**20
    hpu = card.SimHost(memory=2**34).process("worker")
    # The card counts the live tensors the garbage collector tracks: tensors in
    # unreachable reference cycles (an earlier test's) count until a
    # collection, which must not fall between two readings.
    gc.collect()
    gc.disable()
    try:
        start = hpu.memory_allocated()
        weight = WeightParameter(
            torch.empty(mib, dtype=torch.float32), requires_grad=False
        )
        assert hpu.memory_allocated() - start == 4 * mib
        with FakeTensorMode():
            fake = torch.empty(8 * mib, dtype=torch.uint8)
        assert hpu.memory_allocated() - start == 4 * mib
        del weight, fake
    finally:
        gc.enable()


def test_card_memory_reads_past_dead_weak_proxies() -> None:
    """The garbage collector's objects include dead weak proxies (vLLM's engine
    holds some), on which ``isinstance`` raises ReferenceError."""
    import weakref

    class Holder:
        pass

    holder = Holder()
    proxy = weakref.proxy(holder)
    del holder
    hpu = card.SimHost(memory=2**34).process("worker")
    assert hpu.memory_allocated() >= 0
    del proxy


def test_card_peak_sees_activations_freed_before_it_is_read() -> None:
    """As the real allocator's ``max_memory_allocated`` (the maximum memory
    occupied by tensors since ``reset_peak_memory_stats``): a step's
    activations freed before the peak is read still count, as they do when a
    memory profile sizes the KV cache (``worker.profile.device_meter``)."""
    mib = 2**20
    hpu = card.SimHost(memory=2**34).process("worker")
    hpu.reset_peak_memory_stats()
    start = hpu.memory_allocated()
    kept = torch.ones(mib, dtype=torch.float32)  # 4 MiB, alive at the read

    def step() -> float:
        big = kept.repeat(4)  # 16 MiB
        return float((big * 2).sum())  # and 16 MiB more while big is alive

    step()
    assert hpu.memory_allocated() == start + 4 * mib
    peak = hpu.max_memory_allocated() - start
    assert 36 * mib <= peak <= 36 * mib + 64, peak  # + the sum's scalar
    # The read closes the window: a reset starts afresh from what is alive.
    hpu.reset_peak_memory_stats()
    assert hpu.max_memory_allocated() == start + 4 * mib


def test_card_out_of_memory_says_how_much() -> None:
    hpu = card.SimHost(memory=2**20).process("worker")
    keep = torch.empty(2 * 2**20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"out of memory: .* GiB card"):
        hpu.memory_allocated()
    del keep


@pytest.mark.parametrize(
    ("given", "size"), [("", card.DEFAULT_MEMORY), ("8G", 8 * 2**30), ("512MiB", 2**29)]
)
def test_card_size_from_env(
    monkeypatch: pytest.MonkeyPatch, given: str, size: int
) -> None:
    monkeypatch.setenv(card.MEMORY_ENV, given)
    assert card.card_memory_from_env() == size


def test_card_size_error_shows_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(card.MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match="'lots' is not a size"):
        card.card_memory_from_env()


# ---- float16 checkpoints (issue 28 item 7) ------------------------------------------


def test_float16_is_served_as_bfloat16_on_hpu() -> None:
    from vllm_hpu_mm.platform import _force_bfloat16

    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float16))
    _force_bfloat16(config)  # type: ignore[arg-type]
    assert config.model_config.dtype == torch.bfloat16
    config.model_config.dtype = torch.float32
    _force_bfloat16(config)  # type: ignore[arg-type]
    assert config.model_config.dtype == torch.float32


# ---- the whole process (fresh interpreters) -----------------------------------------

_PROCESS = """
import torch, vllm_hpu_mm
from vllm_hpu_mm import device, gaudi_sim
print("PLATFORM", vllm_hpu_mm.register())
from vllm.platforms import current_platform
print("DISPATCH", current_platform.dispatch_key)
print("KIND", device.device_kind(), device.torch_device(), device.simulated())
print("HPU", type(torch.hpu).__name__, device.compile_backend())
torch.accelerator.empty_cache()  # patched on HPU by register()
import torch.distributed as dist
print("HCCL", "hccl" in dist.Backend.backend_list)
import sys
print("XGRAMMAR LOADED", "xgrammar" in sys.modules)
import xgrammar
entry = xgrammar.apply_token_bitmask_inplace
print("XGRAMMAR WRAPPED", hasattr(entry, "__sim_wrapped__"))
"""


def _fresh(
    code: str, env: dict[str, str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO_ROOT}", **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_environment_installs_the_simulated_gaudi(tmp_path: Path) -> None:
    env = {"VLLM_HPU_MM_DEVICE": "hpu", "VLLM_HPU_MM_GAUDI_SIM": "1"}
    proc = _fresh(_PROCESS, env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "PLATFORM vllm_hpu_mm.platform.SimulatedHpuMMPlatform" in out
    assert "DISPATCH CPU" in out  # the simulated card computes on host tensors
    assert "KIND hpu cpu True" in out
    assert "HPU SimTorchHpu hpu_backend" in out
    assert "HCCL True" in out
    # xgrammar is wrapped when vLLM first imports it, not imported before.
    assert "XGRAMMAR LOADED False" in out
    assert "XGRAMMAR WRAPPED True" in out


def test_a_real_habana_install_keeps_the_simulation_out(tmp_path: Path) -> None:
    (tmp_path / "habana_frameworks").mkdir()
    (tmp_path / "habana_frameworks" / "__init__.py").write_text("")
    code = (
        "from vllm_hpu_mm import device, gaudi_sim\n"
        "try:\n    device.select_device()\nexcept device.DeviceError as e:\n"
        "    print('ERR', e)\nprint('SIM', gaudi_sim.installed())\n"
        "import xgrammar\nentry = xgrammar.apply_token_bitmask_inplace\n"
        "print('WRAPPED', hasattr(entry, '__sim_wrapped__'))\n"
    )
    env = {"VLLM_HPU_MM_DEVICE": "hpu", "VLLM_HPU_MM_GAUDI_SIM": "1"}
    proc = _fresh(code, env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIM None" in proc.stdout
    assert "ERR" in proc.stdout  # the (broken) real stack is used, not replaced
    assert "WRAPPED False" in proc.stdout


# ---- issue 28 item 10: lazy-mode collectives, synchronised weight loads ------------


@pytest.fixture
def hccl_group(tmp_path: Path) -> Iterator[Any]:
    """A one-rank ``hccl`` group (gloo underneath, as the simulated stack
    registers it)."""
    import torch.distributed as dist

    stack._register_hccl_as_gloo()
    dist.init_process_group(
        "hccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_lazy_collectives_need_the_graph_cut_before_each(
    habana: FakeHabana, hccl_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In lazy mode a collective on an uncut graph is refused; the plugin's
    communicator marks a step before each (vLLM's base one does not)."""
    import torch.distributed as dist
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    from vllm_hpu_mm.communicator import HpuMMCommunicator
    from vllm_hpu_mm.gaudi_sim.collectives import UncutLazyCollective
    from vllm_hpu_mm.platform import HpuMMPlatform

    for name, fn in habana.collectives.wrappers().items():
        monkeypatch.setattr(dist, name, fn)
    habana.lazy = True
    cpu = torch.device("cpu")
    base = DeviceCommunicatorBase(hccl_group, cpu, hccl_group)
    with pytest.raises(UncutLazyCollective, match="mark_step"):
        base.all_reduce(torch.ones(3))
    assert HpuMMPlatform.get_device_communicator_cls().endswith("HpuMMCommunicator")
    ours = HpuMMCommunicator(hccl_group, cpu, hccl_group)
    x = torch.ones(3)
    assert torch.equal(ours.all_reduce(x), x)
    assert ours.all_gather(x, 0).shape == (3,)
    assert torch.equal(ours.all_reduce(x), x)
    assert habana.collectives.checked == 4
    habana.lazy = False  # eager mode: no cut needed
    base.all_reduce(x)
    assert habana.collectives.checked == 4


def test_weight_loaders_synchronise_the_card_on_hpu(
    habana: FakeHabana, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM wraps every ``weight_loader`` attribute with the platform's synced
    loader where ``use_sync_weight_loader``: on HPU each load ends with a
    device synchronisation."""
    import vllm.model_executor.utils as vllm_utils
    import vllm.platforms
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from vllm_hpu_mm.platform import HpuMMPlatform

    monkeypatch.setattr(vllm.platforms, "_current_platform", HpuMMPlatform())
    param = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    vllm_utils.set_weight_attrs(param, {"weight_loader": default_weight_loader})
    before = habana.hpu.calls.count("synchronize")
    param.weight_loader(param, torch.arange(4.0))  # type: ignore[attr-defined]
    assert torch.equal(param.data, torch.arange(4.0))
    assert habana.hpu.calls.count("synchronize") == before + 1
