"""The attention metadata of each execution plan (issue 27 item 1).

The static metadata holds only what a compiled graph may see: tensors of the
bucket's shapes and the bucket's row counts, nothing read on the host, no
empty placeholder for a part the bucket lacks. Each plan builds its own
metadata and never the other's.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hpu_mm.attention import metadata
from vllm_hpu_mm.attention.metadata import (
    DECODE_FORM,
    DynamicAttentionMetadata,
    FlatDecodeInputs,
    PrefillRequests,
    PrefillTileInputs,
    StaticAttentionMetadata,
    StepShape,
    build_metadata,
)
from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.plan import build_plan

CPU = torch.device("cpu")
BS = 4

# Two steps with different real contents that fit one bucket: a graph traced
# for one must serve the other, so the metadata must look the same to it.
#   step 1: decodes of 6 and 4 tokens, prefills of 4 (3 cached) and 2 tokens;
#   step 2: one decode of 9 tokens, one prefill of 3 fresh tokens.
STEP_1 = dict(
    query_lens=np.array([1, 1, 4, 2], np.int64),
    seq_lens=np.array([6, 4, 7, 2], np.int64),
    block_table=np.array([[7, 3, 0], [5, 0, 0], [2, 9, 0], [4, 0, 0]], np.int64),
    slot_mapping=np.array([13, 23, 11, 36, 37, 38, 16, 17], np.int64),
)
STEP_2 = dict(
    query_lens=np.array([1, 3], np.int64),
    seq_lens=np.array([9, 3], np.int64),
    block_table=np.array([[1, 2, 3], [6, 0, 0]], np.int64),
    slot_mapping=np.array([12, 24, 25, 26], np.int64),
)
MIXED = StepShape(
    num_decodes=4, decode_blocks=6, num_prefill_tokens=8, prefill_blocks=5
)


def graph_view(md: object) -> object:
    """What a traced graph sees of the metadata: for every field, a tensor's
    (shape, dtype), an int's value, None, or the same of a nested part."""
    if isinstance(md, torch.Tensor):
        return (tuple(md.shape), md.dtype)
    if dataclasses.is_dataclass(md):
        return {f.name: graph_view(getattr(md, f.name)) for f in dataclasses.fields(md)}
    if isinstance(md, dict):
        return {k: graph_view(v) for k, v in md.items()}
    assert md is None or isinstance(md, int), f"a host value: {md!r}"
    return md


def bucket_shapes(shape: StepShape, tile: int = metadata.PREFILL_TILE) -> dict:
    """The static metadata's fields as the bucket alone fixes them (computed
    here from the bucket, not by the builder's helpers)."""
    b, nb = shape.num_decodes, shape.decode_blocks
    p, cb = shape.num_prefill_tokens, shape.prefill_blocks
    tq = min(tile, p)
    nt = -(-p // tq) if p else 0
    i64, f32 = torch.int64, torch.float32
    decode = {
        "seq_lens": ((b,), i64),
        "block_list": ((nb,), i64),
        "block_req": ((nb,), i64),
        "block_bias": ((nb, BS), f32),
        "block_key_pos": ((nb, BS), i64),
        "block_mapping": ((b, nb), f32),
    }
    prefill = {
        "blocks": ((nt, cb), i64),
        "mask": ((nt, tq, cb * BS), torch.bool),
        "query_pos": ((nt, tq), i64),
        "key_pos": ((nt, cb * BS), i64),
        "span_lo": None,
        "span_hi": None,
    }
    return {
        "num_decodes": b,
        "num_prefill_tokens": p,
        "slot_mapping": ((b + p,), i64),
        "mm_maps": {},
        "cross": None,
        "decode": decode if b else None,
        "prefill": prefill if p else None,
    }


def test_static_metadata_declares_graph_inputs_only() -> None:
    """The class itself: the shared row layout, the two parts, the maps; no
    field a graph would read on the host (real counts, prefill requests,
    the dense cache), no decode form to branch on."""
    names = {f.name for f in dataclasses.fields(StaticAttentionMetadata)}
    assert names == {
        "num_decodes",
        "num_prefill_tokens",
        "slot_mapping",
        "mm_maps",
        "cross",
        "decode",
        "prefill",
    }
    parts = {
        FlatDecodeInputs: {
            "seq_lens",
            "block_list",
            "block_req",
            "block_bias",
            "block_key_pos",
            "block_mapping",
        },
        PrefillTileInputs: {
            "blocks",
            "mask",
            "query_pos",
            "key_pos",
            "span_lo",
            "span_hi",
        },
    }
    for cls, want in parts.items():
        assert {f.name for f in dataclasses.fields(cls)} == want  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "shape",
    [
        MIXED,
        StepShape(4, 6, 0, 0),  # decode only: no prefill part at all
        StepShape(0, 0, 8, 5),  # prefill only: no decode part at all
    ],
    ids=["mixed", "decode", "prefill"],
)
def test_static_metadata_is_the_buckets_shapes(shape: StepShape) -> None:
    """Every field is a tensor of the shape the bucket gives it or an int of
    the bucket key, and a part the bucket lacks is None (not an empty
    tensor); two steps of different real sizes look the same to a graph."""
    views = []
    for step in (STEP_1, STEP_2):
        if not shape.num_prefill_tokens:  # its decode rows only
            step = {k: v[:1] if k != "block_table" else v for k, v in step.items()}
        elif not shape.num_decodes:
            n = 2 if step is STEP_1 else 1
            slots = step["slot_mapping"][n:]
            step = {k: v[n:] for k, v in step.items() if k != "slot_mapping"}
            step["slot_mapping"] = slots
        md = build_metadata(**step, block_size=BS, shape=shape, device=CPU)
        assert type(md) is StaticAttentionMetadata
        tensors = [
            v
            for part in (md, md.decode, md.prefill)
            if part is not None
            for v in vars(part).values()
            if isinstance(v, torch.Tensor)
        ]
        assert all(t.numel() > 0 for t in tensors), "an empty placeholder tensor"
        views.append(graph_view(md))
    assert views[0] == bucket_shapes(shape)
    assert views[1] == views[0]


def test_split_parts_carry_only_their_own_part() -> None:
    md = build_metadata(**STEP_1, block_size=BS, shape=MIXED, device=CPU)
    assert isinstance(md, StaticAttentionMetadata)
    dec, pre = metadata.split_metadata(md)
    assert graph_view(dec) == bucket_shapes(MIXED.decode_part())
    assert graph_view(pre) == bucket_shapes(MIXED.prefill_part())


def test_dynamic_metadata_reads_the_real_rows() -> None:
    md = build_metadata(
        **STEP_1, block_size=BS, shape=StepShape(4, 3, 8, 5), device=CPU, kind="dynamic"
    )
    assert type(md) is DynamicAttentionMetadata
    assert md.real_decodes == 2 and md.decode_block_table.shape == (2, 2)
    assert isinstance(md.prefill, PrefillRequests)


PLANS = [
    (execution, kind)
    for execution in ("static", "dynamic")
    for kind in ("cpu", "cuda", "hpu")
]


@pytest.mark.parametrize(("execution", "kind"), PLANS)
def test_each_plan_builds_only_its_own_metadata(
    execution: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's step (``build_step``) and the memory profile's step build
    the metadata the plan names, and the other builder is never called: the
    dynamic plan off Gaudi the dynamic metadata; the static plan, and the
    dynamic plan on Gaudi (every shape a graph), the static one."""
    from vllm_hpu_mm.worker import profile
    from vllm_hpu_mm.worker.inputs import build_step
    from vllm_hpu_mm.worker.requests import RequestState

    plan = build_plan(HpuMMConfig(execution=execution), kind, False)  # type: ignore[arg-type]
    want = "dynamic" if execution == "dynamic" and kind != "hpu" else "static"
    assert plan.attention_metadata == want
    assert plan.decode_form == DECODE_FORM[want]
    called: list[str] = []
    for name in ("static", "dynamic"):
        real = getattr(metadata, f"build_{name}_metadata")

        def record(*a: object, _real: object = real, _name: str = name) -> object:
            called.append(_name)
            return _real(*a)  # type: ignore[operator]

        monkeypatch.setattr(metadata, f"build_{name}_metadata", record)
    cls = {"static": StaticAttentionMetadata, "dynamic": DynamicAttentionMetadata}

    from vllm import SamplingParams

    states = [
        RequestState(
            "d", [1, 2, 3], SamplingParams(), None, [1], 3, output_token_ids=[4]
        ),
        RequestState("p", list(range(10, 16)), SamplingParams(), None, [2, 3], 0),
    ]
    q = np.array([1, 6], np.int64)
    batch = build_step(
        ["d", "p"],
        states,
        q,
        lambda s, n: (s, n),
        BS,
        CPU,
        kind=plan.attention_metadata,
    )
    assert type(batch.attn_metadata) is cls[want]
    runner = SimpleNamespace(block_size=BS, device=CPU, plan=plan)
    md, _ = profile._prefill_metadata(runner, profile.ProfileShape(16, 8, 4, 0, 1))  # type: ignore[arg-type]
    assert type(md) is cls[want]
    assert called == [want, want]
