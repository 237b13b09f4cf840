"""``--kv-cache-dtype fp8`` through ``vllm.LLM`` on the CPU, on both execution
plans: tiny Llama, float32, token-identical to HF transformers over an FP8 KV
cache, and the block count of a 1-byte cache.

The oracle (``tests/fp8_kv_reference.py``) is HF's float32 greedy run whose
cache rounds each new key (after RoPE) and value through ``float8_e4m3fn`` at
the layer's scale (1.0 here: the checkpoint has none). Every path of the
plugin attends only keys and values as the FP8 cache holds them: the static
plan reads them all from the cache (tiled prefill gather, flat decode); the
dynamic plan attends a fresh prompt's own K/V and appends the dense decode
cache's new token after quantizing and reading them back, and fills the dense
cache dequantized. So the tolerance is zero: tokens must be identical. The
same prompts without FP8 rounding give other tokens (asserted), so the check
sees the quantization.

Block count: the same ``kv_cache_memory_bytes`` for every engine, so the FP8
engine's ``num_gpu_blocks`` must be that memory over the 1-byte page of every
layer, twice the bfloat16 figure and four times the float32 one, both
computed from the same page-size formula (``block_size x 2 (K, V) x kv heads x
head size x bytes``, summed over layers) instead of from a third engine.

Two engines: ``execution: static`` in graph mode (attention traced into the
bucket graphs: the FP8 write and the dequantizing reads are in them) and
``execution: dynamic`` eager (per-request prefill, dense decode cache).
Prompts are chunked at a 32-token step budget next to decoding requests, and a
second round hits the prefix cache (blocks written as FP8 by the first).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fp8_kv_reference import hf_greedy_fp8_kv
from tests.graph_config import compiled_with_buckets
from tests.hf_reference import hf_greedy
from tests.mm_reference import engine_lifetime
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 12
KV_BYTES = 4 * 2**20  # the same KV-cache memory for every figure below
BLOCK_SIZE = 16  # the CPU's default
_rng = random.Random(11)
FIRST = [[_rng.randrange(6, 600) for _ in range(n)] for n in (75, 3, 57, 9, 100)]
# Second round: 48 tokens (3 full blocks) of FIRST[0], then new ones.
SECOND = [FIRST[0][:48] + [_rng.randrange(6, 600) for _ in range(22)]]


def _cache_facts(worker: Any) -> dict[str, Any]:
    """Runs in the worker (collective_rpc): the paged and dense caches."""
    runner = worker.model_runner
    kv = next(iter(runner.kv_caches.values()))
    dense = runner.decode_cache
    return {
        "dtypes": sorted(
            {str(t.dtype) for c in runner.kv_caches.values() for t in c[:2]}
        ),
        "rows": int(kv.key.shape[0]),
        "dense_fills": None if dense is None else dense.fills,
        "dense_dtypes": None
        if dense is None
        else sorted({str(t.dtype) for t in dense._tensors.values()}),
    }


def _set_scales(worker: Any, k_scale: float, v_scale: float) -> int:
    """Runs in the worker: every attention layer's K/V scales, set as vLLM's
    ``BaseKVCacheMethod`` sets a checkpoint's (the buffers and their floats)."""
    from vllm.model_executor.layers.attention.attention import Attention

    layers = [
        m for m in worker.model_runner.model.modules() if isinstance(m, Attention)
    ]
    for layer in layers:
        layer._k_scale.fill_(k_scale)
        layer._v_scale.fill_(v_scale)
        layer._k_scale_float, layer._v_scale_float = k_scale, v_scale
    return len(layers)


def _engine(model: str, **kwargs: Any) -> Iterator[Any]:
    import cloudpickle
    from vllm import LLM

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        llm = LLM(
            model=model,
            dtype="float32",
            kv_cache_dtype="fp8",
            kv_cache_memory_bytes=KV_BYTES,
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            seed=0,
            **kwargs,
        )
        yield from engine_lifetime(llm)
    finally:
        mp.undo()


@pytest.fixture(scope="module", params=["static", "dynamic"])
def plan(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def llm(
    plan: str, tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    if plan == "static":
        hpu_mm = compiled_with_buckets(
            tmp_path_factory,
            "fp8kv",
            "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [4, 16]\n",
            execution="static",
        )
        yield from _engine(tiny_llama_dir, additional_config=hpu_mm)
    else:
        hpu_mm = {"hpu_mm": {"execution": "dynamic"}}
        yield from _engine(tiny_llama_dir, enforce_eager=True, additional_config=hpu_mm)


def _generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return llm.generate(  # type: ignore[no-any-return]
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )


def _page_bytes_all_layers(model_dir: str, element_bytes: int) -> int:
    """One block's bytes over every layer: block x (K, V) x heads x head x bytes."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    per_layer = BLOCK_SIZE * 2 * cfg.num_key_value_heads * head * element_bytes
    return per_layer * cfg.num_hidden_layers


def test_tokens_match_hf_over_an_fp8_cache(
    llm: Any, plan: str, tiny_llama_dir: str
) -> None:
    got = [list(o.outputs[0].token_ids) for o in _generate(llm, FIRST)]
    second = _generate(llm, SECOND)
    hit = second[0].num_cached_tokens
    got += [list(o.outputs[0].token_ids) for o in second]
    prompts = FIRST + SECOND
    want = hf_greedy_fp8_kv(tiny_llama_dir, prompts, MAX_NEW)
    assert got == want, plan
    assert hit >= 3 * BLOCK_SIZE, f"no prefix-cache hit ({hit} cached tokens)"
    # The FP8 rounding matters on these prompts: unrounded, HF answers otherwise.
    assert want != hf_greedy(tiny_llama_dir, prompts, MAX_NEW)
    if plan == "static":
        assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
        assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0


def test_the_cache_is_fp8_with_twice_the_bf16_blocks(
    llm: Any, plan: str, tiny_llama_dir: str
) -> None:
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    fp8 = KV_BYTES // _page_bytes_all_layers(tiny_llama_dir, 1)
    bf16 = KV_BYTES // _page_bytes_all_layers(tiny_llama_dir, 2)
    fp32 = KV_BYTES // _page_bytes_all_layers(tiny_llama_dir, 4)
    assert blocks == fp8 == 2 * bf16 == 4 * fp32, (blocks, fp8, bf16, fp32)
    (facts,) = llm.collective_rpc(_cache_facts)
    assert facts["dtypes"] == ["torch.float8_e4m3fn"], facts
    assert facts["rows"] == blocks * BLOCK_SIZE, facts
    if plan == "dynamic":  # the dense decode cache, dequantized, was used
        assert facts["dense_dtypes"] == ["torch.float32"], facts
        assert facts["dense_fills"] > 0, facts
    else:
        assert facts["dense_fills"] is None, facts


def test_checkpoint_scales_are_applied(
    llm: Any, plan: str, tiny_llama_dir: str
) -> None:
    """Scales other than 1.0, as a checkpoint's ``k_scale`` / ``v_scale``
    would set them: keys stored as ``k / 0.03`` (saturating beyond |k| = 13.44),
    values as ``v / 0.01``; HF rounds at the same scales. The prefix cache is
    reset first: blocks written at scale 1.0 must not be read at another."""
    rng = random.Random(13)
    prompts = [[rng.randrange(6, 600) for _ in range(n)] for n in (40, 70)]
    try:
        assert llm.collective_rpc(_set_scales, args=(0.03, 0.01)) == [2]
        assert llm.reset_prefix_cache()
        got = [list(o.outputs[0].token_ids) for o in _generate(llm, prompts)]
    finally:
        llm.collective_rpc(_set_scales, args=(1.0, 1.0))
        llm.reset_prefix_cache()
    want = hf_greedy_fp8_kv(tiny_llama_dir, prompts, MAX_NEW, 0.03, 0.01)
    assert got == want, plan
    assert want != hf_greedy_fp8_kv(tiny_llama_dir, prompts, MAX_NEW)
