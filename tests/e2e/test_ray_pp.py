"""PP=2 x TP=2 through vLLM's Ray executor across two Ray nodes on one machine.

``ray start --head`` and ``ray start --address`` start a head and a worker
node as separate Ray nodes (each its own raylet and resources), each offering
two ``HPU`` slots (the CPU platform's ``ray_device_key``). vLLM packs its four
workers' bundles two a node and numbers the ranks node by node, so each
pipeline stage (its two tensor-parallel ranks) lives on its own node, as a
model too large for one Gaudi node is served: TP inside a node, PP across. The
engine core connects through ``RAY_ADDRESS``. (With ``ray.cluster_utils.Cluster``
instead, the engine core's ``ray.init`` never finished connecting on this
host; cause not found.) One short greedy generation equals HF transformers'
(4 workers and the engine core share the host's cores).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_ray_tp import _free_port, _stop_group
from tests.hf_reference import hf_greedy
from tests.mm_reference import engine_lifetime, greedy_generate

pytestmark = pytest.mark.e2e

TP = 2
PP = 2
MAX_NEW = 4


def _ray_start(args: list[str], temp_dir: Path | None = None) -> int:
    """``ray start ARGS`` in a session of its own; returns its process group."""
    ray_bin = Path(sys.executable).with_name("ray")
    common = [
        "--node-ip-address=127.0.0.1",
        "--num-cpus=1",
        f'--resources={{"HPU": {TP}}}',
        "--disable-usage-stats",
    ]
    if temp_dir is not None:
        common.append(f"--temp-dir={temp_dir}")
    start = subprocess.Popen(
        [str(ray_bin), "start", *args, *common],
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the node's processes join this group
    )
    try:
        out, _ = start.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        _stop_group(start.pid)
        raise
    if start.returncode != 0:
        _stop_group(start.pid)
        pytest.fail(f"ray start {' '.join(args)} failed:\n{out}")
    return start.pid


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A head and a worker Ray node (``ray start`` twice: two raylets, 2 HPU
    slots each); RAY_ADDRESS points the engine at the head."""
    port = _free_port()
    groups = [
        _ray_start(
            [
                "--head",
                f"--port={port}",
                f"--ray-client-server-port={_free_port()}",
                f"--dashboard-agent-listen-port={_free_port()}",
                "--include-dashboard=false",
            ],
            tmp_path_factory.mktemp("ray"),
        )
    ]
    mp = pytest.MonkeyPatch()
    try:
        address = f"127.0.0.1:{port}"
        groups.append(
            _ray_start(
                [
                    f"--address={address}",
                    f"--dashboard-agent-listen-port={_free_port()}",
                ]
            )
        )
        mp.setenv("RAY_ADDRESS", address)
        mp.setenv("RAY_AUTH_MODE", "disabled")
        yield address
    finally:
        mp.undo()
        for pgid in reversed(groups):
            _stop_group(pgid)


@pytest.fixture(scope="module")
def llm(two_nodes: str, tiny_llama_dir: str) -> Iterator[Any]:
    from vllm import LLM

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc below
    engine = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=2,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        tensor_parallel_size=TP,
        pipeline_parallel_size=PP,
        distributed_executor_backend="ray",
    )
    try:
        yield from engine_lifetime(engine)
    finally:
        mp.undo()


def test_greedy_matches_hf_across_two_nodes(llm: Any, tiny_llama_dir: str) -> None:
    prompts = [[7 + (i * 13) % 400 for i in range(n)] for n in (9, 45)]
    outs = greedy_generate(llm, [{"prompt_token_ids": p} for p in prompts], MAX_NEW)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_greedy(tiny_llama_dir, prompts, MAX_NEW)


def _placement(worker: Any) -> tuple[int, int, int, str]:
    """Runs inside each Ray worker (collective_rpc)."""
    import ray
    from vllm.distributed import get_pp_group, get_tp_group

    return (
        worker.rank,
        get_pp_group().rank_in_group,
        get_tp_group().rank_in_group,
        ray.get_runtime_context().get_node_id(),
    )


@contextlib.contextmanager
def _by_value() -> Iterator[None]:
    """Pickle this module's functions by value: the Ray workers cannot import
    the tests package."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_one_stage_a_node(llm: Any) -> None:
    with _by_value():
        rows = sorted(llm.collective_rpc(_placement))
    assert [(r, pp, tp) for r, pp, tp, _ in rows] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    stage_nodes = [{node for _, pp, _, node in rows if pp == s} for s in range(PP)]
    assert all(len(nodes) == 1 for nodes in stage_nodes), stage_nodes
    assert len(set().union(*stage_nodes)) == PP  # two nodes, one stage each
