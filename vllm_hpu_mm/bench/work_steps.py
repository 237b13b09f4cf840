"""Representative text steps on the static plan, counted by ``bench.work``.

A step is a batch (``query_lens``, ``seq_lens``, decodes first). It runs as the
static plan runs it: metadata from ``attention.metadata.build_metadata`` at the
step's exact shape or padded to its default bucket (``worker.shapes.
ShapePolicy`` over ``bucketing.buckets.default_buckets``), the passes of
``worker.inputs.step_passes`` (a mixed step: a decode pass and a prefill pass),
and in each pass, per layer, the plugin's own ``HpuMMAttentionImpl.forward``
(KV write, flat decode, tiled prefill) with the static plan.

Around the attention, each layer's dense part is a stand-in with the model's
shapes (fused QKV, output, gate-up and down projections as ``nn.Linear`` in
bfloat16; embedding, norms, RoPE and the logits head left out: they add no
attention work and their weights are read like these): the weight reads it
counts are those of the passes the plugin's ``step_passes`` makes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from hpu_kernels.attention import KVCache
from vllm_hpu_mm.bench.work import (
    WorkCounter,
    WorkCounts,
    minimum_attention_flops,
    minimum_kv_bytes,
    minimum_weight_bytes,
)

if TYPE_CHECKING:
    from vllm_hpu_mm.attention.backend import HpuMMAttentionImpl
    from vllm_hpu_mm.attention.metadata import StepShape


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder's sizes (default: the tiny Llama, ``models/tiny-llama``)."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 16
    mlp: int = 128
    layers: int = 2


@dataclass(frozen=True, slots=True)
class TextStep:
    """One step's batch: per request the tokens scheduled and the context
    length after them; decode requests (one token) first."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepCount:
    """A step's counts at its exact shape and at its bucket, and its minimum."""

    step: TextStep
    exact: WorkCounts
    padded: WorkCounts
    min_attention_flops: int
    min_kv_bytes: int
    min_weight_bytes: int
    exact_shape: StepShape
    bucket_shape: StepShape
    passes: int


class StandInLayer(torch.nn.Module):
    """A decoder layer's dense part around the plugin's attention impl."""

    def __init__(self, m: ModelShape, impl: HpuMMAttentionImpl) -> None:
        super().__init__()
        q, kv = m.heads * m.head_size, m.kv_heads * m.head_size
        self.m = m
        self.qkv = torch.nn.Linear(m.hidden, q + 2 * kv, bias=False)
        self.o = torch.nn.Linear(q, m.hidden, bias=False)
        self.gate_up = torch.nn.Linear(m.hidden, 2 * m.mlp, bias=False)
        self.down = torch.nn.Linear(m.mlp, m.hidden, bias=False)
        self.impl = impl

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: KVCache,
        md: object,
        counter: WorkCounter | None = None,
    ) -> torch.Tensor:
        # x: [T, hidden]. counter: None inside a compiled graph (tags and
        # scopes are host-side bookkeeping, not graph ops).
        m, rows = self.m, x.shape[0]
        q_size, kv_size = m.heads * m.head_size, m.kv_heads * m.head_size
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(rows, m.heads, m.head_size)
        k = k.reshape(rows, m.kv_heads, m.head_size).contiguous()
        v = v.reshape(rows, m.kv_heads, m.head_size).contiguous()
        out = torch.empty_like(q)
        if counter is None:
            self.impl.forward(None, q, k, v, kv_cache, md, out)  # type: ignore[arg-type]
        else:
            counter.tag(k, "kv_new")
            counter.tag(v, "kv_new")
            with counter.scope("attention"):
                self.impl.forward(None, q, k, v, kv_cache, md, out)  # type: ignore[arg-type]
        x = x + self.o(out.reshape(rows, q_size))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def static_impl(m: ModelShape) -> HpuMMAttentionImpl:
    """The plugin's attention impl with the static plan (on this CPU)."""
    from vllm_hpu_mm.attention.backend import HpuMMAttentionImpl
    from vllm_hpu_mm.config import HpuMMConfig
    from vllm_hpu_mm.plan import build_plan

    impl = HpuMMAttentionImpl(
        m.heads, m.head_size, m.head_size**-0.5, num_kv_heads=m.kv_heads
    )
    impl.plan = build_plan(
        HpuMMConfig(execution="static", graph_mode="compile"), "cpu", False
    )
    return impl


def random_kv_cache(
    num_blocks: int, block_size: int, m: ModelShape, dtype: torch.dtype
) -> KVCache:
    """A layer's cache as the plugin allocates it (``worker.kv_cache``): a K and
    a V tensor of ``[num_blocks * block_size, Hkv, D]``, random values."""
    shape = (num_blocks * block_size, m.kv_heads, m.head_size)
    return KVCache(
        torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), block_size
    )


def tag_kv_cache(counter: WorkCounter, cache: KVCache) -> None:
    """K and V tagged ``kv``; a whole copy of either one counts once."""
    for t in (cache.key, cache.value):
        counter.tag(t, "kv", whole_bytes=t.numel() * t.element_size())


def block_layout(
    query_lens: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(block table [R, max blocks], slot mapping of the new tokens, blocks
    used + 1): each request's blocks consecutive from block 1 (0 is null)."""
    blocks = -(-seq_lens // block_size)
    table = np.zeros((len(seq_lens), max(int(blocks.max()), 1)), np.int64)
    first = 1
    slots = []
    for r, (q, s, b) in enumerate(zip(query_lens, seq_lens, blocks, strict=True)):
        table[r, :b] = np.arange(first, first + b)
        first += int(b)
        pos = np.arange(s - q, s)
        slots.append(table[r, pos // block_size] * block_size + pos % block_size)
    return table, np.concatenate(slots), first


def count_step(
    step: TextStep,
    m: ModelShape = ModelShape(),
    block_size: int = 128,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    prefill_forms: bool = True,
) -> StepCount:
    """Runs ``step`` at its exact shape and at its default (exponential)
    bucket, counting each.

    ``prefill_forms``: a prefill part of one request runs in its own form
    (``layout.PrefillForm``: ``request`` or ``causal``), as the static plan
    does by default (``bucketing.prefill_one_request``); False: in 128-row
    tiles, as before that setting."""
    from vllm_hpu_mm.attention.metadata import exact_shape
    from vllm_hpu_mm.bucketing.buckets import Limits, default_buckets
    from vllm_hpu_mm.worker.shapes import ShapePolicy

    ql = np.array(step.query_lens, np.int64)
    sl = np.array(step.seq_lens, np.int64)
    exact = exact_shape(ql, sl, block_size)
    if not prefill_forms:
        exact = dataclasses.replace(exact, prefill_form="tiles")
    limits = Limits(max_num_seqs, max_num_batched_tokens, max_model_len, block_size)
    policy = ShapePolicy(default_buckets(limits, "exponential"))
    bucket, _ = policy(exact, len(ql))
    torch.manual_seed(seed)
    impl = static_impl(m)
    layers = torch.nn.ModuleList(StandInLayer(m, impl) for _ in range(m.layers))
    layers = layers.to(dtype).eval()
    runs = []
    passes = 0
    for shape in (exact, bucket):
        counts, passes = _run(step, layers, impl, m, shape, block_size, dtype)
        runs.append(counts)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    return StepCount(
        step=step,
        exact=runs[0],
        padded=runs[1],
        min_attention_flops=minimum_attention_flops(
            ql.tolist(), sl.tolist(), m.heads, m.head_size, m.layers
        ),
        min_kv_bytes=minimum_kv_bytes(
            sl.tolist(), m.kv_heads, m.head_size, dtype_bytes, m.layers
        ),
        min_weight_bytes=minimum_weight_bytes(layers),
        exact_shape=exact,
        bucket_shape=bucket,
        passes=passes,
    )


def _run(
    step: TextStep,
    layers: torch.nn.ModuleList,
    impl: HpuMMAttentionImpl,
    m: ModelShape,
    shape: StepShape,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[WorkCounts, int]:
    from vllm_hpu_mm.attention.metadata import build_metadata
    from vllm_hpu_mm.worker.inputs import step_passes

    ql = np.array(step.query_lens, np.int64)
    sl = np.array(step.seq_lens, np.int64)
    table, slots, num_blocks = block_layout(ql, sl, block_size)
    md = build_metadata(
        ql,
        sl,
        table,
        slots,
        block_size,
        shape,
        torch.device("cpu"),  # type: ignore[arg-type]
    )
    caches = [random_kv_cache(num_blocks, block_size, m, dtype) for _ in layers]
    counter = WorkCounter()
    counter.tag_module(layers, "weight")
    for c in caches:
        tag_kv_cache(counter, c)
    x = torch.randn(md.num_decodes + md.num_prefill_tokens, m.hidden).to(dtype)
    passes = step_passes(md, split=impl.plan.split_mixed_steps)
    # no_grad, not inference_mode: under inference_mode composite ops
    # (linear, SDPA) reach the counter undecomposed, without their matmuls.
    with torch.no_grad(), counter:
        for p in passes:
            h = x[p.start : p.stop]
            for layer, cache in zip(layers, caches, strict=True):
                h = layer(h, cache, p.attn_metadata, counter)
    return counter.counts, len(passes)


def count_compiled_copies(
    step: TextStep,
    write: str = "custom",
    m: ModelShape = ModelShape(),
    block_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, int]:
    """Whole-buffer copies per layer in the graph AOTAutograd hands the device
    compiler for one layer of ``step`` (exact shape), before any reinplacing
    pass of that compiler: ``write="custom"`` with the ``hpu_mm::write_kv``
    custom op (CPU, CUDA: Inductor reinplaces its ``auto_functionalized``),
    ``"plain"`` with ``write_kv_plain`` (what the plugin compiles for
    ``hpu_backend``, whose bridge reinplaces only ``index_copy`` on non-view
    inputs). The write-back of a mutated graph input (AOTAutograd's runtime
    ``copy_``, outside the graph) is not counted."""
    from torch._dynamo.backends.common import aot_autograd

    from hpu_kernels.attention import write_kv, write_kv_plain
    from vllm_hpu_mm.attention.metadata import build_metadata, exact_shape

    ql = np.array(step.query_lens, np.int64)
    sl = np.array(step.seq_lens, np.int64)
    table, slots, num_blocks = block_layout(ql, sl, block_size)
    shape = exact_shape(ql, sl, block_size)
    md = build_metadata(ql, sl, table, slots, block_size, shape, torch.device("cpu"))
    impl = static_impl(m)
    impl.write_kv = write_kv_plain if write == "plain" else write_kv  # type: ignore[attr-defined]
    layer = StandInLayer(m, impl).to(dtype).eval()
    cache = random_kv_cache(num_blocks, block_size, m, dtype)
    counter = WorkCounter()
    tag_kv_cache(counter, cache)

    def compiler(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> object:
        def run(args: list[object]) -> object:
            with counter:
                return gm(*args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def call(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return layer(x, KVCache(key, value, block_size), md)

    fn = torch.compile(call, backend=aot_autograd(fw_compiler=compiler), dynamic=False)
    x = torch.randn(shape.num_tokens, m.hidden).to(dtype)
    with torch.no_grad():
        fn(x, cache.key, cache.value)
    torch._dynamo.reset()
    return dict(counter.counts.copies)


def representative_steps(seed: int = 0) -> list[TextStep]:
    """Decode at 32 and 128 requests (contexts 512-4096, mixed), a fresh
    2048-token prefill, a 2048-token chunk after 4096 tokens of context, and
    a mixed step (32 decodes and a fresh 1024-token prompt)."""
    rng = np.random.default_rng(seed)

    def contexts(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in rng.integers(512, 4097, n))

    d32, d128 = contexts(32), contexts(128)
    return [
        TextStep("decode 32 req", (1,) * 32, d32),
        TextStep("decode 128 req", (1,) * 128, d128),
        TextStep("prefill 2048 fresh", (2048,), (2048,)),
        TextStep("chunk 2048 after 4096 ctx", (2048,), (6144,)),
        TextStep("mixed 32 dec + 1024 fresh", (1,) * 32 + (1024,), (*d32, 1024)),
    ]
