"""Pipeline parallelism (PP=2) through vLLM's multiprocessing executor on the CPU.

Two engines, each with two stage workers (gloo), chunked prefill and prefix
caching on, and synchronous scheduling (``platform_config._set_scheduling``):

- tiny Llama on the static plan (attention traced, every step shape compiled at
  warmup): greedy tokens equal HF transformers' (PP=1 matches HF in the other
  modules) on prompts cut into several chunks, again from the prefix cache;
  no stage compiles while serving (the intermediate tensors that travel have
  the step's bucket shape); each stage holds one of the two decoder layers'
  KV caches, and only the last holds logits;
- tiny LLaVA: the encoder and the merge run on the first stage, images chunked
  across steps, greedy tokens equal HF's.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.graph_config import compiled_with_buckets
from tests.hf_reference import hf_greedy
from tests.mm_reference import (
    engine_lifetime,
    greedy_generate,
    hf_llava_greedy,
    llava_prompt,
    make_image,
    tiny_llava_dir,
)
from vllm_hpu_mm.metrics_reader import read_metric

pytestmark = pytest.mark.e2e

PP = 2
MAX_NEW = 8
LENGTHS = (5, 30, 60, 100)  # a 64-token step budget: up to 2 chunks


@pytest.fixture(scope="module", autouse=True)
def rpc_functions() -> Iterator[None]:
    """collective_rpc ships this module's functions to the workers (pickled)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def llama(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "pp-llama",
        "prefill_tokens: [32, 64]\ndecode_batch: [1, 4]\nblocks: [4, 16, 32]\n",
        execution="static",
    )
    engine = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        seed=0,
        pipeline_parallel_size=PP,
        distributed_executor_backend="mp",
        additional_config=hpu_mm,
    )
    yield from engine_lifetime(engine)


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 500) for _ in range(n)] for n in lengths]


def test_text_greedy_matches_hf_chunked_and_from_prefix_cache(
    llama: Any, tiny_llama_dir: str
) -> None:
    prompts = _prompts(LENGTHS, seed=11)
    want = hf_greedy(tiny_llama_dir, prompts, MAX_NEW)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    first = greedy_generate(llama, inputs, MAX_NEW)
    assert [list(o.outputs[0].token_ids) for o in first] == want
    again = greedy_generate(llama, inputs, MAX_NEW)
    assert [list(o.outputs[0].token_ids) for o in again] == want
    # The second round starts after cached blocks (16 tokens a block).
    assert [o.num_cached_tokens for o in again][1:] == [16, 48, 96]
    compiles = "vllm_hpu_mm:graph_compiles_total"
    assert read_metric(compiles, {"phase": "warmup"}) > 0
    assert read_metric(compiles, {"phase": "serving"}) == 0
    assert read_metric("vllm_hpu_mm:fallback_buckets_total") == 0


@contextlib.contextmanager
def _by_value() -> Iterator[None]:
    """Pickle this module's functions by value for collective_rpc."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _stage_facts(worker: Any) -> dict[str, Any]:
    """Runs inside each worker (collective_rpc)."""
    from vllm.distributed import get_pp_group

    runner = worker.runner
    return {
        "rank": worker.rank,
        "pp_rank": get_pp_group().rank_in_group,
        "stage": (runner.stage.rank, runner.stage.size),
        "kv_layers": sorted(runner.kv_caches),
        "logits_head": type(worker.get_model().lm_head).__name__,
    }


def test_each_stage_holds_its_own_layers(llama: Any) -> None:
    with _by_value():
        facts = sorted(llama.collective_rpc(_stage_facts), key=lambda f: f["rank"])
    assert [f["pp_rank"] for f in facts] == [0, 1]
    assert [f["stage"] for f in facts] == [(0, PP), (1, PP)]
    assert [f["kv_layers"] for f in facts] == [
        ["model.layers.0.self_attn.attn"],
        ["model.layers.1.self_attn.attn"],
    ]
    assert [f["logits_head"] for f in facts] == ["PPMissingLayer", "ParallelLMHead"]


@pytest.fixture(scope="module")
def llava(llama: Any) -> Iterator[Any]:
    """Started once the text engine's tests are done (module order)."""
    from vllm import LLM

    engine = LLM(
        model=tiny_llava_dir(),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        limit_mm_per_prompt={"image": 2},
        seed=0,
        pipeline_parallel_size=PP,
        distributed_executor_backend="mp",
        enforce_eager=True,
    )
    yield from engine_lifetime(engine)


def test_vlm_greedy_matches_hf_encoder_on_first_stage(llava: Any) -> None:
    model_dir = tiny_llava_dir()
    cases = [
        (llava_prompt(1), [make_image("gradient", (40, 24), 3)]),
        (llava_prompt(0, "Say something."), []),
        (
            llava_prompt(2, preamble="Two pictures: "),
            [
                make_image("checkerboard", (24, 40), 4),
                make_image("stripes", (32, 32), 5),
            ],
        ),
    ]
    inputs = [
        {"prompt": p, "multi_modal_data": {"image": ims}} if ims else {"prompt": p}
        for p, ims in cases
    ]
    for _ in range(2):  # the second round from the prefix cache
        outs = greedy_generate(llava, inputs, MAX_NEW)
        for (prompt, images), out in zip(cases, outs, strict=True):
            want = hf_llava_greedy(model_dir, prompt, images, MAX_NEW)
            assert list(out.outputs[0].token_ids) == want
    assert outs[0].num_cached_tokens > 0
    with _by_value():
        stages = sorted(llava.collective_rpc(_encoder_facts))
    assert stages == [(0, True), (1, False)]  # (stage, runs the encoder)


def _encoder_facts(worker: Any) -> tuple[int, bool]:
    """Runs inside each worker (collective_rpc)."""
    return worker.runner.stage.rank, worker.runner.mm is not None
