"""Read the plugin's metrics from the registry vLLM's own /metrics serves.

For tests and benchmarks that drive ``vllm.LLM`` in-process: the counters live
in the engine's worker process, and their values reach this process through
the files in PROMETHEUS_MULTIPROC_DIR (set by ``vllm_hpu_mm.register()``).
The registry is vLLM's ``get_prometheus_registry()``: a multiprocess collector
over those files when the variable is set, else this process's own registry
(an engine run in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations


def read_metric(name: str, labels: dict[str, str] | None = None) -> float:
    """Current value of sample ``name`` (e.g. ``vllm_hpu_mm:encoder_runs_total``),
    summed over processes; 0.0 when it has not been recorded yet."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry().get_sample_value(name, labels or {}) or 0.0


def read_samples(name: str, label: str) -> dict[str, float]:
    """Every sample called ``name``, summed by the value of ``label`` (empty when
    nothing has been recorded)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    out: dict[str, float] = {}
    for family in get_prometheus_registry().collect():
        for sample in family.samples:
            if sample.name == name and label in sample.labels:
                key = sample.labels[label]
                out[key] = out.get(key, 0.0) + sample.value
    return out
