"""Graph mode on the CPU: warmup prepares every step shape, serving compiles nothing.

One engine in torch.compile mode with a small explicit bucket set. Attention is
traced into the compiled layers (``execution: static``, Gaudi's path: tiled
prefill, flat paged decode, two-pass mixed steps; ``test_graph_mode_opaque.py``
has the CPU's ``dynamic``), so the graph key is the whole step shape
(decode rows and blocks, prefill tokens and blocks). The compile count is read
from the worker's real Prometheus counter (incremented inside the compiler
backend), through prometheus_client's multiprocess files.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.hf_reference import hf_greedy
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 12


def write_buckets(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The small explicit bucket set both graph-mode modules serve on."""
    path = tmp_path_factory.mktemp("buckets") / "tiny.yaml"
    path.write_text(
        "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [4, 16, 32]\n"
    )
    return str(path)


def graph_mode_llm(model_dir: str, buckets_file: str, execution: str) -> Any:
    """The tiny Llama in graph mode over ``buckets_file``, execution plan
    ``static`` or ``dynamic``; small limits so steps are chunked and mixed."""
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        seed=0,
        additional_config={
            "hpu_mm": {
                "graph_mode": "compile",
                "execution": execution,
                "bucketing": {"strategy": "explicit", "file": buckets_file},
                "warmup": {"progress_bar": False},
            }
        },
    )


@pytest.fixture(scope="module")
def llm(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    # Gaudi's path (the CPU's default is dynamic: test_graph_mode_opaque.py).
    # A spawned engine process: a forked one inherits what the pytest process
    # compiled before (vLLM's logprob-rank helper, by an engine an earlier
    # module ran in process), and the exact warmup count below then came out
    # one short under two xdist workers.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        engine = graph_mode_llm(
            tiny_llama_dir, write_buckets(tmp_path_factory), "static"
        )
    yield engine
    del engine


def test_warmup_compiled_every_step_shape(llm: object) -> None:
    from vllm_hpu_mm.bucketing.buckets import Limits, explicit, step_shapes

    limits = Limits(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=16
    )
    buckets = explicit(limits, [16, 64], [1, 4], [4, 16, 32])
    decode, prefill = step_shapes(buckets, limits, "flat")  # Gaudi's form
    # decode rows {1, 4} x flat block-list length {4, 16, 32} (one row holds
    # at most 16 blocks: 256 tokens); prefill tokens {16, 64} x tile blocks
    # {4, 16, 32}.
    assert decode == [(1, 4), (1, 16), (4, 4), (4, 16), (4, 32)]
    assert prefill == [(t, b) for t in (16, 64) for b in (4, 16, 32)]
    # Regional compilation: per step shape one graph shared by every decoder
    # layer, plus one logits graph per batch size; and the sampler's warmup at
    # the batch sizes (static path), where vLLM compiles its logprob-rank
    # helper once (batched_count_greater_than, every size: mark_unbacked).
    expected = len(decode) + len(prefill) + len(buckets.batch) + 1
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) == expected


def test_mixed_workload_adds_no_compilation_and_matches_hf(
    llm: object, tiny_llama_dir: str
) -> None:
    from vllm import SamplingParams

    rng = random.Random(7)
    prompts = [
        [rng.randrange(5, 500) for _ in range(n)] for n in (3, 9, 17, 33, 70, 120, 5)
    ]
    before_tokens = _counter("vllm_hpu_mm:scheduled_tokens_total")
    outs = llm.generate(  # type: ignore[attr-defined]
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_greedy(tiny_llama_dir, prompts, MAX_NEW)
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
    # Every prompt token and every decode step was counted as scheduled work;
    # padding is measured next to it.
    scheduled = _counter("vllm_hpu_mm:scheduled_tokens_total") - before_tokens
    assert scheduled >= sum(map(len, prompts)) + len(prompts) * (MAX_NEW - 1)
    assert _counter("vllm_hpu_mm:padded_tokens_total") > 0


def test_held_out_mix_of_growing_decodes_chunks_and_prefix_hits(
    llm: object, tiny_llama_dir: str
) -> None:
    """Requests arriving while others decode (mixed steps), decodes whose
    contexts cross block buckets (prompts near 64 growing past them), prompts
    chunked at the 64-token budget, and a shared prefix (cache hits with prior
    context): every step lands on a warmed shape."""
    check_mixed_workload(llm, tiny_llama_dir)


def test_prefix_cache_hit_reuses_blocks_without_compiling(
    llm: object, tiny_llama_dir: str
) -> None:
    from vllm import SamplingParams

    rng = random.Random(11)
    prompt = [rng.randrange(5, 500) for _ in range(90)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # type: ignore[attr-defined]
    second = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # type: ignore[attr-defined]
    # The second prefill starts from cached blocks (context blocks in the bucket).
    assert (second[0].num_cached_tokens or 0) >= 64
    expected = hf_greedy(tiny_llama_dir, [prompt], MAX_NEW)[0]
    assert list(first[0].outputs[0].token_ids) == expected
    assert list(second[0].outputs[0].token_ids) == expected
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0


def check_mixed_workload(llm: object, tiny_llama_dir: str) -> None:
    """Six prompts (chunked at the 64-token budget, two sharing a 48-token
    prefix, short ones that decode beside the others) of 40 greedy tokens:
    HF-identical, no compilation while serving, no fallback bucket."""
    from vllm import SamplingParams

    rng = random.Random(23)
    shared = [rng.randrange(5, 500) for _ in range(48)]
    prompts = [
        [rng.randrange(5, 500) for _ in range(60)],
        shared + [rng.randrange(5, 500) for _ in range(30)],
        [rng.randrange(5, 500) for _ in range(2)],
        shared + [rng.randrange(5, 500) for _ in range(7)],
        [rng.randrange(5, 500) for _ in range(150)],
        [rng.randrange(5, 500) for _ in range(11)],
    ]
    max_new = 40
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate(  # type: ignore[attr-defined]
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_greedy(tiny_llama_dir, prompts, max_new)
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert _counter("vllm_hpu_mm:fallback_buckets_total") == 0
