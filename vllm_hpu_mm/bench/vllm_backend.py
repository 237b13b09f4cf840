"""The requests through ``vllm.LLM`` (the plugin's platform), measured.

Per request, vLLM's own request stats (``RequestOutput.metrics``, kept when
stat logging is on): time to first token from the request's arrival, and the
engine's first and last token timestamps (TPOT). Around the timed batch, the
plugin's Prometheus counters (padding, fallbacks, encoder runs, compilations)
and vLLM's prefix-cache counters are read before and after, so the report
counts the timed batch only; warmup figures are the engine start's.

Encoder runs are the plugin's counter; the items they are divided by are the
images of the timed requests, counted here (the same for every model: the
Mllama runner, whose images go to cross-attention, does not move
``vllm_hpu_mm:mm_items_total``, which is reported apart as ``items_counter``).
"""

from __future__ import annotations

import copy
import gc
import importlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_hpu_mm.bench.datasets import BenchRequest
from vllm_hpu_mm.bench.memory import children_peak_rss_bytes, peak_rss_bytes
from vllm_hpu_mm.bench.stats import VLLM, RequestRecord, backend_result
from vllm_hpu_mm.metrics_reader import read_metric, read_samples
from vllm_hpu_mm.multimodal.token_ids import image_token_id

logger = logging.getLogger("vllm.hpu_mm.bench")

_P = "vllm_hpu_mm:"
# Per-bucket padding, when the plugin exports it: counters labelled with the
# token bucket (``bucket``) of the step.
BUCKET_PADDED = _P + "bucket_padded_tokens_total"
BUCKET_SCHEDULED = _P + "bucket_scheduled_tokens_total"


def plugin_counter(name: str, labels: Mapping[str, str] | None = None) -> int:
    """A plugin counter from the multiprocess dir, as an int."""
    return round(read_metric(name, dict(labels or {})))


def plugin_samples(name: str) -> dict[str, float]:
    """Every sample called ``name`` by its ``bucket`` label (empty when the plugin
    does not export it)."""
    return read_samples(name, "bucket")


def _plugin_snapshot() -> dict[str, Any]:
    return {
        "scheduled": plugin_counter(_P + "scheduled_tokens_total"),
        "padded": plugin_counter(_P + "padded_tokens_total"),
        "fallback": plugin_counter(_P + "fallback_buckets_total"),
        "encoder_runs": plugin_counter(_P + "encoder_runs_total"),
        "mm_items": plugin_counter(_P + "mm_items_total"),
        "vision_patches": plugin_counter(_P + "vision_patches_total"),
        "vision_padding": plugin_counter(_P + "vision_padding_patches_total"),
        "bucket_padded": plugin_samples(BUCKET_PADDED),
        "bucket_scheduled": plugin_samples(BUCKET_SCHEDULED),
    }


def _vllm_counters(llm: Any) -> dict[str, float]:
    """vLLM's own counters (summed over engines), e.g. ``vllm:prefix_cache_hits``."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0.0) + metric.value
    return out


def _engine_input(req: BenchRequest) -> Any:
    if req.prompt_token_ids is not None:
        inp: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
    else:
        inp = {"prompt": req.prompt}
    if req.images:
        inp["multi_modal_data"] = {"image": list(req.images)}
    return inp


def _record(out: Any, image_id: int | None) -> RequestRecord:
    m = out.metrics
    if m is None:
        raise RuntimeError(
            "vLLM returned no request stats: the engine was started with "
            "--disable-log-stats, which the benchmark needs off"
        )
    prompt_ids = list(out.prompt_token_ids or [])
    n_out = len(out.outputs[0].token_ids)
    decode_s = max(m.last_token_ts - m.first_token_ts, 0.0)
    return RequestRecord(
        prompt_tokens=len(prompt_ids),
        image_tokens=prompt_ids.count(image_id) if image_id is not None else 0,
        output_tokens=n_out,
        ttft_s=m.first_token_latency,
        tpot_s=decode_s / (n_out - 1) if n_out > 1 else None,
        e2e_s=m.first_token_latency + decode_s,
        cached_tokens=out.num_cached_tokens or 0,
    )


def _peak_device_bytes(llm: Any) -> int:
    """The workers' peak device memory, when the worker offers
    ``peak_memory_bytes`` (0 otherwise, and on the CPU)."""
    path = llm.llm_engine.vllm_config.parallel_config.worker_cls
    module, _, name = str(path).rpartition(".")
    try:
        worker_cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return 0
    if not hasattr(worker_cls, "peak_memory_bytes"):
        return 0
    return int(max(llm.collective_rpc("peak_memory_bytes")))


def _shutdown(llm: Any) -> None:
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


def run_vllm(
    engine_args: Any,
    requests: Sequence[BenchRequest],
    *,
    warmups: Sequence[BenchRequest] = (),
    progress: bool = True,
    detokenize: bool = True,
) -> dict[str, Any]:
    """Start an engine from ``engine_args`` (vLLM's ``EngineArgs``; stat
    logging forced on, the per-request stats need it), run
    ``warmups`` untimed, then all ``requests`` in one timed
    ``generate``; the ``vllm-hpu-mm`` result section of the report."""
    from vllm import LLM, SamplingParams

    engine_args = copy.copy(engine_args)
    engine_args.disable_log_stats = False
    start = time.perf_counter()
    llm = LLM.from_engine_args(engine_args)
    startup_s = time.perf_counter() - start
    try:
        vllm_config = llm.llm_engine.vllm_config
        image_id = image_token_id(vllm_config.model_config.hf_config)

        def params(req: BenchRequest) -> Any:
            return SamplingParams(
                temperature=0.0,
                max_tokens=req.output_len,
                ignore_eos=True,
                detokenize=detokenize,
            )

        if warmups:
            warm = list(warmups)
            llm.generate(
                [_engine_input(r) for r in warm],
                [params(r) for r in warm],
                use_tqdm=False,
            )
        inputs = [_engine_input(r) for r in requests]
        sampling = [params(r) for r in requests]
        before, vllm_before = _plugin_snapshot(), _vllm_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(inputs, sampling, use_tqdm=progress)
        elapsed = time.perf_counter() - start
        after, vllm_after = _plugin_snapshot(), _vllm_counters(llm)
        records = [_record(o, image_id) for o in outputs]
        extra = {
            "startup_s": startup_s,
            "warmup_s": read_metric(_P + "warmup_seconds"),
            "graphs_compiled": {
                "warmup": plugin_counter(
                    _P + "graph_compiles_total", {"phase": "warmup"}
                ),
                "after_warmup": plugin_counter(
                    _P + "graph_compiles_total", {"phase": "serving"}
                ),
            },
            "padding": _padding(before, after),
            "encoder": _encoder(before, after, requests),
            "prefix_cache": _prefix_cache(
                bool(vllm_config.cache_config.enable_prefix_caching),
                vllm_before,
                vllm_after,
            ),
            "peak_memory": {
                "device_bytes": _peak_device_bytes(llm),
                "host_rss_bytes": children_peak_rss_bytes() or peak_rss_bytes(),
            },
        }
    finally:
        _shutdown(llm)
        del llm
        gc.collect()
    return backend_result(VLLM, records, elapsed, extra)


def _padding(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    scheduled = after["scheduled"] - before["scheduled"]
    padded = after["padded"] - before["padded"]
    by_bucket = {}
    for bucket in sorted(after["bucket_scheduled"], key=_bucket_order):
        real = after["bucket_scheduled"][bucket] - before["bucket_scheduled"].get(
            bucket, 0.0
        )
        pad = after["bucket_padded"].get(bucket, 0.0) - before["bucket_padded"].get(
            bucket, 0.0
        )
        if real or pad:
            by_bucket[bucket] = {
                "scheduled_tokens": round(real),
                "padded_tokens": round(pad),
            }
    return {
        "scheduled_tokens": scheduled,
        "padded_tokens": padded,
        "waste_pct": 100.0 * padded / (padded + scheduled)
        if padded + scheduled
        else 0.0,
        "fallback_steps": after["fallback"] - before["fallback"],
        "by_bucket": by_bucket,
    }


def _bucket_order(label: str) -> tuple[int, str]:
    return (int(label), "") if label.isdigit() else (1 << 62, label)


def _encoder(
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    requests: Sequence[BenchRequest],
) -> dict[str, Any]:
    """Encoder runs of the timed batch, per image sent (``mm_items``) and
    against the distinct images among them (the fewest runs possible without
    images cached before the batch)."""
    runs = after["encoder_runs"] - before["encoder_runs"]
    items = sum(len(r.images) for r in requests)
    # Vision towers on patch buckets (Qwen): real and padding patches run.
    patches = round(after["vision_patches"] - before["vision_patches"])
    padding = round(after["vision_padding"] - before["vision_padding"])
    return {
        "runs": runs,
        "mm_items": items,
        "distinct_items": len({k for r in requests for k in r.image_keys}),
        "runs_per_item": runs / items if items else None,
        "items_counter": after["mm_items"] - before["mm_items"],
        "vision_patches": patches,
        "vision_padding_patches": padding,
        "vision_padding_pct": 100 * padding / (patches + padding)
        if patches + padding
        else None,
    }


def _prefix_cache(
    enabled: bool, before: Mapping[str, float], after: Mapping[str, float]
) -> dict[str, Any]:
    queries = round(
        after.get("vllm:prefix_cache_queries", 0.0)
        - before.get("vllm:prefix_cache_queries", 0.0)
    )
    hits = round(
        after.get("vllm:prefix_cache_hits", 0.0)
        - before.get("vllm:prefix_cache_hits", 0.0)
    )
    return {
        "enabled": enabled,
        "queries": queries,
        "hits": hits,
        "hit_rate": hits / queries if queries else None,
    }
