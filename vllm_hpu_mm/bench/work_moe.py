"""A mixture-of-experts layer's work on the static plan, counted by ``bench.work``.

A step (``bench.work_steps.TextStep``) is laid out as the static plan lays it
out: its tokens at their rows of the step's exact shape or of its default
(exponential) bucket (``attention.layout.token_row_of_real_tokens``; padding
rows carry one token, so one hidden state, as ``worker.inputs`` pads them),
split into the passes of ``worker.inputs.step_passes`` (a mixed step: the
decode rows, then the prefill rows). In each pass the layer runs as a
``FusedMoE`` layer runs on this platform: ``vllm_hpu_mm.moe.experts_forward``
(softmax top-k, then the ``hpu_mm::moe_experts`` op, its Python body inlined
into the count), with random router and expert weights.

The minimum is each real token through its top-k experts only
(``minimum_moe_flops``: two matmuls, ``6 * H * I`` FLOPs a (token, expert)
pair) and every expert some real token routes to read once
(``MoECount.min_weight_bytes``). The default shape is Qwen3-30B-A3B's routing
(128 experts, top-8) with its hidden and expert sizes divided by 8: the FLOP
ratios do not depend on those two sizes (every term scales with ``H * I``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hpu_kernels.moe import routed_experts_impl
from vllm_hpu_mm.bench.work import WorkCounter, WorkCounts
from vllm_hpu_mm.bench.work_steps import TextStep, block_layout

if TYPE_CHECKING:
    from vllm_hpu_mm.attention.metadata import StepShape


@dataclass(frozen=True, slots=True)
class MoEShape:
    """One MoE layer's sizes (default: Qwen3-30B-A3B's 128 experts, top-8,
    with hidden 2048 and expert size 768 divided by 8)."""

    hidden: int = 256
    inter: int = 96
    experts: int = 128
    top_k: int = 8


@dataclass(frozen=True, slots=True)
class MoECount:
    """An MoE layer's counts over a step, at its exact shape and its bucket."""

    step: TextStep
    exact: WorkCounts
    padded: WorkCounts
    exact_shape: StepShape
    bucket_shape: StepShape
    tokens: int  # real tokens of the step
    padded_tokens: int  # rows of the bucket's passes
    passes: int
    min_flops: int
    min_weight_bytes: int
    experts_routed: int  # experts some real token routes to
    experts_read_padded: int  # experts the bucket's passes ran


def minimum_moe_flops(tokens: int, m: MoEShape) -> int:
    """Each token through its ``top_k`` experts: gate-up (``[H] x [H, 2I]``)
    and down (``[I] x [I, H]``), 2 FLOPs a multiply-add."""
    return 2 * tokens * m.top_k * (2 * m.inter * m.hidden + m.inter * m.hidden)


def expert_bytes(m: MoEShape, dtype: torch.dtype) -> int:
    """One expert's gate-up and down weights."""
    return 3 * m.inter * m.hidden * torch.empty((), dtype=dtype).element_size()


def moe_layer(m: MoEShape, dtype: torch.dtype, seed: int = 0) -> SimpleNamespace:
    """The attributes ``experts_forward`` reads of a ``FusedMoE`` layer, random
    weights (``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``) and a router
    ``[E, H]``; off Gaudi (``habana_moe`` None)."""
    gen = torch.Generator().manual_seed(seed)
    h, i, e = m.hidden, m.inter, m.experts
    return SimpleNamespace(
        top_k=m.top_k,
        renormalize=True,
        habana_moe=None,
        w13_weight=(torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype),
        w2_weight=(torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype),
        router=(torch.randn(e, h, generator=gen) / h**0.5).to(dtype),
    )


def count_moe_step(
    step: TextStep,
    m: MoEShape = MoEShape(),
    block_size: int = 128,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> MoECount:
    """One MoE layer over ``step`` at its exact shape and at its default
    bucket (the limits of ``bench.work_steps.count_step``), counted."""
    from vllm_hpu_mm.attention.metadata import exact_shape
    from vllm_hpu_mm.bucketing.buckets import Limits, default_buckets
    from vllm_hpu_mm.worker.shapes import ShapePolicy

    ql = np.array(step.query_lens, np.int64)
    sl = np.array(step.seq_lens, np.int64)
    exact = exact_shape(ql, sl, block_size)
    limits = Limits(max_num_seqs, max_num_batched_tokens, max_model_len, block_size)
    bucket, _ = ShapePolicy(default_buckets(limits, "exponential"))(exact, len(ql))
    layer = moe_layer(m, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = int(ql.sum())
    real = torch.randn(tokens, m.hidden, generator=gen).to(dtype)
    pad = torch.randn(1, m.hidden, generator=gen).to(dtype)
    runs = [
        _run(step, layer, shape, real, pad, block_size) for shape in (exact, bucket)
    ]
    routed = _experts_of(layer, real)
    return MoECount(
        step=step,
        exact=runs[0][0],
        padded=runs[1][0],
        exact_shape=exact,
        bucket_shape=bucket,
        tokens=tokens,
        padded_tokens=runs[1][1],
        passes=runs[1][2],
        min_flops=minimum_moe_flops(tokens, m),
        min_weight_bytes=len(routed) * expert_bytes(m, dtype),
        experts_routed=len(routed),
        experts_read_padded=len(routed | _experts_of(layer, pad))
        if runs[1][1] > tokens
        else len(routed),
    )


def _experts_of(layer: SimpleNamespace, x: torch.Tensor) -> set[int]:
    from vllm_hpu_mm.moe import softmax_top_k

    _, ids = softmax_top_k(x @ layer.router.t(), layer.top_k, True, x.dtype)
    return {int(e) for e in ids.unique()}


def _run(
    step: TextStep,
    layer: SimpleNamespace,
    shape: StepShape,
    real: torch.Tensor,
    pad: torch.Tensor,
    block_size: int,
) -> tuple[WorkCounts, int, int]:
    """(counts, rows run, passes) of the layer over ``step`` padded to ``shape``."""
    from vllm_hpu_mm.attention.layout import token_row_of_real_tokens
    from vllm_hpu_mm.attention.metadata import build_metadata
    from vllm_hpu_mm.moe import experts_forward
    from vllm_hpu_mm.worker.inputs import step_passes

    ql = np.array(step.query_lens, np.int64)
    sl = np.array(step.seq_lens, np.int64)
    table, slots, _ = block_layout(ql, sl, block_size)
    md = build_metadata(ql, sl, table, slots, block_size, shape, torch.device("cpu"))
    passes = step_passes(md, split=True)  # the static plan splits mixed steps
    x = pad.expand(shape.num_tokens, -1).clone()
    x[torch.from_numpy(token_row_of_real_tokens(ql, shape))] = real
    counter = WorkCounter()
    counter.tag(layer.w13_weight, "weight")
    counter.tag(layer.w2_weight, "weight")
    counter.inline[torch.ops.hpu_mm.moe_experts.default] = routed_experts_impl
    rows = 0
    # no_grad, not inference_mode: see bench.work_steps._run
    with torch.no_grad():
        for p in passes:
            h = x[p.start : p.stop]
            logits = h @ layer.router.t()  # the router: not the experts' work
            with counter, counter.scope("experts"):
                experts_forward(layer, h, logits)
            rows += h.shape[0]
    return counter.counts, rows, len(passes)


def moe_row(c: MoECount) -> dict[str, Any]:
    """The work counter's row: FLOPs and expert weight bytes read, ``work``
    (exact shape over the minimum) and ``pad`` (bucket over exact shape)."""

    def ratios(minimum: int, exact: int, padded: int) -> dict[str, Any]:
        return {
            "min": minimum,
            "work": round(exact / minimum, 3),
            "pad": round(padded / exact, 3),
        }

    return {
        "step": c.step.name,
        "tokens": f"{c.tokens} -> {c.padded_tokens} rows in {c.passes} pass(es)",
        "experts": f"{c.experts_routed} routed ({c.experts_read_padded} with padding)",
        "expert_flops": ratios(
            c.min_flops, sum(c.exact.flops.values()), sum(c.padded.flops.values())
        ),
        "expert_weight_bytes": ratios(
            c.min_weight_bytes, c.exact.read("weight"), c.padded.read("weight")
        ),
    }
