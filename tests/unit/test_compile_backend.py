"""Graph mode's torch.compile backend (``hpu_mm.warmup.compile_backend``):
``aot_eager`` by default on the CPU's static plan, Inductor elsewhere off
Gaudi, ``hpu_backend`` on Gaudi; the ``aot_eager`` backend writes the KV cache
in place, gives eager's values, and compiles one graph per static shape; the
warmup's progress lines."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hpu_kernels.attention import KVCache, write_kv
from vllm_hpu_mm import device as dev
from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.plan import build_plan
from vllm_hpu_mm.worker import graphs
from vllm_hpu_mm.worker.graphs import AOT_EAGER, CompileCounter, choose_backend
from vllm_hpu_mm.worker.warmup import WarmupProgress


def plan(execution: str, kind: str, graph_mode: str = "compile") -> Any:
    config = HpuMMConfig.from_mapping(
        {"execution": execution, "graph_mode": graph_mode}, source="a test"
    )
    return build_plan(config, kind, enforce_eager=False)


@pytest.mark.parametrize(
    ("execution", "kind", "want"),
    [
        ("static", "cpu", AOT_EAGER),  # every step shape a graph: no C++ per graph
        ("dynamic", "cpu", "inductor"),
        ("auto", "cpu", "inductor"),  # auto is dynamic on the CPU
        ("static", "cuda", "inductor"),
        ("dynamic", "cuda", "inductor"),
    ],
)
def test_auto_backend_off_gaudi(execution: str, kind: str, want: str) -> None:
    assert choose_backend(plan(execution, kind)) == want


@pytest.mark.parametrize("configured", ["inductor", AOT_EAGER])
@pytest.mark.parametrize("execution", ["static", "dynamic"])
def test_configured_backend_wins_off_gaudi(configured: str, execution: str) -> None:
    assert choose_backend(plan(execution, "cpu"), configured) == configured


def test_gaudi_compiles_with_hpu_backend_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "compile_backend", lambda: "hpu_backend")
    for execution in ("static", "dynamic", "auto"):
        assert choose_backend(plan(execution, "hpu")) == "hpu_backend"
    with pytest.raises(RuntimeError, match="hpu_backend only"):
        choose_backend(plan("static", "hpu"), AOT_EAGER)


def test_backend_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="compile_backend"):
        HpuMMConfig.from_mapping(
            {"warmup": {"compile_backend": "eager"}}, source="a test"
        )


ROWS, HEADS, DIM = 4096, 2, 16


def _step(k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, slots: torch.Tensor):
    # A layer's shape of work: project, write K/V into the cache, read it back.
    key = torch.tanh(x).view(-1, HEADS, DIM)
    value = (x * 2).view(-1, HEADS, DIM)
    write_kv(KVCache(k, v, 16), key, value, slots)
    rows = k.index_select(0, slots) + v.index_select(0, slots)
    return torch.softmax(rows.flatten(1) @ x.T, dim=-1)


def _whole_cache_writes(gm: torch.fx.GraphModule) -> list[str]:
    """What in a lowered graph copies a whole graph input on every call: the
    custom op's functional form (it clones the tensors it writes), a clone of
    an input, a ``copy_`` back into one."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        copies = (torch.ops.aten.copy_.default, torch.ops.aten.clone.default)
        if "auto_functionalized" in str(node.target):
            found.append(str(node.target))
        elif node.target in copies and node.args[0].op == "placeholder":
            found.append(f"{node.target} of {node.args[0]}")
    return found


def _run(backend: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(rows)
    k = torch.zeros(ROWS, HEADS, DIM)
    v = torch.zeros(ROWS, HEADS, DIM)
    x = torch.randn(rows, HEADS * DIM)
    slots = torch.randperm(ROWS)[:rows]
    fn = _step
    if backend is not None:
        fn = torch.compile(_step, backend=backend, dynamic=False)
    k_ptr = k.data_ptr()
    with torch.inference_mode():
        out = fn(k, v, x, slots)
    assert k.data_ptr() == k_ptr
    return out, torch.cat([k, v])


def test_aot_eager_writes_the_cache_in_place_with_eagers_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lowered: list[torch.fx.GraphModule] = []
    passes = graphs._reinplaced

    def spy(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiled = passes(gm, example_inputs)
        lowered.append(gm)
        return compiled

    monkeypatch.setattr(graphs, "_reinplaced", spy)
    torch._dynamo.reset()
    want, want_cache = _run(None, 8)
    got, cache = _run(graphs.aot_eager_backend, 8)
    assert torch.equal(got, want) and torch.equal(cache, want_cache)
    (gm,) = lowered
    targets = [str(n.target) for n in gm.graph.nodes]
    assert "hpu_mm.write_kv.default" in targets  # the KV write, in place
    assert _whole_cache_writes(gm) == []
    # Without the passes (torch's own aot_eager), the lowered graph keeps the
    # custom op's functional form and copies each cache back on every call.
    monkeypatch.setattr(graphs, "_reinplaced", _unpassed(lowered))
    torch._dynamo.reset()
    plain, plain_cache = _run(graphs.aot_eager_backend, 8)
    assert torch.equal(plain, want) and torch.equal(plain_cache, want_cache)
    writes = _whole_cache_writes(lowered[-1])
    assert any("auto_functionalized" in w for w in writes), writes
    assert sum("copy_" in w for w in writes) == 2, writes  # K and V


def _unpassed(lowered: list[torch.fx.GraphModule]) -> Any:
    from functorch.compile import make_boxed_func

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        lowered.append(gm)
        return make_boxed_func(gm.forward)

    return compile_graph


def test_counter_compiles_one_aot_eager_graph_per_static_shape() -> None:
    torch._dynamo.reset()
    counter = CompileCounter(AOT_EAGER)
    fn = torch.compile(_step, backend=counter, dynamic=False)
    k = torch.zeros(ROWS, HEADS, DIM)
    v = torch.zeros(ROWS, HEADS, DIM)
    with torch.inference_mode():
        for rows in (4, 8, 4, 8, 16):
            x = torch.randn(rows, HEADS * DIM)
            slots = torch.arange(rows)
            torch.testing.assert_close(
                fn(k, v, x, slots), _step(k, v, x, slots), rtol=0, atol=0
            )
    assert counter.count == 3  # 4, 8 and 16 rows: a graph each, none symbolic


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_say_shapes_done_and_time_left() -> None:
    clock = _Clock()
    progress = WarmupProgress(10, every_s=30.0, clock=clock)
    clock.now += 10.0
    assert progress.step() is None  # too soon after the start
    clock.now += 10.0
    assert progress.step() is None
    clock.now += 10.0
    assert progress.step() == "Warmup: 3/10 shapes in 30 s, about 70 s left"
    for _ in range(6):
        clock.now += 4.0
        assert progress.step() is None
    clock.now += 6.0
    # The last shape always logs, with nothing left.
    assert progress.step() == "Warmup: 10/10 shapes in 60 s, about 0 s left"


def _writes_through_views(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Writes into slices of a fresh tensor: functionalised into scatters,
    # which the reinplacing passes rebuild under the graph's fake mode.
    t = x.clone()
    t[1] = y
    t[:, 2:4].mul_(3)
    return t * 2


def test_aot_eager_takes_writes_through_views() -> None:
    torch._dynamo.reset()
    fn = torch.compile(
        _writes_through_views, backend=graphs.aot_eager_backend, dynamic=False
    )
    x, y = torch.randn(4, 6), torch.randn(6)
    with torch.inference_mode():
        assert torch.equal(fn(x, y), _writes_through_views(x, y))
