"""Tensor parallelism over Ray on the CPU fallback: TP=2, gloo, one local cluster.

The module starts one local Ray cluster with ``ray start --head`` offering two
``HPU`` slots (the CPU platform's ``ray_device_key``) and one ``vllm.LLM`` with
``tensor_parallel_size=2, distributed_executor_backend="ray"`` on the tiny
Llama (4 query and 2 KV heads: one KV head per rank). The engine core connects
to the cluster through ``RAY_ADDRESS``; a ``ray.init()`` in this process instead
would be inherited by the engine-core child process and hang vLLM's placement
group.

- greedy outputs equal HF transformers' token for token, with prompts split
  into several chunks (a 64-token step budget);
- each worker runs on its own rank of a gloo group of two, with the KV cache
  spec and the attention layers cut to one KV head per rank;
- every rank samples the same tokens (same seed, same logits after vLLM's
  all-gather), so the ranks' generators are in the same state after random
  sampling: the inputs of the next step agree across ranks.
"""

from __future__ import annotations

import gc
import hashlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.ray_cluster import ray_cluster
from tests.hf_reference import hf_greedy, load_hf_tokenizer

pytestmark = pytest.mark.e2e

TP = 2
MAX_NEW = 12
STEP_BUDGET = 64  # tokens per step: the 88- and 120-token prompts take 2-3 chunks
LENGTHS = (3, 11, 29, 57, 88, 120)
FIRST_ORDINARY_ID = 6  # ids below are the tokenizer's special tokens
TEXT = "Memory is divided into blocks, and each block holds a few tokens. "


def _prompts(model_dir: str, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """Tokenized text cut to each length, topped up with seeded random ids."""
    import torch

    ids = load_hf_tokenizer(model_dir)(TEXT)["input_ids"]
    vocab = len(load_hf_tokenizer(model_dir))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        head = ids[:n]
        extra = torch.randint(FIRST_ORDINARY_ID, vocab, (n - len(head),), generator=gen)
        out.append(head + extra.tolist())
    return out


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray head with 2 HPU slots; RAY_ADDRESS points the engine at it."""
    with ray_cluster(nodes=1, hpu_per_node=TP, cpus_per_node=2) as address:
        yield address


@pytest.fixture(scope="module")
def llm(ray_address: str, tiny_llama_dir: str) -> Iterator[Any]:
    import cloudpickle
    from vllm import LLM

    # collective_rpc ships this module's functions to the workers: pickled (the
    # engine core is a child of this process and reads the variable at start)
    # and by value (the Ray workers cannot import the tests package).
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=STEP_BUDGET,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=TP,
        distributed_executor_backend="ray",
    )
    try:
        yield engine
    finally:
        engine_core = getattr(engine.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del engine
        gc.collect()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        mp.undo()


def test_greedy_matches_hf_under_tp2(llm: Any, tiny_llama_dir: str) -> None:
    from vllm import SamplingParams

    prompts = _prompts(tiny_llama_dir, LENGTHS, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == hf_greedy(tiny_llama_dir, prompts, MAX_NEW)


def _worker_facts(worker: Any) -> dict[str, Any]:
    """Runs inside each Ray worker (collective_rpc)."""
    import torch.distributed as dist
    from vllm.distributed import get_tensor_model_parallel_rank

    specs = worker.get_kv_cache_spec()
    model = worker.get_model()
    attn = [m for m in model.modules() if type(m).__name__ == "Attention"]
    return {
        "rank": worker.rank,
        "tp_rank": get_tensor_model_parallel_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "kv_heads": sorted({s.num_kv_heads for s in specs.values()}),
        "layer_kv_heads": sorted({a.num_kv_heads for a in attn}),
        "layer_heads": sorted({a.num_heads for a in attn}),
        "kv_cache_shapes": sorted(
            {tuple(kv.key.shape) for kv in worker.runner.kv_caches.values()}
        ),
    }


def test_workers_hold_one_shard_each(llm: Any, tiny_llama_dir: str) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    facts = llm.collective_rpc(_worker_facts)
    assert sorted(f["rank"] for f in facts) == list(range(TP))
    assert sorted(f["tp_rank"] for f in facts) == list(range(TP))
    for f in facts:
        assert f["world_size"] == TP
        assert f["backend"] == "gloo"
        assert f["kv_heads"] == [cfg.num_key_value_heads // TP]
        assert f["layer_kv_heads"] == [cfg.num_key_value_heads // TP]
        assert f["layer_heads"] == [cfg.num_attention_heads // TP]
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        (shape,) = f["kv_cache_shapes"]  # K: [blocks * block_size, Hkv, D]
        assert shape[1:] == (cfg.num_key_value_heads // TP, head_dim)


def _rng_digest(worker: Any) -> str:
    import torch

    return hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()


def test_ranks_sample_in_lockstep(llm: Any, tiny_llama_dir: str) -> None:
    from vllm import SamplingParams

    before = llm.collective_rpc(_rng_digest)
    assert len(set(before)) == 1, "the ranks start from different generator states"
    prompts = _prompts(tiny_llama_dir, (9, 30, 70), seed=3)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    after = llm.collective_rpc(_rng_digest)
    assert after[0] != before[0], "random sampling drew nothing from the generator"
    assert len(set(after)) == 1, "the ranks drew differently while sampling"
