"""The work counter (``vllm_hpu_mm.bench.work``): what it counts from the ops
that run, its minimum formulas against hand-computed cases, and a small real
step of the static plan (``bench.work_steps``: the plugin's own metadata,
pass split and attention impl)."""

from __future__ import annotations

import pytest
import torch

from hpu_kernels.attention import _gather_blocks, kv_cache_of_stacked
from vllm_hpu_mm.bench.work import (
    WorkCounter,
    minimum_attention_flops,
    minimum_kv_bytes,
)
from vllm_hpu_mm.bench.work_steps import (
    ModelShape,
    TextStep,
    count_compiled_copies,
    count_step,
)

BS = 16
M = ModelShape()  # tiny Llama: 4 heads, 2 KV heads of 16, 2 layers
KV_TOKEN = 2 * M.kv_heads * M.head_size * 2  # K and V bytes of a token (bf16)


def _cache() -> torch.Tensor:
    return torch.randn(2, 8, BS, 2, 16, dtype=torch.bfloat16)


def test_a_duplicated_read_counts_twice() -> None:
    cache = _cache()
    blocks = torch.tensor([[1, 3]])

    def once(counter: WorkCounter) -> None:
        with counter:
            _gather_blocks(kv_cache_of_stacked(cache), blocks)

    def twice(counter: WorkCounter) -> None:
        with counter:
            _gather_blocks(kv_cache_of_stacked(cache), blocks)
            _gather_blocks(kv_cache_of_stacked(cache), blocks)  # the same K/V again

    one, two = WorkCounter(), WorkCounter()
    for counter, run in ((one, once), (two, twice)):
        counter.tag(cache, "kv")
        run(counter)
    block_bytes = 2 * BS * 2 * 16 * 2  # K and V of one block
    assert one.counts.read("kv") == 2 * block_bytes  # 2 blocks, not the cache
    assert two.counts.read("kv") == 2 * one.counts.read("kv")


def test_views_read_nothing_and_writes_are_not_reads() -> None:
    cache = _cache()
    counter = WorkCounter()
    counter.tag(cache, "kv")
    rows = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    with counter:
        flat = cache.view(2, 8 * BS, 2, 16)[0].transpose(1, 2)
        flat.transpose(1, 2).index_copy_(0, torch.tensor([17, 18, 19]), rows)
    assert counter.counts.read("kv") == 0
    assert counter.counts.writes["kv"] == rows.numel() * 2


def test_a_clone_of_the_cache_is_a_whole_buffer_copy() -> None:
    cache = _cache()
    counter = WorkCounter()
    # one layer's K or V is the unit: this cache holds both
    counter.tag(cache, "kv", whole_bytes=cache[0].numel() * 2)
    with counter:
        cache[0].index_select(0, torch.tensor([1, 2]))  # a read, not a copy
        assert dict(counter.counts.copies) == {}
        cache.clone()
    assert counter.counts.copies["kv"] == 2


def test_matmul_flops_by_scope() -> None:
    counter = WorkCounter()
    a, b = torch.randn(3, 8), torch.randn(8, 5)
    with counter:
        a @ b
        with counter.scope("attention"):
            a @ b
            a @ b
    assert counter.counts.flops["other"] == 2 * 3 * 8 * 5
    assert counter.counts.flops["attention"] == 2 * 2 * 3 * 8 * 5


def test_minimum_attention_flops_by_hand() -> None:
    # fresh prompt of 3: keys 1 + 2 + 3; H=1, D=1: 4 FLOPs a key
    assert minimum_attention_flops([3], [3], 1, 1) == 4 * 6
    # chunk of 2 after 3: positions 3 and 4 attend 4 and 5 keys
    assert minimum_attention_flops([2], [5], 1, 1) == 4 * 9
    # a decode at length 10, plus the chunk; H=2, D=8, 3 layers
    assert minimum_attention_flops([1, 2], [10, 5], 2, 8, 3) == 3 * (10 + 9) * 4 * 16


def test_minimum_kv_bytes_by_hand() -> None:
    # 10 + 6 tokens, K and V, 2 heads of 4, bf16, 2 layers
    assert minimum_kv_bytes([10, 6], 2, 4, 2, 2) == 2 * 16 * 2 * 2 * 4 * 2


def _small(step: TextStep):  # type: ignore[no-untyped-def]
    return count_step(
        step,
        M,
        block_size=BS,
        max_num_seqs=4,
        max_num_batched_tokens=128,
        max_model_len=256,
    )


def test_decode_step_reads_its_blocks_once_and_its_weights_once() -> None:
    c = _small(TextStep("decode", (1, 1), (130, 7)))
    e = c.exact
    # flat decode reads the rows' 9 + 1 blocks, each layer
    assert e.read("kv", "attention") == M.layers * 10 * BS * KV_TOKEN
    assert c.min_kv_bytes == M.layers * 137 * KV_TOKEN
    assert e.read("kv_new", "attention") == 0  # decode reads its K/V from the cache
    assert e.read("weight") == c.min_weight_bytes
    assert dict(e.copies) == {}
    assert e.writes["kv"] == M.layers * 2 * KV_TOKEN  # one token a request


def test_fresh_prefill_computes_the_whole_square() -> None:
    c = _small(TextStep("prefill", (64,), (64,)))
    # one tile of 64 rows over its 4 blocks: the square, against the triangle
    square = M.layers * 4 * M.heads * M.head_size * 64 * 64
    assert c.exact.flops["attention"] == square
    assert c.min_attention_flops == M.layers * 4 * M.heads * M.head_size * 64 * 65 // 2
    assert c.exact.read("kv", "attention") == c.min_kv_bytes


def test_one_request_forms_read_its_kv_once_and_a_fresh_prompt_the_triangle() -> None:
    # 512 rows of one request. In 128-row tiles (prefill_forms off) each of the
    # 4 tiles gathers the widest tile's blocks (all of them) and computes the
    # masked square; in its own form the request's blocks are gathered once.
    kw = {"max_num_batched_tokens": 512, "max_model_len": 1024, "max_num_seqs": 4}
    fresh = TextStep("prefill", (512,), (512,))
    tiles = count_step(fresh, M, block_size=BS, prefill_forms=False, **kw)  # type: ignore[arg-type]
    causal = count_step(fresh, M, block_size=BS, **kw)  # type: ignore[arg-type]
    assert causal.exact_shape.prefill_form == "causal"
    assert tiles.exact.read("kv", "attention") == 4 * tiles.min_kv_bytes
    assert causal.exact.read("kv", "attention") == causal.min_kv_bytes
    # tiles: the square; the causal form: each row's own keys, the minimum
    square = M.layers * 4 * M.heads * M.head_size * 512 * 512
    assert tiles.exact.flops["attention"] == square
    assert causal.exact.flops["attention"] == causal.min_attention_flops
    # a chunk after 512 tokens of context: one tile over all 64 blocks, once
    chunk = TextStep("chunk", (512,), (1024,))
    one = count_step(chunk, M, block_size=BS, **kw)  # type: ignore[arg-type]
    tiled = count_step(chunk, M, block_size=BS, prefill_forms=False, **kw)  # type: ignore[arg-type]
    assert one.exact_shape.prefill_form == "request"
    assert one.exact.read("kv", "attention") == one.min_kv_bytes
    assert tiled.exact.read("kv", "attention") == 4 * tiled.min_kv_bytes
    assert one.exact.flops["attention"] == tiled.exact.flops["attention"]
    # two requests keep their tiles
    two = TextStep("prefill", (256, 256), (256, 256))
    kept = count_step(two, M, block_size=BS, **kw)  # type: ignore[arg-type]
    base = count_step(two, M, block_size=BS, prefill_forms=False, **kw)  # type: ignore[arg-type]
    assert kept.exact_shape.prefill_form == "tiles"
    assert kept.exact.read("kv", "attention") == base.exact.read("kv", "attention")
    assert kept.exact.flops == base.exact.flops


def test_mixed_step_reads_every_weight_twice() -> None:
    c = _small(TextStep("mixed", (1, 1, 20), (40, 9, 20)))
    assert c.passes == 2
    assert c.exact.read("weight") == 2 * c.min_weight_bytes
    assert c.padded.read("weight") == 2 * c.min_weight_bytes


@pytest.mark.parametrize("write", ["custom", "plain"])
def test_compiled_kv_write_copies_the_cache(write: str) -> None:
    """In the graph AOTAutograd hands the compiler (before reinplacing), each
    write of a layer's separate K and V tensors is a whole-tensor copy: the
    custom op's ``auto_functionalized`` clones each (Inductor reinplaces it),
    the plain ``index_copy_`` becomes a functional ``index_copy`` of each
    (Habana's bridge reinplaces an ``index_copy`` on a non-view input: the
    simulated ``hpu_backend`` shows zero copies after its pass, in
    ``test_gaudi_sim``). With K and V as views of one ``[2, ...]`` tensor the
    plain write was 6 copies a layer: ``select_scatter`` of the whole base."""
    step = TextStep("mixed", (1, 20), (40, 20))
    assert count_compiled_copies(step, write, M, block_size=BS) == {"kv": 2}


def test_mllama_vision_runs_every_image_at_its_padded_tiles() -> None:
    """28 px tiles of 14 px patches: 4 patches + CLS = 5 rows, padded to 8.
    Images of 1 and 4 tiles both run 4 tiles x 8 rows; the minimum is their
    real rows (5 and 20) against each other."""
    from vllm_hpu_mm.bench.work_vision import VisionShape, count_mllama_vision

    s = VisionShape(image_size=28)
    v = count_mllama_vision([1, 4], s)
    layers = s.layers + s.global_layers
    assert v.rows_per_tile == 8
    assert v.counts.flops["attention"] == layers * 2 * 4 * 32**2 * s.hidden
    assert v.min_attention_flops == layers * 4 * (5**2 + 20**2) * s.hidden
    assert v.counts.read("weight") == v.min_weight_bytes  # one batch: read once


def _scores_impl(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q @ k.transpose(-1, -2)


_scores = torch.library.custom_op("work_test::scores", mutates_args=())(_scores_impl)


@_scores.register_fake
def _(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], k.shape[0])


def test_an_inlined_custom_op_is_counted_from_the_inside() -> None:
    """vLLM's vision attention is one custom op (``vllm.torch_sdpa_wrapper``):
    opaque, its matmuls go uncounted; inlined, they count."""
    q, k = torch.randn(4, 8), torch.randn(6, 8)
    opaque, inlined = WorkCounter(), WorkCounter()
    inlined.inline[torch.ops.work_test.scores.default] = _scores_impl
    for counter in (opaque, inlined):
        with counter:
            torch.ops.work_test.scores(q, k)
    assert sum(opaque.counts.flops.values()) == 0
    assert inlined.counts.flops["other"] == 2 * 4 * 6 * 8


def test_qwen_segments_by_hand() -> None:
    from vllm_hpu_mm.bench.work_qwen import qwen_segments

    # 16 x 24 patches: 8 x 12 merged units, windows of 4 x 4 units (64 patches)
    assert qwen_segments([1, 16, 24], 2, 4) == ([384], [64] * 6)
    # 10 x 6 patches: 5 x 3 units, one full window row and a clipped one
    assert qwen_segments([1, 10, 6], 2, 4) == ([60], [48, 12])
