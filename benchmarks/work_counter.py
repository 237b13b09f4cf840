"""The static plan's work per step, counted from the ops that run, against the
minimum the step needs (issue 29).

For each representative text step (``vllm_hpu_mm.bench.work_steps``) it runs
the plugin's attention impl, metadata and pass split on the CPU under a
counting dispatch mode (``vllm_hpu_mm.bench.work``) and prints, per quantity,
the minimum and two ratios: ``work`` (the step at its exact shape: the kernel
form's overhead) and ``pad`` (its default exponential bucket over its exact
shape: bucket padding); the step costs ``work x pad`` times the minimum.
A second table counts one mixture-of-experts layer (``vllm_hpu_mm.bench.
work_moe``: Qwen3-30B-A3B's routing, 128 experts, top-8) over such steps: its
FLOPs and expert weight bytes against each real token through its top-k
experts only.
The last columns count whole-buffer copies of a layer's K or V in the graph
AOTAutograd hands the device compiler for one layer, before that compiler's
reinplacing: with the ``hpu_mm::write_kv`` custom op (CPU, CUDA) and with the
plain ``index_copy_`` the plugin compiles for Gaudi.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/work_counter.py           # table
    PYTHONPATH=$PWD .venv/bin/python benchmarks/work_counter.py --json    # rows
    PYTHONPATH=$PWD .venv/bin/python benchmarks/work_counter.py --moe-only

Figures, not pass/fail; tiny-Llama sizes (2 layers, 4/2 heads of 16, bf16),
realistic sequence lengths, block size 128: the ratios are what matter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _row(count: Any, copies: dict[str, dict[str, int]]) -> dict[str, Any]:
    e, p = count.exact, count.padded

    def kv(w: Any) -> int:
        return int(w.read("kv", "attention") + w.read("kv_new", "attention"))

    def ratios(minimum: int, exact: int, padded: int) -> dict[str, float]:
        return {
            "min": minimum,
            "work": round(exact / minimum, 3),
            "pad": round(padded / exact, 3),
        }

    return {
        "step": count.step.name,
        "exact": str(count.exact_shape),
        "bucket": str(count.bucket_shape),
        "passes": count.passes,
        "attention_flops": ratios(
            count.min_attention_flops, e.flops["attention"], p.flops["attention"]
        ),
        "kv_bytes": ratios(count.min_kv_bytes, kv(e), kv(p)),
        "weight_bytes": ratios(
            count.min_weight_bytes, e.read("weight"), p.read("weight")
        ),
        "eager_copies": sum(e.copies.values()) + sum(p.copies.values()),
        "graph_copies_per_layer": copies,
    }


def _fmt(r: dict[str, Any]) -> str:
    def c(k: str) -> str:
        return f"{r[k]['work']:.2f} x {r[k]['pad']:.2f}"

    cp = r["graph_copies_per_layer"]
    custom = cp.get("custom", {}).get("kv", "-")
    plain = cp.get("plain", {}).get("kv", "-")
    return (
        f"| {r['step']} | {c('attention_flops')} | {c('kv_bytes')} | "
        f"{c('weight_bytes')} | {r['eager_copies']} | "
        f"{custom} / {plain} |"
    )


MLLAMA_TILES = (1, 2, 4)
"""Tiles used by each image of the Mllama vision step (1x1, 1x2, 1x4 grids)."""


def _vision_row(v: Any) -> dict[str, Any]:
    c = v.counts
    return {
        "step": f"Mllama vision, {len(MLLAMA_TILES)} images of {MLLAMA_TILES} tiles",
        "shape": f"every image at 4 tiles x {v.rows_per_tile} rows, one batch",
        "attention_flops": {
            "min": v.min_attention_flops,
            "work": round(c.flops["attention"] / v.min_attention_flops, 3),
        },
        "weight_bytes": {
            "min": v.min_weight_bytes,
            "work": round(c.read("weight") / v.min_weight_bytes, 3),
        },
        "eager_copies": sum(c.copies.values()),
    }


QWEN_GRIDS = ([1, 32, 32], [1, 46, 58], [1, 16, 24], [1, 74, 56])
"""Patch grids of the Qwen2.5-VL step's images (448x448, 644x812, 224x336 and
1036x784 px at 14 px patches)."""


def _qwen_row(model_dir: str, static: bool, released_depth: bool) -> dict[str, Any]:
    """The Qwen2.5-VL vision step with vLLM's encoder attention (one SDPA per
    segment, the dynamic plan off Gaudi) or the static plan's (one masked
    SDPA a layer)."""
    from vllm_hpu_mm.bench.work_qwen import build_tower, count_qwen_vision

    tower, cfg, vc = build_tower(
        model_dir, static=static, released_depth=released_depth
    )
    q = count_qwen_vision(tower, cfg, vc, [list(g) for g in QWEN_GRIDS])
    c = q.counts
    sdpa = sum(v for k, v in c.calls.items() if k == "attention:" + SDPA_OP)
    form = "static: masks, banded windows" if static else "vLLM's, per segment"
    how = (
        "the step's masks built once, no host read"
        if static
        else "a host read of cu_seqlens a layer"
    )
    return {
        "step": f"Qwen2.5-VL vision, {len(QWEN_GRIDS)} images ({form})",
        "shape": f"grids {[g[1:] for g in QWEN_GRIDS]} patches, {q.layers} layers, "
        f"{sdpa} SDPA calls ({sdpa / q.layers:.0f} a layer; the segments: "
        f"{q.segments}), {how}",
        "attention_flops": {
            "min": q.min_attention_flops,
            "work": round(c.flops["attention"] / q.min_attention_flops, 3),
        },
        "weight_bytes": {
            "min": q.min_weight_bytes,
            "work": round(c.read("weight") / q.min_weight_bytes, 3),
        },
        "eager_copies": sum(c.copies.values()),
        "sdpa_calls_per_layer": sdpa / q.layers,
    }


# The CPU's SDPA kernel: every SDPA call reaches it (vLLM's per-segment calls
# also show their composite ``aten.scaled_dot_product_attention`` above it).
SDPA_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def moe_steps(seed: int) -> list[Any]:
    """The MoE table's steps: the text table's decode at 32 requests and
    mixed step, an odd decode batch and two prefills (one a power of two)."""
    from vllm_hpu_mm.bench.work_steps import TextStep, representative_steps

    steps = {s.name: s for s in representative_steps(seed)}
    return [
        steps["decode 32 req"],
        TextStep("decode 20 req", (1,) * 20, steps["decode 32 req"].seq_lens[:20]),
        TextStep("prefill 512 fresh", (512,), (512,)),
        TextStep("prefill 700 fresh", (700,), (700,)),
        steps["mixed 32 dec + 1024 fresh"],
    ]


def _fmt_moe(r: dict[str, Any]) -> str:
    def c(k: str) -> str:
        return f"{r[k]['work']:.2f} x {r[k]['pad']:.2f}"

    return (
        f"| {r['step']} | {r['tokens']} | {r['experts']} | {c('expert_flops')} | "
        f"{c('expert_weight_bytes')} |"
    )


def _fmt_vision(r: dict[str, Any]) -> str:
    return (
        f"| {r['step']} | {r['attention_flops']['work']:.2f} x 1.00 | - | "
        f"{r['weight_bytes']['work']:.2f} x 1.00 | {r['eager_copies']} | - |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object a row")
    parser.add_argument(
        "--no-graph", action="store_true", help="skip the compiled-graph copy count"
    )
    parser.add_argument("--seed", type=int, default=0, help="context lengths' seed")
    parser.add_argument(
        "--moe-only", action="store_true", help="only the MoE layer's table"
    )
    parser.add_argument(
        "--qwen-model",
        default="models/tiny-qwen2_5-vl",
        help="checkpoint whose vision config builds the Qwen2.5-VL tower",
    )
    parser.add_argument(
        "--qwen-released-depth",
        action="store_true",
        help="the Qwen2.5-VL tower at the released depth (32 layers, 4 full "
        "attention) instead of the checkpoint's",
    )
    parser.add_argument(
        "--prefill-tiles",
        action="store_true",
        help="every prefill part in 128-row tiles, as with "
        "bucketing.prefill_one_request false (default: a one-request part "
        "in its own form, as the static plan runs it)",
    )
    args = parser.parse_args(argv)
    # vLLM's log lines (building the Qwen tower) go to stdout with its own
    # handler; without it, its warnings reach stderr and the table stays clean
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

    from vllm_hpu_mm.bench.work_moe import count_moe_step, moe_row
    from vllm_hpu_mm.bench.work_steps import (
        count_compiled_copies,
        count_step,
        representative_steps,
    )
    from vllm_hpu_mm.bench.work_vision import count_mllama_vision

    moe = [moe_row(count_moe_step(step)) for step in moe_steps(args.seed)]
    if args.moe_only:
        _print_moe(moe, args.json)
        return
    rows = []
    for step in representative_steps(args.seed):
        copies = {}
        if not args.no_graph:
            copies = {w: count_compiled_copies(step, w) for w in ("custom", "plain")}
        row = _row(count_step(step, prefill_forms=not args.prefill_tiles), copies)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    vision = _vision_row(count_mllama_vision(list(MLLAMA_TILES)))
    rows.append(vision)
    qwens = [
        _qwen_row(args.qwen_model, static, args.qwen_released_depth)
        for static in (False, True)
    ]
    rows += qwens
    if args.json:
        print(json.dumps(vision))
        for qwen in qwens:
            print(json.dumps(qwen))
        _print_moe(moe, True)
        return
    print(
        "| step | attention FLOPs | K/V bytes read | weight bytes read | "
        "whole copies (eager) | K/V copies a layer in graph (custom op / plain) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(_fmt(r) if "kv_bytes" in r else _fmt_vision(r))
    print("\nwork x pad: the step at its exact shape over the minimum, times its")
    print("bucket over its exact shape. Shapes (exact -> bucket):")
    for r in rows:
        if "exact" in r:
            print(f"  {r['step']}: {r['exact']} -> {r['bucket']}, passes {r['passes']}")
    print(f"  {vision['step']}: {vision['shape']}")
    for qwen in qwens:
        print(f"  {qwen['step']}: {qwen['shape']}")
    print()
    _print_moe(moe, False)


def _print_moe(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    print(
        "| MoE layer (128 experts, top-8) | tokens -> rows | experts | "
        "expert FLOPs | expert weight bytes read |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(_fmt_moe(r))
    print("\nwork x pad as above; the minimum: each real token through its top-k")
    print("experts (FLOPs), every expert a real token routes to read once (bytes).")


if __name__ == "__main__":
    main()
