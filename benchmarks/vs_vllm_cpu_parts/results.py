"""What benchmarks/vs_vllm_cpu.py reads back from each engine (vLLM's log,
our JSON report) and the tables it prints."""

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.vs_vllm_cpu_parts.engines import (
    HF_NAME,
    OURS_GRAPH,
    STARTUP_MARK,
    VLLM_CPU,
    Workload,
)

# --- parsing what the engines report ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One engine's figures on one workload."""

    engine: str
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    startup_s: float | None = None  # engine start, warmup included
    warmup_s: float | None = None  # of which warmup / compilation


_INIT_RE = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s"
    r"(?:econds)?(?: \(compilation: ([0-9.]+) s)?"
)
_TOKENS_RE = re.compile(r"Total num (prompt|output) tokens:\s+(\d+)")
_STARTUP_RE = re.compile(re.escape(STARTUP_MARK) + r" ([0-9.]+) s")


def parse_vllm_log(log: str) -> dict[str, float | int]:
    """From ``vllm bench throughput``'s output: the engine's start (the
    launcher's line), its init seconds (profile, KV cache, compilation and
    warmup), its compilation seconds and its prompt / output token counts (the
    JSON has only their sum)."""
    found: dict[str, float | int] = {}
    startup = _STARTUP_RE.findall(log)
    if startup:
        found["startup_s"] = float(startup[-1])
    init = _INIT_RE.findall(log)
    if init:
        total, compile_s = init[-1]
        found["init_s"] = float(total)
        if compile_s:
            found["compile_s"] = float(compile_s)
    for kind, count in _TOKENS_RE.findall(log):
        found[f"{kind}_tokens"] = int(count)
    return found


def vllm_cpu_row(
    data: Mapping[str, Any], log: str, w: Workload, engine: str = VLLM_CPU
) -> Row:
    """vLLM's ``--output-json`` plus its log, as a ``Row`` named ``engine``."""
    elapsed = float(data["elapsed_time"])
    found = parse_vllm_log(log)
    output = int(found.get("output_tokens", w.output_tokens))
    prompt = int(found.get("prompt_tokens", int(data["total_num_tokens"]) - output))
    return Row(
        engine=engine,
        requests_per_s=float(data["requests_per_second"]),
        output_tokens_per_s=output / elapsed,
        total_tokens_per_s=float(data["tokens_per_second"]),
        prompt_tokens=prompt,
        output_tokens=output,
        elapsed_s=elapsed,
        startup_s=float(found["startup_s"]) if "startup_s" in found else None,
        warmup_s=float(found["init_s"]) if "init_s" in found else None,
    )


def ours_rows(report: Mapping[str, Any], ours_name: str) -> list[Row]:
    """The rows of one ``vllm-hpu-mm bench throughput`` report: ours (named
    ``ours_name``) and HF when it ran."""
    rows = []
    for backend, r in report["results"].items():
        tokens, tps = r["tokens"], r["tokens_per_s"]
        ours = backend == "vllm-hpu-mm"
        rows.append(
            Row(
                engine=ours_name if ours else HF_NAME,
                requests_per_s=float(r["requests_per_s"]),
                output_tokens_per_s=float(tps["output"]),
                total_tokens_per_s=float(tps["total"]),
                prompt_tokens=int(tokens["prompt_text"]) + int(tokens["prompt_image"]),
                output_tokens=int(tokens["output"]),
                elapsed_s=float(r["elapsed_s"]),
                startup_s=float(r["startup_s"]) if ours else None,
                warmup_s=float(r["warmup_s"]) if ours else None,
            )
        )
    return rows


def token_mismatches(rows: Sequence[Row], w: Workload) -> list[str]:
    """Engines whose token counts are not the workload's: their throughputs
    would not compare."""
    return [
        f"{r.engine}: {r.prompt_tokens} prompt + {r.output_tokens} output tokens, "
        f"expected {w.prompt_tokens} + {w.output_tokens}"
        for r in rows
        if (r.prompt_tokens, r.output_tokens) != (w.prompt_tokens, w.output_tokens)
    ]


# --- tables -------------------------------------------------------------------------


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def main_table(rows: Sequence[Row], baseline: str = OURS_GRAPH) -> str:
    """The engines side by side, as a Markdown table, with each engine's
    requests/s over ``baseline``'s."""
    base = next((r.requests_per_s for r in rows if r.engine == baseline), None)
    lines = [
        f"| engine | requests/s | output tok/s | vs {baseline} "
        "| startup s | warmup s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.engine} | {r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | "
            f"{_fmt(_ratio(r.requests_per_s, base), '.2f', 'x')} | "
            f"{_fmt(r.startup_s, '.1f')} | {_fmt(r.warmup_s, '.1f')} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ScalingPoint:
    """One cell of the scaling grid: each engine's row (None: it failed)."""

    input_len: int
    max_num_seqs: int
    num_prompts: int
    ours: Row | None
    vllm_cpu: Row | None
    hf: Row | None = None


def scaling_table(points: Sequence[ScalingPoint]) -> str:
    """Output tokens/s per grid point, and ours over vLLM CPU (and over HF)."""
    with_hf = any(p.hf is not None for p in points)
    head = (
        "| prompt | batch | requests | ours tok/s | vLLM CPU tok/s | ours / vLLM CPU |"
    )
    sep = "|---:|---:|---:|---:|---:|---:|"
    if with_hf:
        head += " HF tok/s | ours / HF |"
        sep += "---:|---:|"
    lines = [head, sep]
    for p in points:
        ours = p.ours.output_tokens_per_s if p.ours else None
        cpu = p.vllm_cpu.output_tokens_per_s if p.vllm_cpu else None
        line = (
            f"| {p.input_len} | {p.max_num_seqs} | {p.num_prompts} | "
            f"{_fmt(ours, '.1f')} | {_fmt(cpu, '.1f')} | "
            f"{_fmt(_ratio(ours, cpu) if ours else None, '.2f', 'x')} |"
        )
        if with_hf:
            hf = p.hf.output_tokens_per_s if p.hf else None
            line += (
                f" {_fmt(hf, '.1f')} | "
                f"{_fmt(_ratio(ours, hf) if ours else None, '.2f', 'x')} |"
            )
        lines.append(line)
    return "\n".join(lines)
