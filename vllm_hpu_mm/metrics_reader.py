"""Read the plugin's metrics from prometheus_client's multiprocess files.

For tests and benchmarks that drive ``vllm.LLM`` in-process: the counters live
in the engine's worker process, and their values reach this process through
the files in PROMETHEUS_MULTIPROC_DIR (set by ``vllm_hpu_mm.register()``).
"""

from __future__ import annotations

import os


def read_metric(
    name: str, labels: dict[str, str] | None = None, path: str | None = None
) -> float:
    """Current value of sample ``name`` (e.g. ``vllm_hpu_mm:encoder_runs_total``),
    summed over processes; 0.0 when it has not been recorded yet."""
    from prometheus_client import CollectorRegistry, multiprocess

    directory = path or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        raise RuntimeError(
            "PROMETHEUS_MULTIPROC_DIR is unset: start the engine (which registers "
            "the plugin) before reading its metrics"
        )
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry.get_sample_value(name, labels or {}) or 0.0
