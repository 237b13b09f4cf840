"""Warmup of the static plan on the CPU, one compile backend against another.

Each backend (``hpu_mm.warmup.compile_backend``) starts its own engine of tiny
Qwen2.5-VL on ``execution: static`` (float32, in its own process, the engine
in-process, a fresh Inductor cache directory) over the same bucket file, all at
once (the default: the same machine load for each) or one after the other
(``--one-by-one``), and reports: engine start and warmup seconds, compilations,
the CPU seconds of its process and the processes it waited for (start-up,
warmup and one short generation), and where torch.compile spent its time (Dynamo's
``compile_times``: the Dynamo trace, AOTAutograd, Inductor's code generation
and its C++ compilation), then one greedy generation's tokens (equal across
backends, float32).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/static_warmup.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/static_warmup.py \\
        --backends inductor,aot_eager --buckets default

``--buckets default`` warms the default bucket set (105 shapes at vLLM's
default limits: minutes per backend on 2 cores). Figures, never pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

SMALL_BUCKETS = "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [8, 32]\n"
PHASES = {
    "dynamo_trace_s": "bytecode_tracing",
    "backend_s": "OutputGraph.call_user_compiler",
    "inductor_codegen_s": "GraphLowering.codegen",
    "cxx_compile_s": "compile_file",
    "guards_s": "build_guards",
}


def run_backend(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in-process
    from vllm import LLM, SamplingParams

    from vllm_hpu_mm.metrics_reader import read_metric

    hpu_mm: dict[str, Any] = {
        "execution": "static",
        "graph_mode": "compile",
        "warmup": {"progress_bar": False, "compile_backend": args.child},
    }
    limits: dict[str, Any] = {}
    if args.buckets != "default":
        path = os.path.join(tempfile.mkdtemp(), "buckets.yaml")
        with open(path, "w") as f:
            f.write(SMALL_BUCKETS)
        hpu_mm["bucketing"] = {"strategy": "explicit", "file": path}
        limits = {
            "max_model_len": 256,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 32,
        }
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        limit_mm_per_prompt={"image": 2},
        seed=0,
        additional_config={"hpu_mm": hpu_mm},
        **limits,
    )
    started = time.perf_counter() - start
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: sum(times) for name, times in compilation_time_metrics.items()}
    out = llm.generate(
        ["The quick brown fox"],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    )
    return {
        "backend": args.child,
        "start_s": round(started, 1),
        "warmup_s": round(read_metric("vllm_hpu_mm:warmup_seconds"), 1),
        "compiles": read_metric(
            "vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}
        ),
        **{k: round(totals.get(v, 0.0), 1) for k, v in PHASES.items()},
        "tokens": list(out[0].outputs[0].token_ids),
    }


def _finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """A child's result row, once, after it exits."""
    if hasattr(proc, "row"):
        return proc.row  # type: ignore[no-any-return]
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    # The child's CPU with the processes it waited for (Inductor's compile
    # workers), which its own getrusage(RUSAGE_SELF) would leave out.
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    row = json.loads(lines[-1][7:]) if lines else {"failed": proc.returncode}
    row["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
    proc.row = row  # type: ignore[attr-defined]
    return row  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen2_5-vl")
    parser.add_argument("--backends", default="inductor,aot_eager")
    parser.add_argument("--buckets", default="small", choices=["small", "default"])
    parser.add_argument("--one-by-one", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_backend(args)), flush=True)
        return
    procs = []
    for backend in args.backends.split(","):
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix=f"ind-{backend}-"),
            "VLLM_CACHE_ROOT": tempfile.mkdtemp(prefix=f"vllm-{backend}-"),
        }
        cmd = [sys.executable, __file__, "--child", backend, "--model", args.model]
        proc = subprocess.Popen(
            [*cmd, "--buckets", args.buckets],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(proc)
        if args.one_by_one:
            _finish(proc)
    rows = [_finish(proc) for proc in procs]
    keys = ["backend", "start_s", "warmup_s", "compiles", "cpu_s", *PHASES, "tokens"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
