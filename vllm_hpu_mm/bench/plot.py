"""``--plot FILE.png``: padding per bucket and the latency distribution.

Three panels: real and padded token rows per token bucket (one bar for all
buckets when the plugin exports no per-bucket counters), and per backend the
distribution of time to first token and of end-to-end latency. matplotlib
(extra ``bench``) with the Agg backend: no display needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_hpu_mm.bench.stats import VLLM


def write_plot(report: Mapping[str, Any], path: Path) -> Path:
    """Draw ``report`` into ``path`` (PNG); returns the path."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'vllm-hpu-mm[bench]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, (ax_pad, ax_ttft, ax_e2e) = plt.subplots(1, 3, figsize=(15, 4.5))
    _padding_panel(ax_pad, results.get(VLLM))
    for ax, key in ((ax_ttft, "ttft_s"), (ax_e2e, "e2e_s")):
        ms = {
            name: [1000 * r[key] for r in result["requests"]]
            for name, result in results.items()
        }
        everything = [v for values in ms.values() for v in values]
        if not everything:
            continue
        # One set of bins for every backend, so their bars line up.
        lo, hi = min(everything), max(everything)
        n = min(30, max(5, len(everything) // 2))
        bins = [lo + (hi - lo) * i / n for i in range(n + 1)] if hi > lo else n
        for name, values in ms.items():
            ax.hist(values, bins=bins, alpha=0.6, label=name)
    for ax, what in ((ax_ttft, "time to first token"), (ax_e2e, "end-to-end latency")):
        ax.set_title(what)
        ax.set_xlabel("ms")
        ax.set_ylabel("requests")
        if results:
            ax.legend()
    model = report.get("config", {}).get("model", "")
    fig.suptitle(f"vllm-hpu-mm bench throughput: {model}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _padding_panel(ax: Any, result: Mapping[str, Any] | None) -> None:
    ax.set_title("token rows per bucket (vllm-hpu-mm)")
    if result is None:
        ax.text(0.5, 0.5, "vllm-hpu-mm did not run", ha="center", va="center")
        ax.set_axis_off()
        return
    pad = result["padding"]
    by_bucket = pad["by_bucket"] or {
        "all": {
            "scheduled_tokens": pad["scheduled_tokens"],
            "padded_tokens": pad["padded_tokens"],
        }
    }
    labels = list(by_bucket)
    real = [by_bucket[b]["scheduled_tokens"] for b in labels]
    padded = [by_bucket[b]["padded_tokens"] for b in labels]
    xs = range(len(labels))
    ax.bar(xs, real, label="real")
    ax.bar(xs, padded, bottom=real, label="padding")
    ax.set_xticks(list(xs), labels, rotation=45)
    ax.set_xlabel("token bucket")
    ax.set_ylabel("token rows")
    ax.legend()
    ax.text(
        0.02,
        0.95,
        f"waste {pad['waste_pct']:.1f} %",
        transform=ax.transAxes,
        va="top",
    )
