"""Prefix caching on and off on one repeated-image workload, in one run.

The workload (seeded): ``--images`` distinct images, each asked
``--questions-per-image`` questions, in shuffled order; every prompt starts with
the same system text, then the image, then its question (tiny LLaVA prompt
format). More distinct images than vLLM's encoder cache holds, so an image that
comes back has usually been evicted from it and only the prefix cache can spare
the encoder.

Each setting runs in its own process (a fresh engine and metrics dir) and
reports: the prefix-cache hit rate (vLLM's ``vllm:prefix_cache_hits`` /
``queries``, in tokens), encoder runs per image item received (the plugin's
``encoder_runs_total`` / ``mm_items_total``) and throughput of one timed pass.

    .venv/bin/python benchmarks/prefix_cache.py --model models/tiny-llava

Figures, never pass/fail: the machine is shared and noisy.
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

SYSTEM = (
    "You are a careful assistant. Look at the picture the user sends and answer "
    "in one short sentence. "
)
QUESTIONS = [
    "Describe the picture.",
    "What colour is the top left corner?",
    "Is there any text in it?",
    "What shapes can you see?",
    "Is it bright or dark?",
    "What is in the middle?",
    "Name one colour in it.",
    "Is the picture blurry?",
]


def _counter(name: str) -> float:
    from vllm_hpu_mm.metrics_reader import read_metric

    return read_metric(name)


def _image(seed: int) -> Any:
    """A seeded 32x32 RGB image: smooth random colours (distinct per seed)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    corners = rng.uniform(0, 255, size=(2, 2, 3))
    t = np.linspace(0, 1, 32)[:, None, None]
    s = np.linspace(0, 1, 32)[None, :, None]
    rgb = (
        corners[0, 0] * (1 - t) * (1 - s)
        + corners[0, 1] * (1 - t) * s
        + corners[1, 0] * t * (1 - s)
        + corners[1, 1] * t * s
    )
    return Image.fromarray(rgb.astype(np.uint8), mode="RGB")


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    images = [_image(args.seed * 1000 + i) for i in range(args.images)]
    requests = [
        {
            "prompt": f"USER: {SYSTEM}<image>\n{QUESTIONS[q % len(QUESTIONS)]} "
            "ASSISTANT:",
            "multi_modal_data": {"image": images[i]},
        }
        for i in range(args.images)
        for q in range(args.questions_per_image)
    ]
    rng.shuffle(requests)
    return requests


def _prefix_counters(llm: Any) -> tuple[float, float]:
    values = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for metric in llm.get_metrics():
        if metric.name in values:
            values[metric.name] += float(metric.value)
    return values["vllm:prefix_cache_hits"], values["vllm:prefix_cache_queries"]


def run_setting(args: argparse.Namespace, caching: bool) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm: Any = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=caching,
        enforce_eager=args.graph_mode == "eager",
        limit_mm_per_prompt={"image": 1},
        disable_log_stats=False,
        seed=0,
        additional_config={
            "hpu_mm": {"graph_mode": args.graph_mode, "warmup": {"progress_bar": False}}
        },
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # One untimed request with an image and text of its own: first-call costs.
    llm.generate(
        [
            {
                "prompt": "USER: <image>\nHi. ASSISTANT:",
                "multi_modal_data": {"image": _image(999_999)},
            }
        ],
        params,
        use_tqdm=False,
    )
    requests = workload(args)
    hits, queries = _prefix_counters(llm)
    runs, items = (
        _counter("vllm_hpu_mm:encoder_runs_total"),
        _counter("vllm_hpu_mm:mm_items_total"),
    )
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    hits2, queries2 = _prefix_counters(llm)
    runs = _counter("vllm_hpu_mm:encoder_runs_total") - runs
    items = _counter("vllm_hpu_mm:mm_items_total") - items
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(int(o.num_cached_tokens or 0) for o in outs)
    return {
        "prefix_caching": "on" if caching else "off",
        "requests": len(outs),
        "hit_rate_pct": round(100 * (hits2 - hits) / max(queries2 - queries, 1), 1),
        "cached_prompt_tokens_pct": round(100 * cached / max(prompt_tokens, 1), 1),
        "encoder_runs_per_item": round(runs / max(items, 1), 3),
        "total_tok_s": round((prompt_tokens + out_tokens) / elapsed, 1),
        "req_s": round(len(outs) / elapsed, 2),
        "elapsed_s": round(elapsed, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-llava")
    p.add_argument("--images", type=int, default=32, help="distinct images")
    p.add_argument("--questions-per-image", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--graph-mode", default="eager", choices=["eager", "compile"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--caching", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.caching:  # child process: one setting
        result = run_setting(args, args.caching == "on")
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not os.path.isdir(args.model) and args.model == "models/tiny-llava":
        from tools.build_tiny_models import build_tiny_model

        build_tiny_model("models", "tiny-llava")
    rows = []
    child = list(argv if argv is not None else sys.argv[1:])
    for setting in ("off", "on"):
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=tempfile.mkdtemp())
        proc = subprocess.run(
            [sys.executable, __file__, *child, "--caching", setting],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(
                f"prefix caching {setting} failed (exit {proc.returncode})"
            )
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    ratio = rows[1]["total_tok_s"] / max(rows[0]["total_tok_s"], 1e-9)
    print(f"\nprefix caching on / off throughput: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
