"""Gaudi's fused RoPE for every rotary class the plugin registers (issue 29 item 3).

vLLM's scaled RoPE variants (Llama 3, linear, NTK, dynamic NTK, YaRN) and M-RoPE
(Qwen2.5-VL's consecutive sections, Qwen3-VL's interleaved ones) differ from
plain RoPE only in how cos/sin are built; through the simulated stack
(``vllm_hpu_mm.gaudi_sim``: ``apply_rotary_pos_emb`` with Habana's signature and
its full-width cos/sin rule) each must give vLLM's own ``forward_native``:
float32 exactly, bfloat16 within one bfloat16 spacing at the outputs' scale.
cos/sin are gathered once per step (``StepRope``), not once per layer: counted
with a dispatch mode, and compiled through the simulated ``hpu_backend`` with
``fullgraph=True`` (no graph break) and no recompilation from step to step.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.config import CompilationConfig
from vllm.model_executor import custom_op
from vllm.model_executor.layers.rotary_embedding.dynamic_ntk_alpha_rope import (
    DynamicNTKAlphaRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.dynamic_ntk_scaling_rope import (
    DynamicNTKScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
    LinearScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.llama3_rope import (
    Llama3RotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.mrope import (
    MRotaryEmbedding,
    apply_interleaved_rope,
)
from vllm.model_executor.layers.rotary_embedding.ntk_scaling_rope import (
    NTKScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import (
    YaRNScalingRotaryEmbedding,
)

from hpu_kernels.fused import mrope_channel_rows
from tests.fakes.habana import FakeHabana, cpu_only_host
from vllm_hpu_mm import device
from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.fused_ops import FUSED_OPS, StepRope, register_fused_ops
from vllm_hpu_mm.gaudi_sim import compiler
from vllm_hpu_mm.plan import build_plan
from vllm_hpu_mm.platform_config import _enable_fused_ops
from vllm_hpu_mm.worker.graphs import GraphRunner

HEAD, KV_HEADS, Q_HEADS = 16, 2, 4


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with cpu_only_host(monkeypatch):
        yield


@pytest.fixture
def habana(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHabana]:
    """The simulated Habana stack, with the kernel's calls counted."""
    fake = FakeHabana().install(monkeypatch)
    device.select_device.cache_clear()
    kernels = fake.modules["habana_frameworks.torch.hpex.kernels"]
    real = kernels.apply_rotary_pos_emb  # type: ignore[attr-defined]
    fake.rope_calls = 0  # type: ignore[attr-defined]

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            fake.rope_calls += 1  # type: ignore[attr-defined]
        return real(*args, **kwargs)  # type: ignore[no-any-return]

    kernels.apply_rotary_pos_emb = counting  # type: ignore[attr-defined]
    yield fake
    fake.uninstall()


@pytest.fixture
def fused(habana: FakeHabana, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's op registry with the fused ops registered and enabled as the HPU
    platform and worker do; restored afterwards."""
    saved = dict(custom_op.op_registry_oot)
    config = SimpleNamespace(compilation_config=CompilationConfig(custom_ops=["none"]))
    _enable_fused_ops(config, "hpu")  # type: ignore[arg-type]
    compilation = config.compilation_config
    monkeypatch.setattr(custom_op, "get_cached_compilation_config", lambda: compilation)
    register_fused_ops()
    yield
    custom_op.op_registry_oot.clear()
    custom_op.op_registry_oot.update(saved)


def _ropes(dtype: torch.dtype) -> dict[str, Any]:
    """One layer of each class, as ``get_rope`` builds them (head 16, rotary
    16 or a partial 8, neox and GPT-J styles, 64 positions)."""
    return {
        "llama3": Llama3RotaryEmbedding(
            HEAD, HEAD, 64, 500000.0, True, dtype, 8.0, 1.0, 4.0, 32
        ),
        "linear": LinearScalingRotaryEmbedding(
            HEAD, HEAD, 32, 10000.0, True, 2.0, dtype
        ),
        "dynamic_ntk": DynamicNTKScalingRotaryEmbedding(
            HEAD, 8, 64, 32, 10000.0, True, 2.0, dtype
        ),
        "dynamic_ntk_alpha": DynamicNTKAlphaRotaryEmbedding(
            HEAD, HEAD, 64, 10000.0, False, 2.0, dtype
        ),
        "ntk": NTKScalingRotaryEmbedding(HEAD, HEAD, 64, 10000.0, True, 2.0, dtype),
        "yarn": YaRNScalingRotaryEmbedding(HEAD, HEAD, 32, 10000.0, True, 2.0, dtype),
        "mrope": MRotaryEmbedding(
            HEAD, HEAD, 16, 10000.0, True, dtype, mrope_section=[2, 3, 3]
        ),
        "mrope_interleaved": MRotaryEmbedding(
            HEAD,
            HEAD,
            16,
            10000.0,
            True,
            dtype,
            mrope_section=[2, 3, 3],
            mrope_interleaved=True,
        ),
    }


def _inputs(
    name: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name.startswith("mrope"):
        # [3, T]: T/H/W rows that differ (an image's grid), in the cache's range
        positions = torch.stack(
            [torch.tensor([0, 3, 3, 3, 9, 10]), torch.arange(6), torch.arange(6) % 2]
        )
    else:
        positions = torch.tensor([0, 3, 7, 63, 5, 31])
    t = positions.shape[-1]
    query = torch.randn(t, Q_HEADS * HEAD, generator=g).to(dtype)
    key = torch.randn(t, KV_HEADS * HEAD, generator=g).to(dtype)
    return positions, query, key


# Measured: the simulated kernel gives vLLM's values bit for bit in both dtypes.
# float32 exact; bfloat16 within one bfloat16 spacing at the outputs' scale
# (|q| < 8: 2^-5), room for the card's own multiply-add order.
TOLERANCE = {
    torch.float32: {"rtol": 0.0, "atol": 0.0},
    torch.bfloat16: {"rtol": 0.0, "atol": 2**-5},
}


ROPE_NAMES = [
    "llama3",
    "linear",
    "dynamic_ntk",
    "dynamic_ntk_alpha",
    "ntk",
    "yarn",
    "mrope",
    "mrope_interleaved",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ROPE_NAMES)
def test_each_rope_class_runs_the_fused_kernel_as_vllm_computes(
    fused: None, habana: FakeHabana, name: str, dtype: torch.dtype
) -> None:
    ropes = _ropes(dtype)
    assert list(ropes) == ROPE_NAMES
    rope = ropes[name]
    assert type(rope) in FUSED_OPS.values()  # the registered subclass, built by vLLM
    assert rope._forward_method == rope.forward_oot
    positions, query, key = _inputs(name, dtype)
    calls = habana.rope_calls  # type: ignore[attr-defined]
    got_q, got_k = rope(positions, query.clone(), key.clone())
    assert habana.rope_calls == calls + 2  # type: ignore[attr-defined]
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())
    torch.testing.assert_close(got_q, want_q, **TOLERANCE[dtype])
    torch.testing.assert_close(got_k, want_k, **TOLERANCE[dtype])


@pytest.mark.parametrize("name", ["mrope", "mrope_interleaved"])
def test_mrope_with_text_positions_is_plain_rope(
    fused: None, habana: FakeHabana, name: str
) -> None:
    rope = _ropes(torch.float32)[name]
    positions, query, key = _inputs("text", torch.float32)
    positions = positions % 16
    got = rope(positions, query.clone(), key.clone())
    want = rope.forward_native(positions, query.clone(), key.clone())
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("section", [[2, 3, 3], [4, 2, 2], [24, 20, 20], [16, 24, 24]])
def test_mrope_channel_rows_are_vllms_section_pick(section: list[int]) -> None:
    half = sum(section)
    # row r of the picked tensor holds r everywhere: the pick shows the row read
    rows = torch.arange(3)[:, None].expand(3, half)
    interleaved = apply_interleaved_rope(rows, section)
    assert mrope_channel_rows(section, True, half) == interleaved.tolist()
    chunks = rows.split(section, dim=-1)
    consecutive = torch.cat([m[i] for i, m in enumerate(chunks)])
    assert mrope_channel_rows(section, False, half) == consecutive.tolist()


def test_mrope_channel_rows_refuse_sections_that_miss_the_width() -> None:
    with pytest.raises(ValueError, match=r"sum to 7, but rotary_dim / 2 = 8"):
        mrope_channel_rows([2, 2, 3], False, 8)


# ---- once per step ----------------------------------------------------------------


class _Stack(torch.nn.Module):
    """A decoder stack's RoPE use: ``layers`` layers share one rotary module
    (as vLLM's ``get_rope`` hands it out) and each rotates its own q/k."""

    def __init__(self, rope: torch.nn.Module, layers: int) -> None:
        super().__init__()
        self.rotary_emb = rope
        self.proj = torch.nn.ModuleList(
            torch.nn.Linear(HEAD, (Q_HEADS + KV_HEADS) * HEAD, bias=False)
            for _ in range(layers)
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert inputs_embeds is not None
        out = inputs_embeds
        for proj in self.proj:
            q, k = proj(out).split([Q_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
            q, k = self.rotary_emb(positions, q, k)
            out = out + q[:, :HEAD] + k[:, :HEAD]
        return out


class _Gathers(TorchDispatchMode):
    """Counts the gathers from a cos/sin cache (``index_select`` rows of a
    floating tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.index_select.default and args[0].is_floating_point():
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama3", "mrope_interleaved"])
def test_cos_sin_are_gathered_once_per_step_not_per_layer(
    fused: None, habana: FakeHabana, name: str
) -> None:
    """Four layers: four gathers when the model is called bare, one through
    the graph runner's body (eager graph mode), same outputs."""
    torch.manual_seed(0)
    model = _Stack(_ropes(torch.float32)[name], layers=4)
    positions, _, _ = _inputs(name, torch.float32)
    embeds = torch.randn(positions.shape[-1], HEAD)
    eager = HpuMMConfig(execution="static", graph_mode="eager")
    runner = GraphRunner(model, build_plan(eager, "hpu", True), "eager")
    assert runner.rope.modules == [model.rotary_emb]
    with torch.no_grad():
        with _Gathers() as bare:
            want = model(None, positions, embeds)
        with _Gathers() as stepped:
            got = runner.body(None, positions, embeds)
    assert (bare.count, stepped.count) == (4, 1)
    assert model.rotary_emb.step_cos_sin is None  # dropped after the step
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compiled_layers_take_the_steps_cos_sin_without_a_break_or_recompile(
    fused: None, habana: FakeHabana
) -> None:
    """One decoder layer compiled through the simulated ``hpu_backend``
    (``fullgraph``: a graph break fails), as the regional graphs are: with the
    step's cos/sin prepared the graph gathers nothing from the cache; a next
    step (new positions, new cos/sin tensors of the same shape) reuses it."""
    torch.manual_seed(0)
    model = _Stack(_ropes(torch.float32)["mrope_interleaved"], layers=2)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        from torch._dynamo import lookup_backend

        return lookup_backend(device.compile_backend())(gm, example_inputs)

    def layer(proj: torch.nn.Module, positions: torch.Tensor, x: torch.Tensor) -> Any:
        q, k = proj(x).split([Q_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
        return model.rotary_emb(positions, q, k)

    compiled = torch.compile(layer, backend=backend, dynamic=False, fullgraph=True)
    steps = StepRope([model])
    before = compiler.Compilations.count
    positions, _, _ = _inputs("mrope", torch.float32)
    x = torch.randn(positions.shape[-1], HEAD)
    with torch.no_grad():
        for step in range(2):
            pos = positions + step  # the next step's positions
            with steps.step(pos):
                for proj in model.proj:
                    got = compiled(proj, pos, x)
                    q, k = proj(x).split([Q_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
                    want = model.rotary_emb.forward_native(pos, q, k)
                    torch.testing.assert_close(got[0], want[0])
                    torch.testing.assert_close(got[1], want[1])
    assert len(graphs) == 1 and compiler.Compilations.count == before + 1
    targets = {str(n.target) for n in graphs[0].graph.nodes}
    assert not any("index_select" in t or "gather" in t for t in targets), targets


def test_a_plain_rope_beside_mrope_is_left_to_itself(
    fused: None, habana: FakeHabana
) -> None:
    """A Qwen-VL model holds a plain rotary module besides the text model's
    M-RoPE (the vision tower's, which reads its cache itself): a step's
    ``[3, T]`` positions prepare the M-RoPE module only, and the plain one
    still rotates ``[T]`` positions as vLLM does."""
    ropes = _ropes(torch.float32)
    mrope, plain = ropes["mrope"], ropes["llama3"]
    steps = StepRope([torch.nn.ModuleList([mrope, plain])])
    assert steps.modules == [mrope, plain]
    positions, query, key = _inputs("mrope", torch.float32)
    with steps.step(positions):
        assert mrope.step_cos_sin is not None and plain.step_cos_sin is None
        got = plain(positions[0], query.clone(), key.clone())
    want = plain.forward_native(positions[0], query.clone(), key.clone())
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
