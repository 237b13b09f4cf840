"""Warmup on the static path, as Gaudi runs it, on the CPU.

One in-process engine (the tiny Llama, graph mode, traced attention: every
graph at a fixed shape) whose warmup runs inside the fake bridge's compile-only
mode (``tests.fakes.habana.FakeBridgeConfig``: any read of a tensor's value
raises, as no value is computed in Gaudi's ``PT_COMPILE_ONLY_MODE``), standing
in for ``device.compile_only_mode``. Then serving, with batch sizes between the
batch buckets, greedy and seeded random sampling and logprobs, compiles
nothing: the sampler runs at the buckets warmup prepared, and the graphs vLLM's
sampler compiles for itself (logprob ranks) are counted too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.habana import COMPILE_ONLY_SETTING, FakeBridgeConfig
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.e2e

MAX_NEW = 6
BRIDGE = FakeBridgeConfig()


@contextlib.contextmanager
def _fake_compile_only() -> Iterator[bool]:
    with BRIDGE.env_setting(COMPILE_ONLY_SETTING, True):
        yield True


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    from vllm_hpu_mm import device

    buckets = tmp_path_factory.mktemp("buckets") / "tiny.yaml"
    buckets.write_text(
        "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [4, 16]\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        # in-process, so the worker's warmup runs inside the fake mode
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setattr(device, "compile_only_mode", _fake_compile_only)
        engine = LLM(
            model=tiny_llama_dir,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_logprobs=2,
            seed=0,
            additional_config={
                "hpu_mm": {
                    "graph_mode": "compile",
                    "graph_attention": "traced",
                    "bucketing": {"strategy": "explicit", "file": str(buckets)},
                    "warmup": {"progress_bar": False},
                }
            },
        )
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    yield engine
    del engine


def _compiles(phase: str) -> float:
    """The counter of this process (the engine runs in it): read from
    prometheus_client's own registry, which holds this process's counters
    whether or not the pytest process had chosen the multiprocess mode before
    it imported prometheus_client (an earlier module may have imported it
    first, and the merged multiprocess view then misses in-memory values)."""
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(
        "vllm_hpu_mm:graph_compiles_total", {"phase": phase}
    )
    return value or 0.0


def test_warmup_ran_in_compile_only_mode_and_read_nothing_back(llm: Any) -> None:
    # the fake raises on any value read inside the mode: the engine started
    assert BRIDGE.entered >= 1
    assert _compiles("warmup") > 0


def test_serving_between_buckets_compiles_nothing(
    llm: Any, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import SamplingParams
    from vllm.v1.sample.sampler import Sampler

    rows: list[int] = []  # the batch sizes the sampler ran at
    forward = Sampler.forward

    def spy(self: Sampler, logits: Any, *args: Any, **kwargs: Any) -> Any:
        rows.append(int(logits.shape[0]))
        return forward(self, logits, *args, **kwargs)

    monkeypatch.setattr(Sampler, "forward", spy)

    prompts = [[5 + i, 17, 33 + 2 * i, 9] for i in range(3)]  # 3 rows: bucket 4
    greedy = SamplingParams(
        temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2
    )
    seeded = SamplingParams(
        temperature=1.0, seed=11, max_tokens=MAX_NEW, ignore_eos=True
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [greedy, greedy, seeded],
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in outs[:2]]
    assert got == hf_greedy(tiny_llama_dir, prompts[:2], MAX_NEW)
    assert all(len(step) >= 2 for o in outs[:2] for step in o.outputs[0].logprobs)
    # the seeded request alone (batch 1, bucket 1) draws the same tokens
    alone = llm.generate([{"prompt_token_ids": prompts[2]}], seeded, use_tqdm=False)
    assert list(alone[0].outputs[0].token_ids) == list(outs[2].outputs[0].token_ids)
    assert _compiles("serving") == 0
    assert rows and set(rows) <= {1, 4}, rows  # the batch buckets
