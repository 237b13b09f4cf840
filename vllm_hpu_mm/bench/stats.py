"""Per-request records, their summary, and the report (its JSON layout).

A backend turns its outputs into ``RequestRecord``s and measures the elapsed
time of the whole batch; ``backend_result`` derives requests/s, tokens/s and
latency percentiles from them; ``build_report`` puts the backends' results
side by side (with the ratio vllm-hpu-mm / hf when both ran). ``check_report``
is the schema: the keys and types every report has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

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
    """The ``q``-th percentile (0..100), linear between closest ranks, like
    ``numpy.percentile``'s default."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99`` and ``max`` (all None when empty)."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "max"]
    if not values:
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {"mean": sum(values) / len(values)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    out["max"] = max(values)
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

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_SUMMARY = {k: _OPT_NUM for k in ("mean", "p50", "p90", "p99", "max")}
_RESULT: dict[str, Any] = {
    "backend": str,
    "num_requests": int,
    "elapsed_s": _NUM,
    "requests_per_s": _NUM,
    "tokens": {
        k: int
        for k in ("prompt_text", "prompt_image", "output", "total", "prompt_cached")
    },
    "tokens_per_s": {k: _NUM for k in ("total", "output", "text")},
    "ttft_s": _SUMMARY,
    "tpot_s": _SUMMARY,
    "e2e_s": _SUMMARY,
    "requests": list,
    "peak_memory": {"device_bytes": int, "host_rss_bytes": int},
}
_VLLM_RESULT: dict[str, Any] = {
    "startup_s": _NUM,
    "warmup_s": _NUM,
    "graphs_compiled": {"warmup": int, "after_warmup": int},
    "padding": {
        "scheduled_tokens": int,
        "padded_tokens": int,
        "waste_pct": _NUM,
        "fallback_steps": int,
        "by_bucket": dict,
    },
    "encoder": {
        "runs": int,
        "mm_items": int,  # images in the timed requests
        "distinct_items": int,
        "runs_per_item": _OPT_NUM,
        "vision_patches": int,  # real patches through a bucketed vision tower
        "vision_padding_patches": int,
        "vision_padding_pct": _OPT_NUM,
    },
    "prefix_cache": {
        "enabled": bool,
        "queries": int,
        "hits": int,
        "hit_rate": _OPT_NUM,
    },
}
_RATIO = {
    k: _OPT_NUM for k in ("requests_per_s", "total_tokens_per_s", "output_tokens_per_s")
}


def check_report(report: Mapping[str, Any]) -> list[str]:
    """Problems with ``report``'s layout (missing keys, wrong types); [] when
    it is well formed."""
    problems: list[str] = []
    _check(report, {"schema": str, "config": dict, "results": dict}, "", problems)
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    results = report.get("results") or {}
    if not results:
        problems.append("results: no backend ran")
    for name, result in results.items():
        spec = {**_RESULT, **_VLLM_RESULT} if name == VLLM else _RESULT
        _check(result, spec, f"results.{name}.", problems)
    if VLLM in results and HF in results:
        _check(
            report,
            {"ratio_vllm_hpu_mm_over_hf": _RATIO},
            "",
            problems,
        )
    return problems


def _check(obj: Any, spec: Mapping[str, Any], where: str, problems: list[str]) -> None:
    if not isinstance(obj, Mapping):
        problems.append(f"{where or 'report'}: not an object")
        return
    for key, kind in spec.items():
        if key not in obj:
            problems.append(f"{where}{key}: missing")
        elif isinstance(kind, dict):
            _check(obj[key], kind, f"{where}{key}.", problems)
        elif isinstance(obj[key], bool) and kind in (int, _NUM, _OPT_NUM):
            problems.append(f"{where}{key}: a boolean, expected a number")
        elif not isinstance(obj[key], kind):
            problems.append(
                f"{where}{key}: {type(obj[key]).__name__} {obj[key]!r} "
                f"is not {_kind_name(kind)}"
            )


def _kind_name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return str(kind.__name__)


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
