"""Padding of the bucket strategies on the DESIGN's seeded workloads.

For each workload (single prompts; chunked prefill, FCFS at a 2048-token
budget; decode, batch uniform in 1..max_num_seqs) it pads every step with the
real ``Bucketer`` and prints graphs and padding % per axis for the engine's
default exponential and linear sets and for the planner at a few graph
budgets. The planner is fitted on the same workload drawn with another seed
(``--plan-seed``), so its figures are out of sample.

    .venv/bin/python benchmarks/bucket_padding.py            # markdown table
    .venv/bin/python benchmarks/bucket_padding.py --json     # one object per row

Figures, not a pass/fail test; pure Python, no device.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm_hpu_mm.bucketing.buckets import BucketSet, Limits, from_config
from vllm_hpu_mm.bucketing.planner import (
    WORKLOADS,
    evaluate,
    plan_buckets,
    prompt_lengths,
    simulate_steps,
)
from vllm_hpu_mm.config import BucketingConfig


def engine_default(limits: Limits, strategy: str) -> BucketSet:
    """What the engine prepares for ``strategy`` at the default settings."""
    buckets = from_config(limits, BucketingConfig(strategy=strategy))
    assert buckets is not None
    return buckets


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    limits = Limits(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
    )
    ratio = BucketingConfig().fallback_max_pad_ratio
    rows = []
    for workload in args.workloads:

        def sample(seed: int, workload: str = workload) -> list[Any]:
            lens = prompt_lengths(args.prompts, seed)
            return simulate_steps(lens, limits, args.budget_tokens, seed, [workload])

        steps = sample(args.seed)
        fit_on = sample(args.plan_seed)
        sets = [(s, engine_default(limits, s)) for s in ("exponential", "linear")]
        sets += [
            (f"planned, budget {k}", plan_buckets(fit_on, limits, k))
            for k in args.budgets
        ]
        for name, buckets in sets:
            result = evaluate(buckets, steps, ratio)
            rows.append({"workload": workload, "buckets": name, **result})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = [
        "| workload | buckets | graphs | tokens pad % | batch pad % | blocks pad % "
        "| fallback steps | steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['buckets']} | {r['graphs']} | "
            f"{r['tokens_padding_pct']:.1f} | {r['batch_padding_pct']:.1f} | "
            f"{r['blocks_padding_pct']:.1f} | {r['fallback_steps']} | {r['steps']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument(
        "--prompts",
        type=int,
        default=2000,
        help="prompts per workload (and decode steps)",
    )
    parser.add_argument(
        "--budget-tokens", type=int, default=2048, help="chunked-prefill token budget"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the measured sample"
    )
    parser.add_argument(
        "--plan-seed", type=int, default=1, help="seed of the sample the planner fits"
    )
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[16, 24, 32],
        help="planner graph budgets (default: 16 24 32)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="workloads to run (default: all three)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON, not markdown")
    args = parser.parse_args(argv)
    rows = run(args)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    else:
        limits = (
            f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
            f"{args.max_num_batched_tokens}, max_model_len {args.max_model_len}, "
            f"block {args.block_size}"
        )
        print(
            f"Bucket padding, {args.prompts} prompts per workload, seed {args.seed} "
            f"(planner fitted on seed {args.plan_seed}); {limits}\n"
        )
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
