"""PP=2 x TP=2 through vLLM's Ray executor across two Ray nodes on one machine.

One cluster for the module (``tests.e2e.ray_cluster``: ``ray start --head``
and ``ray start --address``, two raylets, 2 ``HPU`` slots each, the CPU
platform's ``ray_device_key``) serves two engines one after the other (each
class's engine is shut down before the next starts: both need all four
slots). vLLM packs the four workers' bundles two a node and numbers the ranks
node by node, so each pipeline stage (its two tensor-parallel ranks) lives on
its own node, as a model too large for one Gaudi node is served: TP inside a
node, PP across. The engine core connects through ``RAY_ADDRESS``.

- tiny Llama: one short greedy generation equals HF transformers';
- tiny LLaVA: image prompts cut into chunks (a 24-token step budget: the
  second prompt's 16-token image placeholders are split between steps), then
  one again from the prefix cache, greedy tokens equal HF's; the vision
  encoder lives on the first stage's two ranks only.

PP=2 without TP is covered over mp (``test_pipeline_parallel.py``: the same
stage code, one stage a process), so this module starts no PP-only engine.
(4 workers and the engine core share the host's cores: few, short prompts.)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.ray_cluster import ray_cluster
from tests.hf_reference import hf_greedy
from tests.mm_reference import (
    engine_lifetime,
    greedy_generate,
    hf_llava_greedy,
    llava_prompt,
    make_image,
    tiny_llava_dir,
)

pytestmark = pytest.mark.e2e

TP = 2
PP = 2
MAX_NEW = 4


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    """A head and a worker Ray node, 2 HPU slots each; the engines' workers
    pickle this module's functions (collective_rpc below)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    try:
        with ray_cluster(nodes=2, hpu_per_node=TP, cpus_per_node=1) as address:
            yield address
    finally:
        mp.undo()


def _engine(model: str, **kwargs: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        tensor_parallel_size=TP,
        pipeline_parallel_size=PP,
        distributed_executor_backend="ray",
        **kwargs,
    )


def _placement(worker: Any) -> tuple[int, int, int, str, bool]:
    """Runs inside each Ray worker (collective_rpc)."""
    import ray
    from vllm.distributed import get_pp_group, get_tp_group

    return (
        worker.rank,
        get_pp_group().rank_in_group,
        get_tp_group().rank_in_group,
        ray.get_runtime_context().get_node_id(),
        worker.runner.mm is not None,  # holds the encoder and the merge
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


def _check_one_stage_a_node(llm: Any) -> list[tuple[int, int, int, str, bool]]:
    """Ranks 0-1 are stage 0 and 2-3 stage 1, each stage on one node, the two
    stages on different nodes; returns the rows, by rank."""
    with _by_value():
        rows = sorted(llm.collective_rpc(_placement))
    assert [(r, pp, tp) for r, pp, tp, _, _ in rows] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    stage_nodes = [{node for _, pp, _, node, _ in rows if pp == s} for s in range(PP)]
    assert all(len(nodes) == 1 for nodes in stage_nodes), stage_nodes
    assert len(set().union(*stage_nodes)) == PP  # two nodes, one stage each
    return rows


class TestLlama:
    @pytest.fixture(scope="class")
    def llm(self, two_nodes: str, tiny_llama_dir: str) -> Iterator[Any]:
        engine = _engine(
            tiny_llama_dir, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=2
        )
        yield from engine_lifetime(engine)

    def test_greedy_matches_hf_across_two_nodes(
        self, llm: Any, tiny_llama_dir: str
    ) -> None:
        prompts = [[7 + (i * 13) % 400 for i in range(n)] for n in (9, 45)]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outs = greedy_generate(llm, inputs, MAX_NEW)
        got = [list(o.outputs[0].token_ids) for o in outs]
        assert got == hf_greedy(tiny_llama_dir, prompts, MAX_NEW)

    def test_one_stage_a_node(self, llm: Any) -> None:
        rows = _check_one_stage_a_node(llm)
        assert [mm for *_, mm in rows] == [False] * (TP * PP)  # a text model


class TestLlava:
    @pytest.fixture(scope="class")
    def llava(self, two_nodes: str) -> Iterator[Any]:
        engine = _engine(
            tiny_llava_dir(),
            max_model_len=128,
            max_num_batched_tokens=24,
            max_num_seqs=2,
            limit_mm_per_prompt={"image": 2},
        )
        yield from engine_lifetime(engine)

    def test_images_chunked_and_from_prefix_cache_match_hf(self, llava: Any) -> None:
        cases = [
            (llava_prompt(1), [make_image("gradient", (40, 24), 3)]),
            (
                llava_prompt(2, preamble="Two pictures: "),
                [
                    make_image("checkerboard", (24, 40), 4),
                    make_image("stripes", (32, 32), 5),
                ],
            ),
        ]
        inputs = [{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in cases]
        want = [hf_llava_greedy(tiny_llava_dir(), p, ims, MAX_NEW) for p, ims in cases]
        outs = greedy_generate(llava, inputs, MAX_NEW)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        # The two-image prompt (77 tokens, images at 18-33 and 35-50) again:
        # its 4 full 16-token blocks, both images in them, are hits.
        (again,) = greedy_generate(llava, inputs[1:], MAX_NEW)
        assert list(again.outputs[0].token_ids) == want[1]
        assert again.num_cached_tokens == 64

    def test_encoder_on_the_first_stage_its_node_only(self, llava: Any) -> None:
        rows = _check_one_stage_a_node(llava)
        assert [(pp, mm) for _, pp, _, _, mm in rows] == [
            (0, True),
            (0, True),
            (1, False),
            (1, False),
        ]
