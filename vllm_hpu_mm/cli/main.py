"""The ``vllm-hpu-mm`` command: a dispatcher over subcommands.

Each subcommand is registered by a function ``add_parser(subparsers) -> None``
named in ``subcommands()`` as ``"module:function"``. It adds its parser and
sets the default ``handler``: a function ``(argparse.Namespace) -> int`` (the
exit status). Modules are imported when the parser is built, so keep their
heavy imports (torch, vLLM) inside the handler.

``buckets`` (``plan``, ``show``) lives in this module for now; it is plain
Python and numpy (the planner) plus PyYAML (the config module).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_buckets_parser", "build_parser", "main", "read_samples", "subcommands"]


def subcommands() -> dict[str, str]:
    """Subcommand name -> ``"module:function"`` that adds its parser."""
    return {
        "buckets": f"{__name__}:add_buckets_parser",
        "bench": "vllm_hpu_mm.bench.cli:add_parser",
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-hpu-mm",
        description="Tools of the vllm-hpu-mm plugin (Intel Gaudi, CUDA and CPU).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for spec in subcommands().values():
        module_name, func_name = spec.split(":")
        add_parser: Callable[[Any], None] = getattr(
            importlib.import_module(module_name), func_name
        )
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    parser = build_parser()
    # A subcommand that sets ``takes_extra_args`` parses its own arguments
    # (``bench throughput``: vLLM's engine arguments, built only when it runs).
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra_args", False):
        parser.error("unrecognized arguments: " + " ".join(extra))
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        # A command without a subcommand ("vllm-hpu-mm buckets"): its help.
        shown = getattr(args, "help_parser", parser)
        shown.print_help(sys.stderr)
        return 2
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return handler(args)


# --------------------------------------------------------------------------
# vllm-hpu-mm buckets
# --------------------------------------------------------------------------

_LIMIT_DEFAULTS = (
    ("max_num_seqs", 128),
    ("max_num_batched_tokens", 8192),
    ("max_model_len", 8192),
    ("block_size", 128),
)


def add_buckets_parser(subparsers: Any) -> None:
    buckets = subparsers.add_parser(
        "buckets",
        help="plan or show shape buckets",
        description="Plan bucket lists from a workload, or show the default ones.",
    )
    buckets.set_defaults(help_parser=buckets)
    sub = buckets.add_subparsers(dest="buckets_command", metavar="ACTION")

    plan = sub.add_parser(
        "plan",
        help="plan bucket lists from step shapes or a synthetic workload",
        description=(
            "Choose bucket edges that minimise padding on a sample of steps, "
            "within a budget of token sizes + batch sizes (and optionally of "
            "the step-shape graphs warmup compiles), and write them as a "
            "bucketing.file for strategy 'explicit'."
        ),
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--samples",
        type=Path,
        metavar="FILE",
        help="JSONL of step shapes ({num_reqs, num_decodes, decode_blocks, "
        "prefill_tokens, prefill_blocks} per line) or a JSON list of prompt "
        "lengths (simulated like --synthetic)",
    )
    source.add_argument(
        "--metrics",
        type=Path,
        metavar="FILE",
        help="a saved scrape of the server's /metrics (curl http://HOST:PORT/metrics "
        "> FILE): plans from its vllm_hpu_mm:step_shape histogram",
    )
    source.add_argument(
        "--synthetic",
        type=_positive,
        metavar="N",
        help="N seeded prompts (lognormal, median 600, sigma 0.8) through the "
        "workloads of --workloads",
    )
    _add_limits(plan)
    plan.add_argument(
        "--graph-budget",
        type=_positive,
        default=32,
        metavar="K",
        help="most graphs (token sizes + batch sizes) to prepare (default: 32)",
    )
    plan.add_argument(
        "--step-graph-budget",
        type=_positive,
        default=None,
        metavar="G",
        help="most step-shape graphs warmup may compile (decode rows x blocks "
        "+ prefill tokens x blocks + logits sizes, counted for --decode-form); "
        "block sizes the sample uses least are dropped to fit (default: no cap)",
    )
    plan.add_argument(
        "--decode-form",
        choices=("flat", "batched"),
        default="flat",
        help="decode attention that --step-graph-budget counts graphs for: flat "
        "(Gaudi's, the default) or batched (the CPU and CUDA)",
    )
    plan.add_argument(
        "--block-budget",
        type=_positive,
        default=16,
        metavar="K",
        help="most planned KV-block sizes (no graphs on CPU/CUDA), before the "
        "edges doubling up to the limit are added (default: 16)",
    )
    plan.add_argument(
        "--batch-weight",
        type=_non_negative,
        default=1.0,
        help="weight of the logits-row padding share against the token-row "
        "share when splitting the graph budget (default: 1.0)",
    )
    plan.add_argument(
        "--budget-tokens",
        type=_positive,
        default=2048,
        help="token budget of the simulated chunked prefill (default: 2048)",
    )
    plan.add_argument(
        "--workloads",
        default="single,chunked,decode",
        help="simulated workloads, comma-separated, of single, chunked, decode "
        "(default: all three)",
    )
    plan.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    plan.add_argument(
        "--out", type=Path, required=True, help="YAML file to write (bucketing.file)"
    )
    plan.set_defaults(handler=_plan)

    show = sub.add_parser(
        "show",
        help="print the default bucket sets for given limits",
        description="Print the prior (default), exponential and linear bucket "
        "sets the engine prepares (and an explicit file's, with --file).",
    )
    _add_limits(show)
    show.add_argument(
        "--file", type=Path, help="also show this bucket file, clipped to the limits"
    )
    show.set_defaults(handler=_show)

    from vllm_hpu_mm.cli import vision_plan

    vision_plan.add_parser(sub, _positive)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _add_limits(parser: argparse.ArgumentParser) -> None:
    for name, default in _LIMIT_DEFAULTS:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=_positive,
            default=default,
            help=f"the engine's {name} (default: {default})",
        )


def _limits(args: argparse.Namespace) -> Any:
    from vllm_hpu_mm.bucketing.buckets import Limits

    return Limits(**{name: getattr(args, name) for name, _ in _LIMIT_DEFAULTS})


def _engine_default(limits: Any, strategy: str) -> Any:
    """The set the engine prepares for ``strategy`` with the default
    ``hpu_mm.bucketing`` settings."""
    from vllm_hpu_mm.bucketing.buckets import from_config
    from vllm_hpu_mm.config import BucketingConfig

    config = BucketingConfig(strategy=strategy)  # type: ignore[arg-type]
    return from_config(limits, config)


_STEP_KEYS = (
    "num_reqs",
    "num_decodes",
    "decode_blocks",
    "prefill_tokens",
    "prefill_blocks",
)


def read_samples(
    path: Path, limits: Any, *, budget_tokens: int, seed: int, workloads: Sequence[str]
) -> tuple[list[Any], str]:
    """Steps from ``path`` and a description of them.

    JSONL with one step object per line (blank and ``#`` lines skipped), a
    JSON list of step objects, or a JSON list of prompt lengths (simulated
    with ``simulate_steps``).
    """
    from vllm_hpu_mm.bucketing.planner import simulate_steps

    text = path.read_text(encoding="utf-8")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in whole
    ):
        if not whole:
            raise ValueError(f"{path}: the list of prompt lengths is empty")
        steps = simulate_steps(whole, limits, budget_tokens, seed, workloads)
        return (
            steps,
            f"{len(whole)} prompt lengths from {path} ({', '.join(workloads)})",
        )
    if isinstance(whole, list):
        records = [(f"item {i}", r) for i, r in enumerate(whole)]
    elif isinstance(whole, dict):
        records = [("line 1", whole)]
    else:
        records = []
        for no, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                records.append((f"line {no}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {no}: not JSON ({exc})") from exc
    steps = [_step(path, where, record) for where, record in records]
    if not steps:
        raise ValueError(f"{path} holds no steps")
    return steps, f"{len(steps)} steps from {path}"


def _step(path: Path, where: str, record: Any) -> Any:
    from vllm_hpu_mm.bucketing.policy import StepSizes

    if not isinstance(record, dict):
        raise ValueError(
            f"{path}, {where}: a step must be a JSON object, got {record!r}"
        )
    missing = [k for k in _STEP_KEYS if k not in record]
    if missing:
        raise ValueError(
            f"{path}, {where}: missing key(s) {', '.join(missing)} "
            f"(a step has {', '.join(_STEP_KEYS)})"
        )
    values = {k: record[k] for k in _STEP_KEYS}
    bad = {
        k: v
        for k, v in values.items()
        if not isinstance(v, int) or isinstance(v, bool) or v < 0
    }
    if bad:
        raise ValueError(f"{path}, {where}: must be non-negative integers: {bad}")
    return StepSizes(**values)


def _plan(args: argparse.Namespace) -> int:
    from vllm_hpu_mm.bucketing.planner import (
        WORKLOADS,
        evaluate,
        plan_buckets_detailed,
        prompt_lengths,
        simulate_steps,
    )

    limits = _limits(args)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        print(
            f"vllm-hpu-mm: --workloads {args.workloads!r}: choose from "
            f"{', '.join(WORKLOADS)}",
            file=sys.stderr,
        )
        return 2
    if args.metrics is not None:
        return _plan_from_metrics(args, limits)
    try:
        if args.synthetic is not None:
            lens = prompt_lengths(args.synthetic, args.seed)
            steps = simulate_steps(
                lens, limits, args.budget_tokens, args.seed, workloads
            )
            about = (
                f"synthetic, {args.synthetic} prompts ({', '.join(workloads)}), "
                f"seed {args.seed}"
            )
        else:
            steps, about = read_samples(
                args.samples,
                limits,
                budget_tokens=args.budget_tokens,
                seed=args.seed,
                workloads=workloads,
            )
        plan = plan_buckets_detailed(
            steps,
            limits,
            args.graph_budget,
            **_planner_options(args),
        )
    except (OSError, ValueError) as exc:
        print(f"vllm-hpu-mm: {exc}", file=sys.stderr)
        return 1
    rows = [
        ("planned", evaluate(plan.buckets, steps, limits=limits)),
        (
            "prior (default)",
            evaluate(_engine_default(limits, "prior"), steps, limits=limits),
        ),
        (
            "exponential",
            evaluate(_engine_default(limits, "exponential"), steps, limits=limits),
        ),
    ]
    command = "vllm-hpu-mm " + shlex.join(args.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        _bucket_yaml(
            plan.buckets, limits, command, about, len(steps), rows, args.out.name
        ),
        encoding="utf-8",
    )
    print(f"Sample: {len(steps)} steps ({about})")
    print(_table(rows))
    print(f"\nWrote {args.out}")
    return 0


def _planner_options(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's options from ``buckets plan``'s arguments (steps or axes)."""
    return {
        "block_budget": args.block_budget,
        "batch_weight": args.batch_weight,
        "step_graph_budget": args.step_graph_budget,
        "decode_form": args.decode_form,
    }


def _plan_from_metrics(args: argparse.Namespace, limits: Any) -> int:
    """``buckets plan --metrics``: the histogram counts each axis on its own, so
    padding is reported per axis (no per-step fallback count)."""
    from vllm_hpu_mm.bucketing.planner import plan_buckets_from_axes
    from vllm_hpu_mm.bucketing.scrape import read_step_shape_metrics

    try:
        scrape = read_step_shape_metrics(
            args.metrics.read_text(encoding="utf-8"), str(args.metrics)
        )
        axes = scrape.axes()
        plan = plan_buckets_from_axes(
            axes,
            limits,
            args.graph_budget,
            **_planner_options(args),
        )
    except (OSError, ValueError) as exc:
        print(f"vllm-hpu-mm: {exc}", file=sys.stderr)
        return 1
    about = f"the step_shape histogram of {args.metrics}"
    if scrape.above:
        about += ", sizes above its edges not planned: " + ", ".join(
            f"{axis} {n}" for axis, n in sorted(scrape.above.items())
        )
    rows = [
        ("planned", _evaluate_axes(plan.buckets, axes, limits)),
        (
            "prior (default)",
            _evaluate_axes(_engine_default(limits, "prior"), axes, limits),
        ),
        (
            "exponential",
            _evaluate_axes(_engine_default(limits, "exponential"), axes, limits),
        ),
    ]
    command = "vllm-hpu-mm " + shlex.join(args.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        _bucket_yaml(
            plan.buckets, limits, command, about, scrape.steps, rows, args.out.name
        ),
        encoding="utf-8",
    )
    print(f"Sample: {scrape.steps} steps ({about})")
    print(_table(rows))
    print(f"\nWrote {args.out}")
    return 0


def _evaluate_axes(buckets: Any, axes: Any, limits: Any) -> dict[str, Any]:
    """``planner.evaluate``'s figures from per-axis counts (each size padded on
    its own axis; ``fallback_steps``: sizes above their axis)."""
    from vllm_hpu_mm.bucketing.buckets import (
        count_graphs,
        fallback_size,
        one_request_shapes,
        smallest_fit,
    )

    def pad(
        pairs: Sequence[tuple[int, int]], edges: Sequence[int]
    ) -> tuple[int, int, int]:
        real = padded = above = 0
        for v, c in pairs:
            fit = smallest_fit(v, edges)
            if fit is None:
                fit, above = fallback_size(v, edges), above + c
            real, padded = real + v * c, padded + fit * c
        return real, padded, above

    parts = {
        "tokens": [
            pad(axes.decode_rows, buckets.batch),
            pad(axes.prefill_tokens, buckets.tokens),
        ],
        "batch": [pad(axes.requests, buckets.batch)],
        "blocks": [
            pad(axes.decode_blocks, buckets.blocks),
            pad(axes.prefill_blocks, buckets.prefill_blocks),
        ],
    }
    out: dict[str, Any] = {
        "graphs": buckets.num_graphs,
        "step_graphs": count_graphs(buckets, limits, "batched"),
        "step_graphs_flat": count_graphs(buckets, limits, "flat"),
        "one_request_graphs": len(one_request_shapes(buckets, limits)),
        "fallback_steps": sum(a for p in parts.values() for _, _, a in p),
    }
    for axis, p in parts.items():
        real, padded = sum(r for r, _, _ in p), sum(q for _, q, _ in p)
        out[f"{axis}_padding_pct"] = 0.0 if padded == 0 else 100.0 * (1 - real / padded)
    return out


def _bucket_yaml(
    buckets: Any,
    limits: Any,
    command: str,
    about: str,
    num_steps: int,
    rows: list[tuple[str, dict[str, Any]]],
    out_name: str,
) -> str:
    def flow(values: Sequence[int]) -> str:
        return "[" + ", ".join(str(v) for v in values) + "]"

    planned = rows[0][1]
    lines = [
        "# Bucket lists planned by `vllm-hpu-mm buckets plan`, for",
        '#   --additional-config \'{"hpu_mm": {"bucketing": {"strategy": '
        f'"explicit", "file": {json.dumps(out_name)}}}}}}}\'',
        f"# Command: {command}",
        f"# Limits: max_num_seqs={limits.max_num_seqs} "
        f"max_num_batched_tokens={limits.max_num_batched_tokens} "
        f"max_model_len={limits.max_model_len} block_size={limits.block_size}",
        f"# Sample: {num_steps} steps ({about})",
        f"# Sizes: {buckets.num_graphs} ({len(buckets.tokens)} token sizes + "
        f"{len(buckets.batch)} batch sizes); warmup compiles "
        f"{planned['step_graphs']} step-shape graphs (batched decode, CPU/CUDA) "
        f"or {planned['step_graphs_flat']} (flat decode, HPU) plus "
        f"{planned['one_request_graphs']} of one-request prefill forms "
        "(bucketing.prefill_one_request). Padding on the "
        "sample: tokens "
        f"{planned['tokens_padding_pct']:.1f} %, batch "
        f"{planned['batch_padding_pct']:.1f} %, blocks "
        f"{planned['blocks_padding_pct']:.1f} %.",
        "# The largest sizes are the limits, so no step within them takes the "
        "fallback.",
        "",
        "# Prefill token rows of a step (graphs: x the prefill blocks they reach).",
        f"prefill_tokens: {flow(buckets.tokens)}",
        "",
        "# Requests and decode rows per step (one logits graph each; decode "
        "graphs: x the decode blocks they reach).",
        f"decode_batch: {flow(buckets.batch)}",
        "",
        "# KV-cache blocks read (decode: block-table width, or the flat list's "
        "length on HPU; prefill: blocks of the widest tile).",
        f"blocks: {flow(buckets.blocks)}",
        "",
    ]
    return "\n".join(lines)


def _table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    head = (
        "| buckets | sizes | step graphs | tokens pad % | batch pad % "
        "| blocks pad % | fallback steps |"
    )
    out = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        out.append(
            f"| {name} | {r['graphs']} | {r.get('step_graphs', '-')} | "
            f"{r['tokens_padding_pct']:.1f} | "
            f"{r['batch_padding_pct']:.1f} | {r['blocks_padding_pct']:.1f} | "
            f"{r['fallback_steps']} |"
        )
    return "\n".join(out)


def _show(args: argparse.Namespace) -> int:
    from vllm_hpu_mm.bucketing.buckets import count_graphs, explicit, one_request_shapes

    limits = _limits(args)
    strategies = ("prior", "exponential", "linear")
    sets = [(s, _engine_default(limits, s)) for s in strategies]
    if args.file is not None:
        from vllm_hpu_mm.config import ConfigError, load_explicit_buckets

        try:
            lists = load_explicit_buckets(args.file)
        except ConfigError as exc:
            print(f"vllm-hpu-mm: {exc}", file=sys.stderr)
            return 1
        sets.append(
            (
                f"explicit ({args.file})",
                explicit(
                    limits, lists.prefill_tokens, lists.decode_batch, lists.blocks
                ),
            )
        )
    for name, b in sets:
        print(
            f"{name}: {b.num_graphs} sizes, "
            f"{count_graphs(b, limits, 'batched')} step-shape graphs "
            f"({count_graphs(b, limits, 'flat')} with flat decode, plus "
            f"{len(one_request_shapes(b, limits))} one-request prefill graphs "
            "on the static plan)"
        )
        for axis in ("tokens", "batch", "blocks", "prefill_blocks"):
            values = getattr(b, axis)
            if axis == "prefill_blocks" and values == b.blocks:
                continue  # one block list for both parts
            print(f"  {axis} ({len(values)}): {_abbreviate(values)}")
    return 0


def _abbreviate(values: Sequence[int], keep: int = 12) -> str:
    if len(values) <= 2 * keep:
        return ", ".join(str(v) for v in values)
    head = ", ".join(str(v) for v in values[:keep])
    tail = ", ".join(str(v) for v in values[-keep:])
    return f"{head}, ... ({len(values) - 2 * keep} more), {tail}"


if __name__ == "__main__":
    sys.exit(main())
