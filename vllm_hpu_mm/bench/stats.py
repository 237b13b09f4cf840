"""Per-request records, their summary, and the report (its JSON layout).

A backend turns its outputs into ``RequestRecord``s and measures the elapsed
time of the whole batch; ``backend_result`` derives requests/s, tokens/s and
latency percentiles from them; ``build_report`` puts the backends' results
side by side (with the ratio vllm-hpu-mm / hf when both ran). ``check_report``
checks a report against the schema, the pydantic models ``Report``,
``BackendResult`` and ``VllmResult``: the keys and types every report has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA = "vllm-hpu-mm/bench-throughput/v1"
VLLM = "vllm-hpu-mm"
HF = "hf"
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one finished request measured."""

    prompt_tokens: int  # all prompt tokens, image placeholders included
    image_tokens: int  # prompt tokens that are image placeholders
    output_tokens: int
    ttft_s: float  # first token time, from the request's arrival
    tpot_s: float | None  # mean time per output token after the first
    e2e_s: float  # arrival to last token
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by ``numpy.percentile`` (linear between
    closest ranks)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    return float(np.percentile(values, q))


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99`` and ``max`` (all None when empty)."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "max"]
    if not values:
        return dict.fromkeys(keys)
    qs = np.percentile(values, PERCENTILES)
    out: dict[str, float | None] = {"mean": float(np.mean(values))}
    out.update({f"p{q}": float(v) for q, v in zip(PERCENTILES, qs, strict=True)})
    out["max"] = float(np.max(values))
    return out


def backend_result(
    backend: str,
    records: Sequence[RequestRecord],
    elapsed_s: float,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Throughput and latency of one backend's run of ``records`` in
    ``elapsed_s`` seconds; ``extra`` adds backend-specific sections."""
    if elapsed_s <= 0:
        raise ValueError(f"elapsed time must be positive, got {elapsed_s}")
    prompt = sum(r.prompt_tokens for r in records)
    image = sum(r.image_tokens for r in records)
    output = sum(r.output_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    result: dict[str, Any] = {
        "backend": backend,
        "num_requests": len(records),
        "elapsed_s": elapsed_s,
        "requests_per_s": len(records) / elapsed_s,
        "tokens": {
            "prompt_text": prompt - image,
            "prompt_image": image,
            "output": output,
            "total": prompt + output,
            "prompt_cached": cached,
        },
        "tokens_per_s": {
            "total": (prompt + output) / elapsed_s,
            "output": output / elapsed_s,
            "text": (prompt - image + output) / elapsed_s,  # image tokens left out
        },
        "ttft_s": summarize([r.ttft_s for r in records]),
        "tpot_s": summarize([r.tpot_s for r in records if r.tpot_s is not None]),
        "e2e_s": summarize([r.e2e_s for r in records]),
        "requests": [asdict(r) for r in records],
    }
    result.update(extra or {})
    return result


def build_report(
    config: Mapping[str, Any], results: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The whole report: the run's settings and each backend's result, plus
    the ratio vllm-hpu-mm / hf of the throughputs when both ran."""
    by_name = {r["backend"]: dict(r) for r in results}
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "config": dict(config),
        "results": by_name,
    }
    if VLLM in by_name and HF in by_name:
        ours, theirs = by_name[VLLM], by_name[HF]
        report["ratio_vllm_hpu_mm_over_hf"] = {
            "requests_per_s": _ratio(ours["requests_per_s"], theirs["requests_per_s"]),
            "total_tokens_per_s": _ratio(
                ours["tokens_per_s"]["total"], theirs["tokens_per_s"]["total"]
            ),
            "output_tokens_per_s": _ratio(
                ours["tokens_per_s"]["output"], theirs["tokens_per_s"]["output"]
            ),
        }
    return report


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


# --- schema -------------------------------------------------------------------------
#
# The report's layout as pydantic models (strict: an int where a float is expected
# is accepted, a boolean or a string for a number is not; extra keys are allowed, so
# a backend may add sections). ``Report.model_json_schema()`` is its JSON Schema.


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class Summary(_Schema):
    """``summarize``'s keys: None when there were no values."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


class Tokens(_Schema):
    prompt_text: int
    prompt_image: int
    output: int
    total: int
    prompt_cached: int


class TokensPerS(_Schema):
    total: float
    output: float
    text: float


class PeakMemory(_Schema):
    device_bytes: int
    host_rss_bytes: int


class BackendResult(_Schema):
    """What every backend reports."""

    backend: str
    num_requests: int
    elapsed_s: float
    requests_per_s: float
    tokens: Tokens
    tokens_per_s: TokensPerS
    ttft_s: Summary
    tpot_s: Summary
    e2e_s: Summary
    requests: list[Any]
    peak_memory: PeakMemory


class GraphsCompiled(_Schema):
    warmup: int
    after_warmup: int


class Padding(_Schema):
    scheduled_tokens: int
    padded_tokens: int
    waste_pct: float
    fallback_steps: int
    by_bucket: dict[str, Any]


class Encoder(_Schema):
    runs: int
    mm_items: int  # images in the timed requests
    distinct_items: int
    runs_per_item: float | None
    vision_patches: int  # real patches through a bucketed vision tower
    vision_padding_patches: int
    vision_padding_pct: float | None


class PrefixCache(_Schema):
    enabled: bool
    queries: int
    hits: int
    hit_rate: float | None


class VllmResult(BackendResult):
    """The plugin's result: the engine's own figures besides every backend's."""

    startup_s: float
    warmup_s: float
    graphs_compiled: GraphsCompiled
    padding: Padding
    encoder: Encoder
    prefix_cache: PrefixCache


class Ratio(_Schema):
    requests_per_s: float | None
    total_tokens_per_s: float | None
    output_tokens_per_s: float | None


class Report(_Schema):
    """The whole report (``results`` is checked per backend by ``check_report``:
    ``VllmResult`` for vllm-hpu-mm, ``BackendResult`` for the others)."""

    schema_: str = Field(alias="schema")
    config: dict[str, Any]
    results: dict[str, dict[str, Any]]
    ratio_vllm_hpu_mm_over_hf: Ratio | None = None


def check_report(report: Mapping[str, Any]) -> list[str]:
    """Problems with ``report``'s layout (missing keys, wrong types), one line
    each as ``where: what``; [] when it is well formed."""
    if not isinstance(report, Mapping):
        return ["report: not an object"]
    problems = _problems(Report, report, "")
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    results = report.get("results")
    if not isinstance(results, Mapping):
        return problems
    if not results:
        problems.append("results: no backend ran")
    for name, result in results.items():
        model = VllmResult if name == VLLM else BackendResult
        problems += _problems(model, result, f"results.{name}.")
    if VLLM in results and HF in results and "ratio_vllm_hpu_mm_over_hf" not in report:
        problems.append("ratio_vllm_hpu_mm_over_hf: missing")
    return problems


def _problems(model: type[BaseModel], obj: Any, where: str) -> list[str]:
    try:
        model.model_validate(obj)
    except ValidationError as e:
        return [_problem(err, where) for err in e.errors()]
    return []


def _problem(err: Any, where: str) -> str:
    loc = where + ".".join(str(part) for part in err["loc"])
    value = err["input"]
    if err["type"] == "missing":
        return f"{loc}: missing"
    if isinstance(value, bool) and err["type"] in ("int_type", "float_type"):
        return f"{loc}: a boolean, expected a number"
    return f"{loc or 'report'}: {type(value).__name__} {value!r} ({err['msg']})"


# --- text ---------------------------------------------------------------------------


def format_report(report: Mapping[str, Any]) -> str:
    """The report as a few human lines per backend."""
    lines = []
    for name, r in report["results"].items():
        t, tps = r["tokens"], r["tokens_per_s"]
        lines += [
            f"== {name} ({r['num_requests']} requests in {r['elapsed_s']:.2f} s)",
            f"Throughput: {r['requests_per_s']:.2f} requests/s, "
            f"{tps['total']:.1f} total tokens/s, {tps['output']:.1f} output tokens/s",
            f"Tokens: {t['prompt_text']} prompt text + {t['prompt_image']} image "
            f"placeholders + {t['output']} output = {t['total']}",
            "TTFT ms: " + _ms(r["ttft_s"]),
            "TPOT ms: " + _ms(r["tpot_s"]),
            f"Peak memory: device {_mib(r['peak_memory']['device_bytes'])}, "
            f"host RSS {_mib(r['peak_memory']['host_rss_bytes'])}",
        ]
        if name == VLLM:
            pad, enc, pc = r["padding"], r["encoder"], r["prefix_cache"]
            g = r["graphs_compiled"]
            per_item = enc["runs_per_item"]
            hit = pc["hit_rate"]
            lines += [
                f"Startup {r['startup_s']:.1f} s, warmup {r['warmup_s']:.1f} s; "
                f"graphs compiled: {g['warmup']} in warmup, "
                f"{g['after_warmup']} after",
                f"Padding waste: {pad['waste_pct']:.1f} % ({pad['padded_tokens']} "
                f"padded / {pad['scheduled_tokens']} real token rows), "
                f"fallback steps {pad['fallback_steps']}",
                f"Encoder: {enc['runs']} runs for {enc['mm_items']} items"
                + f", {enc['distinct_items']} distinct"
                + (f" ({per_item:.2f} per item)" if per_item is not None else "")
                + (
                    f"; vision padding {enc['vision_padding_pct']:.1f} % "
                    f"({enc['vision_padding_patches']} of "
                    f"{enc['vision_patches'] + enc['vision_padding_patches']} patches)"
                    if enc.get("vision_padding_pct") is not None
                    else ""
                ),
                f"Prefix cache ({'on' if pc['enabled'] else 'off'}): "
                + (f"hit rate {100 * hit:.1f} %" if hit is not None else "no queries")
                + f" ({pc['hits']} / {pc['queries']} tokens)",
            ]
    ratio = report.get("ratio_vllm_hpu_mm_over_hf")
    if ratio:
        lines.append(
            "== vllm-hpu-mm / hf: "
            + ", ".join(
                f"{k} {v:.2f}x" if v is not None else f"{k} n/a"
                for k, v in ratio.items()
            )
        )
    return "\n".join(lines)


def _ms(summary: Mapping[str, float | None]) -> str:
    return ", ".join(
        f"{k} {1000 * v:.1f}" if v is not None else f"{k} n/a"
        for k, v in summary.items()
        if k != "max"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n else "n/a"
