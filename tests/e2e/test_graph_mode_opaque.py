"""Graph mode with attention as vLLM's opaque op (``execution: dynamic``,
the CPU's default): a graph is keyed by its token rows only, and on the CPU the
token count is symbolic, so each region compiles twice (one row, then every
larger count); serving then compiles nothing and matches HF.

The same buckets as ``test_graph_mode.py`` (which traces attention into the
graphs, Gaudi's form): there 16 step shapes compile, here 4 token counts in 2
layer graphs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_graph_mode import (
    check_mixed_workload,
    graph_mode_llm,
    write_buckets,
)
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    engine = graph_mode_llm(tiny_llama_dir, write_buckets(tmp_path_factory), "dynamic")
    yield engine
    del engine


def test_warmup_compiled_two_graphs_per_region(llm: object) -> None:
    from vllm_hpu_mm.bucketing.buckets import (
        Limits,
        count_graphs,
        explicit,
        step_shapes,
        token_shapes,
    )

    limits = Limits(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=16
    )
    buckets = explicit(limits, [16, 64], [1, 4], [4, 16, 32])
    decode, prefill = token_shapes(*step_shapes(buckets, limits, "batched"))
    # Token counts 1 and 4 (decode rows), 16 and 64 (prefill tokens), one
    # shape each. On the CPU the count is symbolic: the decoder-layer region
    # compiles for 1 row and once for 4, 16 and 64 together; the logits head
    # likewise for batch sizes 1 and 4.
    assert decode == [(1, 4), (4, 4)]
    assert prefill == [(16, 4), (64, 4)]
    static = count_graphs(buckets, limits, "batched", opaque_attention=True)
    assert static == 6  # one per token count and batch size, as on Gaudi
    expected = count_graphs(
        buckets, limits, "batched", opaque_attention=True, symbolic_tokens=True
    )
    assert expected == 4
    assert _counter("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) == expected


def test_mix_of_decodes_chunks_and_prefix_hits_compiles_nothing(
    llm: object, tiny_llama_dir: str
) -> None:
    """Mixed steps, decodes crossing block buckets, prompts chunked at the
    64-token budget and prefix-cache hits: every step reuses a warmed graph
    whatever its attention shapes."""
    check_mixed_workload(llm, tiny_llama_dir)
