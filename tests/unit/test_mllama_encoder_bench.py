"""benchmarks/mllama_encoder.py --quick: the script runs its four variants (tuple
+stack and preallocated buffer, eager and graph mode) on tiny shapes, and its
counts show what the buffer saves. Timings are reported, never asserted."""

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
        (lo, m) for lo in ("stack", "prealloc") for m in ("eager", "graph")
    }
    out = report["stdout"]
    assert "| variant | ms / forward |" in out
    for r in report["results"]:
        assert f"| {r['variant']} |" in out
        assert len(r["times_ms"]) == 1 and r["median_ms"] > 0
    assert set(report["ratios"]) == {
        "prealloc/stack time, eager",
        "prealloc/stack time, graph",
        "graph/eager time, stack",
        "graph/eager time, prealloc",
    }
    assert report["intermediate_layers"] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_prealloc_has_no_stack_and_fewer_copies(
    report: dict[str, Any], mode: str
) -> None:
    stack = _variant(report, "stack", mode)
    pre = _variant(report, "prealloc", mode)
    kept = len(report["intermediate_layers"])
    assert stack["copy_breakdown"]["stack"] == 1
    assert "stack" not in pre["copy_breakdown"]
    # The stack path's final concatenation is gone; the kept layers are written
    # in place instead (one index_copy_ each, one copy_ of the global output).
    assert stack["copy_breakdown"]["cat"] == pre["copy_breakdown"]["cat"] + 1
    assert pre["copy_breakdown"]["index_copy_"] == kept
    assert pre["copy_breakdown"]["copy_"] == 1
    assert pre["allocating_copy_ops"] == stack["allocating_copy_ops"] - 2
    assert pre["copied_bytes"] < stack["copied_bytes"]
    if mode == "graph":
        assert stack["graphs"] == pre["graphs"] == 1  # one graph, no break


def test_eager_prealloc_allocates_less(report: dict[str, Any]) -> None:
    stack = _variant(report, "stack", "eager")
    pre = _variant(report, "prealloc", "eager")
    # The stack and cat outputs are fresh tensors; the buffer is allocated once,
    # outside the forward.
    assert pre["dispatch_allocated_bytes"] < stack["dispatch_allocated_bytes"]
    assert pre["allocated_bytes"] < stack["allocated_bytes"]
    for r in report["results"]:
        assert r["allocated_bytes"] > 0 and r["peak_bytes"] > 0


def test_variants_agree(report: dict[str, Any]) -> None:
    # Same kernels in the same order: bit-identical; compiled: fused, close.
    assert _variant(report, "prealloc", "eager")["max_abs_diff"] == 0.0
    for layout in ("stack", "prealloc"):
        assert _variant(report, layout, "graph")["max_abs_diff"] < 1e-4
