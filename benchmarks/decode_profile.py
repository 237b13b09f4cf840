"""Where one decode step's time goes: the engine in-process, its runner's
phases timed (wall and this thread's CPU time), and a torch.profiler table of a
few full-batch decode steps.

    .venv/bin/python benchmarks/decode_profile.py --model .bench/models/bench-llama \\
        --mode compile --num-prompts 32 --input-len 256 --output-len 64

Phases per decode step (every row a decode, ``num_decodes == max_num_seqs``):
``build_step`` (host inputs and attention metadata), ``body`` (the decoder
layers: ``attention`` is the part spent in the attention backend's forward),
``logits``, ``sample`` (``sample_tokens``), the rest of ``execute_model``
(``exec_other``: request table, persistent batch, ordering), and the engine's
own time between steps (``engine``: scheduler, detokenizer, output). Figures,
never pass/fail: read the CPU times on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class Clock:
    """Accumulates wall and thread-CPU seconds per phase, for decode steps."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.active = False
        self.steps = 0

    def wrap(self, name: str, fn: Any) -> Any:
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not clock.active:
                return fn(*args, **kwargs)
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.wall[name] += time.perf_counter() - w
                clock.cpu[name] += time.process_time() - c

        return timed


def _step_parts(t: dict[str, float], total: float) -> dict[str, float]:
    """A step's parts from one clock's totals (``t``: seconds by phase;
    ``total``: the steps' whole time on that clock)."""
    return {
        "build_step": t["build_step"],
        "body (no attention)": t["body"] - t["attention"],
        "attention": t["attention"],
        "logits": t["logits"],
        "exec_other": t["execute_model"] - t["build_step"] - t["body"] - t["logits"],
        "sample": t["sample"],
        "engine": total - t["execute_model"] - t["sample"],
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=".bench/models/bench-llama")
    parser.add_argument("--mode", choices=("compile", "eager"), default="compile")
    parser.add_argument("--graph-attention", default="opaque")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--table-rows", type=int, default=30)
    parser.add_argument("--trace", default="")
    parser.add_argument("--additional-config", default="{}")
    args = parser.parse_args()

    import numpy as np
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from vllm import LLM, SamplingParams

    from vllm_hpu_mm.attention import backend as attn_backend
    from vllm_hpu_mm.worker import graphs as graphs_mod
    from vllm_hpu_mm.worker import inputs as inputs_mod
    from vllm_hpu_mm.worker import model_runner as mr

    clock = Clock()
    runner_cls = mr.HpuMMModelRunner
    mr.build_step = clock.wrap("build_step", inputs_mod.build_step)
    for name, attr in (
        ("execute_model", "execute_model"),
        ("sample", "sample_tokens"),
    ):
        setattr(runner_cls, attr, clock.wrap(name, getattr(runner_cls, attr)))
    graphs_mod.GraphRunner.body = clock.wrap("body", graphs_mod.GraphRunner.body)  # type: ignore[method-assign]
    graphs_mod.GraphRunner.logits = clock.wrap("logits", graphs_mod.GraphRunner.logits)  # type: ignore[method-assign]
    impl = attn_backend.HpuMMAttentionImpl
    impl.forward = clock.wrap("attention", impl.forward)  # type: ignore[method-assign]

    extra = json.loads(args.additional_config)
    hpu = extra.setdefault("hpu_mm", {})
    hpu.setdefault("graph_mode", args.mode)
    if args.mode == "compile":
        hpu.setdefault("graph_attention", args.graph_attention)
    hpu.setdefault("warmup", {"progress_bar": False})
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=2 << 30,
        enforce_eager=args.mode == "eager",
        seed=0,
        additional_config=extra,
    )
    print(f"engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    vocab = 600
    prompts = [
        {"prompt_token_ids": rng.integers(10, vocab, args.input_len).tolist()}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, temperature=0.0
    )
    engine = llm.llm_engine

    # Step the engine ourselves: prefill until every request decodes, then
    # time the decode steps.
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)  # type: ignore[arg-type]
    decode_steps: list[tuple[float, float]] = []
    prof_done = False
    step = 0
    while engine.has_unfinished_requests():
        sched = _scheduler(engine)
        running = len(sched.running) if sched is not None else 0
        waiting = len(sched.waiting) if sched is not None else 0
        in_prefill = (
            any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
            if sched is not None
            else True
        )
        full_decode = waiting == 0 and not in_prefill and running == args.max_num_seqs
        clock.active = full_decode
        w, c = time.perf_counter(), time.process_time()
        if full_decode and not prof_done and step >= 3:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(args.profile_steps):
                    engine.step()
            prof_done = True
            clock.active = False
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=args.table_rows
                ),
                flush=True,
            )
            print(
                prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=args.table_rows
                ),
                flush=True,
            )
            if args.trace:
                prof.export_chrome_trace(args.trace)
            # Profiled steps are not counted in the phase figures.
            for d in (clock.wall, clock.cpu):
                d.clear()
            decode_steps.clear()
            continue
        engine.step()
        if full_decode:
            decode_steps.append((time.perf_counter() - w, time.process_time() - c))
            step += 1
    n = len(decode_steps)
    if not n:
        print("no full decode steps")
        return 1
    wall = sum(s[0] for s in decode_steps)
    cpu = sum(s[1] for s in decode_steps)
    print(
        f"\n{n} full decode steps of {args.max_num_seqs} rows ({args.mode}), "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(f"per step: wall {wall / n * 1e3:.2f} ms, process CPU {cpu / n * 1e3:.2f} ms")
    parts = _step_parts(clock.cpu, cpu)
    walls = _step_parts(clock.wall, wall)
    print(f"{'part':<22}{'cpu ms/step':>12}{'%':>7}{'wall ms/step':>14}")
    for k, v in parts.items():
        print(
            f"{k:<22}{v / n * 1e3:>12.2f}{100 * v / cpu:>7.1f}"
            f"{walls[k] / n * 1e3:>14.2f}"
        )
    return 0


def _scheduler(engine: Any) -> Any:
    core = getattr(engine, "engine_core", None)
    core = getattr(core, "engine_core", core)
    return getattr(core, "scheduler", None)


if __name__ == "__main__":
    raise SystemExit(main())
