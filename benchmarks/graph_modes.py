"""Eager against graph mode on one model, side by side in one run.

Each mode runs in its own process (a fresh engine and a fresh metrics dir) on
the same seeded prompts, and reports: engine start and warmup seconds, graph
compilations during warmup and while serving, padding %, and tokens/s.

    .venv/bin/python benchmarks/graph_modes.py --model models/tiny-llama
    .venv/bin/python benchmarks/graph_modes.py \
        --modes eager,compile:traced,compile:opaque

A mode is ``eager``, ``compile`` or ``compile:<graph_attention>`` (``traced``:
attention inside the graphs, Gaudi's default; ``opaque``: vLLM's attention op
between them, the CPU's default).

Figures, never pass/fail: machines are shared and noisy, so read the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any


def _counter(name: str, labels: dict[str, str] | None = None) -> float:
    from vllm_hpu_mm.metrics_reader import read_metric

    return read_metric(name, labels)


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(5, 500) for _ in range(rng.randint(8, args.max_prompt))]
        for _ in range(args.num_prompts)
    ]
    graph_mode, _, attention = args.mode.partition(":")
    hpu_mm: dict[str, Any] = {
        "graph_mode": graph_mode,
        "graph_attention": attention or "auto",
        "warmup": {"progress_bar": False},
    }
    if args.buckets:
        hpu_mm["bucketing"] = {"strategy": "explicit", "file": args.buckets}
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
        additional_config={"hpu_mm": hpu_mm},
    )
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Best of N passes: the machine is shared, the fastest pass is the least
    # disturbed one.
    elapsed = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        elapsed = min(elapsed, time.perf_counter() - start)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(map(len, prompts))
    # Counters span all passes; the padding share is a ratio, so that is fine.
    scheduled = _counter("vllm_hpu_mm:scheduled_tokens_total")
    padded = _counter("vllm_hpu_mm:padded_tokens_total")
    return {
        "mode": args.mode,
        "startup_s": round(startup, 2),
        "warmup_s": round(_counter("vllm_hpu_mm:warmup_seconds"), 2),
        "compiles_warmup": _counter(
            "vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}
        ),
        "compiles_serving": _counter(
            "vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}
        ),
        "padding_pct": round(100 * padded / max(padded + scheduled, 1), 2),
        "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1),
        "output_tok_s": round(out_tokens / elapsed, 1),
        "elapsed_s": round(elapsed, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed passes; best kept")
    p.add_argument("--max-prompt", type=int, default=200)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--buckets", default=None, help="explicit bucket YAML")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--mode", help=argparse.SUPPRESS)  # child process
    args = p.parse_args(argv)

    if args.mode:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return 0
    rows = []
    for mode in args.modes.split(","):
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=tempfile.mkdtemp())
        child = [a for a in (argv if argv is not None else sys.argv[1:])]
        proc = subprocess.run(
            [sys.executable, __file__, *child, "--mode", mode],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"mode {mode} failed (exit {proc.returncode})")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    for row in rows[1:]:
        ratio = row["total_tok_s"] / max(rows[0]["total_tok_s"], 1e-9)
        print(f"{row['mode']} / {rows[0]['mode']} throughput: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
