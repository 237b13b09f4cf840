"""The memory profile that sizes the KV cache measures attention and the encoder.

``LiveTensorBytes`` is checked on tensors of known sizes; then a fresh
interpreter (vLLM's model-parallel state must not leak into other tests) builds
the plugin's model runner on the CPU for the tiny LLaVA and the tiny Mllama,
without an engine, and runs ``profile_peak_activation_bytes`` with that meter at
several shapes: the measured peak grows with the prefill bucket, with the
context the prefill reads (LLaVA: the attention scores and mask are measured) and
with the encoder bucket. Mllama's profile also runs cross-attention over every
image slot of its cache in the same step.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.mllama_reference import tiny_mllama_dir
from tests.mm_reference import tiny_llava_dir
from vllm_hpu_mm.worker.profile import LiveTensorBytes, tensor_meter
from vllm_hpu_mm.worker.worker import kv_cache_budget

# ---- the meter ---------------------------------------------------------------


def test_live_tensor_bytes_follows_allocations_and_frees() -> None:
    with LiveTensorBytes() as live:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        assert live.live == 8000
        view = a[10:20]  # no new storage
        a.add_(1.0)  # in place: no new storage
        del a, b  # a's storage stays alive through the view
        assert live.live == 4000
        del view
        c = torch.empty(250, dtype=torch.int32)  # 1000 bytes
        assert live.live == 1000
        del c
    assert live.peak == 8000 and live.live == 0


def test_live_tensor_bytes_ignores_tensors_from_before() -> None:
    weights = torch.ones(64, 64)
    with LiveTensorBytes() as live:
        weights.mul_(2.0)
        out = weights @ weights  # [64, 64] float32: a new 16 KiB storage
        assert live.live == 64 * 64 * 4
        del out
    assert live.peak == 64 * 64 * 4 and live.live == 0


def test_tensor_meter_reports_the_transient_peak() -> None:
    def run() -> None:
        x = torch.zeros(1024, 1024)  # 4 MiB, freed before the end
        del x
        torch.zeros(256, 1024)  # 1 MiB

    assert tensor_meter(run) == 4 * 2**20


def test_a_function_first_called_inside_the_meter_still_compiles() -> None:
    """The profile is often the first call of a compiled layer. Dynamo skips a
    frame it first meets under a dispatch mode that does not ignore compile
    internals, and marks its code skipped for good: the layer would then run
    eagerly ever after (on the simulated Gaudi no decoder layer compiled)."""
    graphs: list[object] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ x.T) + 1.0

    compiled = torch.compile(layer, backend=backend, dynamic=False)
    x = torch.randn(8, 8)
    torch._dynamo.reset()
    with LiveTensorBytes() as live:
        got = compiled(x)
    assert live.peak > 0  # the meter saw the compiled run's allocations
    assert len(graphs) == 1  # traced inside the profile, not skipped
    torch.testing.assert_close(got, layer(x))
    compiled(x)
    assert len(graphs) == 1  # and reused after it


# ---- the KV-cache budget ------------------------------------------------------


def test_budget_keeps_the_graph_reserve_out_of_the_kv_cache() -> None:
    gib = 2**30
    budget = kv_cache_budget(100 * gib, 80 * gib, 0.9, 10 * gib, 0.1)
    # 90 usable - 20 in use - 10 peak = 60; 10 % of it (6) kept for graphs.
    assert budget == 54 * gib
    assert kv_cache_budget(100 * gib, 80 * gib, 0.9, 10 * gib, 0.0) == 60 * gib
    with pytest.raises(RuntimeError, match="profiled peak"):
        kv_cache_budget(100 * gib, 20 * gib, 0.9, 10 * gib, 0.1)


# ---- the profiled step, on real models ------------------------------------------

_PROFILE = textwrap.dedent(
    """
    import dataclasses, json, socket, sys
    import torch
    import vllm.model_executor.models.registry as registry
    registry._run_in_subprocess = lambda fn: fn()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment, initialize_model_parallel)
    from vllm.engine.arg_utils import EngineArgs
    from vllm_hpu_mm.config import load_plugin_config
    from vllm_hpu_mm.worker.model_runner import HpuMMModelRunner
    from vllm_hpu_mm.worker.profile import (
        largest_shape, profile_peak_activation_bytes, tensor_meter)

    model_dir, max_images = sys.argv[1], int(sys.argv[2])
    vc = EngineArgs(
        model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=4,
        max_num_batched_tokens=256, enforce_eager=True, seed=0,
        limit_mm_per_prompt={"image": max_images},
    ).create_engine_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        runner = HpuMMModelRunner(vc, torch.device("cpu"), load_plugin_config(vc))
        runner.load_model()
        base = largest_shape(runner)

        def peak(tokens, context, items):
            shape = dataclasses.replace(
                base, num_tokens=tokens, context_len=context,
                prefill_blocks=-(-context // runner.block_size),
                encoder_items=items)
            return profile_peak_activation_bytes(runner, tensor_meter, shape)

        res = {
            "largest": dataclasses.asdict(base),
            "default": profile_peak_activation_bytes(runner, tensor_meter),
            "tokens": [peak(t, 256, 1) for t in (32, 128, 256)],
            "context": [peak(32, c, 0) for c in (32, 128, 256)],
            "items": [peak(32, 256, n) for n in base_items(base)]
            if base.encoder_items > 1 else [],
            "item_sizes": base_items(base),
        }
    print("RESULT " + json.dumps(res))
    """
).replace(
    "    res = {",
    "    def base_items(b):\n"
    "        return [n for n in (1, 2, 4, 8) if n <= b.encoder_items]\n"
    "    res = {",
    1,
)


def _profile(model_dir: str, max_images: int, tmp: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "VLLM_CACHE_ROOT": tmp,
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _PROFILE, model_dir, str(max_images)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return dict(json.loads(lines[-1][len("RESULT ") :]))


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _profile(tiny_llava_dir(), 2, str(tmp_path_factory.mktemp("vllm")))


@pytest.fixture(scope="module")
def mllama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _profile(tiny_mllama_dir(), 2, str(tmp_path_factory.mktemp("vllm")))


def _strictly_increasing(values: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(values))


@pytest.mark.parametrize("model", ["llava", "mllama"])
def test_peak_grows_with_the_prefill_bucket(
    model: str, request: pytest.FixtureRequest
) -> None:
    res = request.getfixturevalue(model)
    assert _strictly_increasing(res["tokens"]), res["tokens"]


def test_peak_grows_with_the_context_attention_reads(llava: dict[str, Any]) -> None:
    """Same tokens, longer context, no encoder: only attention (keys, mask,
    scores) grows. (Mllama's peak at these sizes is its cross-attention over
    every image slot, larger than any self-attention context here.)"""
    assert _strictly_increasing(llava["context"]), llava["context"]


@pytest.mark.parametrize("model", ["llava", "mllama"])
def test_peak_grows_with_the_encoder_bucket(
    model: str, request: pytest.FixtureRequest
) -> None:
    """Never smaller for a larger bucket, and larger at the largest than at one
    item (Mllama's small buckets sit under its cross-attention peak)."""
    res = request.getfixturevalue(model)
    items = res["items"]
    assert res["largest"]["encoder_items"] > 1, res["largest"]
    assert len(items) >= 2, res
    assert all(a <= b for a, b in itertools.pairwise(items)), items
    assert items[-1] > items[0], items


def test_default_shape_is_the_largest_step(llava: dict[str, Any]) -> None:
    """Without a shape: the largest token bucket, contexts of max_model_len, the
    largest encoder bucket; its peak is at least that of any smaller step."""
    largest = llava["largest"]
    assert largest["context_len"] == 256
    assert largest["num_tokens"] >= 256
    assert llava["default"] >= max(llava["tokens"] + llava["context"] + llava["items"])
