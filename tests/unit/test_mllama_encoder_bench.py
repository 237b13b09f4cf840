"""benchmarks/mllama_encoder.py on tiny shapes: op-level counts where the ops
run, and the script's four variants in one table.

The counts come from the benchmark's own counters, on the tiny shapes of
``--quick``: eager, every aten op under a dispatch mode; graph mode, the
functionalized ATen graph aot_autograd makes of the call (what Inductor and
hpu_backend receive) plus the copy back of a mutated input. The buffer path must
move no more bytes than tuple+stack and copy no tensor holding more than one
layer's states; the seed's graph-mode form (the buffer as a mutated graph input)
and tuple+stack show that the counter does see such copies. Timings are
reported, never asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "mllama_encoder.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mllama_encoder_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mllama_bench") / "report.json"
    args = ["--quick", "--reps", "1", "--reuse-compile-cache", "--output-json"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data: dict[str, Any] = json.loads(out.read_text())
    data["stdout"] = proc.stdout
    return data


@pytest.fixture(scope="module")
def counts() -> dict[tuple[str, str], Any]:
    """(layout, mode) -> OpCount, counted in this process on --quick shapes."""
    import torch

    bench = _bench()
    s = bench.QUICK
    torch.manual_seed(0)
    vision, inputs = bench.build(s, torch.float32, torch.device("cpu"), 0)
    hf_proj, proj = bench.build_projectors(s, vision, torch.float32, "cpu", 0)
    kept = len(bench.scaled_intermediate(s.layers))
    rows = s.images * s.tiles * vision.num_patches
    geometry = bench.StatesGeometry(vision.hidden, kept, rows * vision.hidden)
    out: dict[tuple[str, str], Any] = {}
    for layout in ("stack", "buffer"):
        module = bench.encode_module(layout, vision, hf_proj, proj)
        args = bench.variant_args(layout, "eager", vision, inputs)
        counter = bench.eager_counter(geometry)
        with torch.no_grad(), counter:
            module(*args)
        out[layout, "eager"] = counter.count
        args = bench.variant_args(layout, "graph", vision, inputs)
        out[layout, "graph"] = bench.graph_count(module, args, geometry)
    module = bench.encode_module("buffer", vision, hf_proj, proj)
    args = bench.variant_args("buffer-input", "graph", vision, inputs)
    out["buffer-input", "graph"] = bench.graph_count(module, args, geometry)
    return out


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_buffer_path_copies_no_states_and_moves_fewer_bytes(
    counts: dict[tuple[str, str], Any], mode: str
) -> None:
    stack, buf = counts["stack", mode], counts["buffer", mode]
    assert buf.whole_buffer_copies == []
    assert buf.copied_bytes <= stack.copied_bytes
    assert buf.allocated_bytes <= stack.allocated_bytes
    assert "stack" not in buf.copy_ops
    # The counter sees the concatenation of the stacked layers.
    assert stack.copy_ops["stack"] == 1
    assert any(w.startswith("cat of") for w in stack.whole_buffer_copies)


def test_graph_mode_makes_the_buffer_with_one_cat(
    counts: dict[tuple[str, str], Any],
) -> None:
    buf = counts["buffer", "graph"]
    # The CLS-row cat and the buffer's; no in-place write survives, no scatter
    # of the states (the one slice_scatter is the tile-mask's, a [1, 4, 8] one).
    assert buf.copy_ops["cat"] == 2
    assert "copy_" not in buf.copy_ops and "index_put" not in buf.copy_ops
    assert buf.copy_ops["slice_scatter"] <= 1


def test_seed_form_is_seen_scattering_the_whole_buffer(
    counts: dict[tuple[str, str], Any],
) -> None:
    """The buffer passed into the graph and written there (the seed's form):
    functionalization scatters the whole buffer per write and copies it back."""
    seed = counts["buffer-input", "graph"]
    kept = len(_bench().scaled_intermediate(_bench().QUICK.layers))
    scatters = [w for w in seed.whole_buffer_copies if w.startswith("slice_scatter")]
    assert len(scatters) == kept + 1  # each kept layer and the global output
    assert any(w.startswith("copy_ of") for w in seed.whole_buffer_copies)
    assert seed.copied_bytes > counts["buffer", "graph"].copied_bytes


def test_projector_slice_copy_is_seen() -> None:
    """The seed's projector input, a non-contiguous slice of the padded rows:
    the eager counter sees the matmul copy it whole."""
    import torch

    bench = _bench()
    geometry = bench.StatesGeometry(hidden=4, kept=2, layer_numel=2 * 5 * 4)
    states = torch.randn(2, 1, 8, 12)  # [N, tiles, padded, hidden * (1 + K)]
    proj = torch.nn.Linear(12, 3)
    counter = bench.eager_counter(geometry)
    with torch.no_grad(), counter:
        proj(states[:, :, :5])
    assert counter.count.whole_buffer_copies == ["clone of [2, 1, 5, 12]"]
    counter = bench.eager_counter(geometry)
    with torch.no_grad(), counter:
        proj(states)
    assert counter.count.whole_buffer_copies == []
    assert counter.count.total_copies == 0


def _variant(report: dict[str, Any], layout: str, mode: str) -> dict[str, Any]:
    (row,) = [
        r for r in report["results"] if r["layout"] == layout and r["mode"] == mode
    ]
    return row


def test_intermediate_layers_scale_from_32() -> None:
    bench = _bench()
    assert bench.scaled_intermediate(32) == [3, 7, 15, 23, 30]
    assert bench.scaled_intermediate(5) == [0, 1, 2, 3, 4]
    assert bench.scaled_intermediate(8) == [0, 1, 3, 5, 7]
    assert bench.scaled_intermediate(2) == [0, 1]  # floor gives 0,0,0,1,1


def test_aspect_ratios_match_transformers_default() -> None:
    from transformers import MllamaVisionConfig

    bench = _bench()
    assert bench.aspect_ratios(4) == MllamaVisionConfig().supported_aspect_ratios
    assert bench.aspect_ratios(1) == [[1, 1]]


def test_four_variants_in_one_table(report: dict[str, Any]) -> None:
    kinds = {(r["layout"], r["mode"]) for r in report["results"]}
    assert kinds == {
        (lo, m) for lo in ("stack", "buffer") for m in ("eager", "graph")
    } | {("buffer-input", "graph")}
    out = report["stdout"]
    assert "| variant | ms / image |" in out
    for r in report["results"]:
        assert f"| {r['variant']} |" in out
        if r["layout"] != "buffer-input":
            assert len(r["times_ms"]) == 1 and r["ms_per_image"] > 0
    assert set(report["ratios"]) >= {
        "buffer/stack time, eager",
        "buffer/stack time, graph",
        "graph/eager time, stack",
        "graph/eager time, buffer",
    }
    assert report["intermediate_layers"] == [0, 1, 2, 3, 4]


def test_script_counts_agree_with_the_rules(report: dict[str, Any]) -> None:
    for mode in ("eager", "graph"):
        stack, buf = _variant(report, "stack", mode), _variant(report, "buffer", mode)
        assert buf["whole_buffer_copies"] == []
        assert buf["copied_bytes"] <= stack["copied_bytes"]
        if mode == "graph":
            assert stack["graphs"] == buf["graphs"] == 1  # one graph, no break
    assert _variant(report, "buffer-input", "graph")["whole_buffer_copies"]
    for r in report["results"]:
        if r["layout"] != "buffer-input":
            assert r["allocated_bytes"] > 0 and r["peak_bytes"] > 0


def test_variants_agree(report: dict[str, Any]) -> None:
    # The projector's columns are permuted: the same sums in another order.
    for layout in ("stack", "buffer"):
        for mode in ("eager", "graph"):
            assert _variant(report, layout, mode)["max_abs_diff"] < 1e-4
