"""The runner's shape policy: bucket sets from the config, padding with counters."""

from __future__ import annotations

import logging
from typing import Any

from vllm.config import VllmConfig

from vllm_hpu_mm import device as dev
from vllm_hpu_mm import metrics
from vllm_hpu_mm.attention.metadata import DecodeForm, StepShape
from vllm_hpu_mm.bucketing.buckets import BucketSet, Limits, from_config
from vllm_hpu_mm.bucketing.policy import Bucketer, StepSizes
from vllm_hpu_mm.bucketing.record import StepRecorder

logger = logging.getLogger("vllm.hpu_mm.shapes")


def engine_limits(vllm_config: VllmConfig) -> Limits:
    sc = vllm_config.scheduler_config
    return Limits(
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_model_len=vllm_config.model_config.max_model_len,
        block_size=vllm_config.cache_config.block_size,
    )


def bucket_set(limits: Limits, bucketing: Any) -> BucketSet | None:
    """The configured buckets, or None when bucketing is off (exact shapes)."""
    return from_config(limits, bucketing)


def step_recorder(path: str | None) -> StepRecorder | None:
    """The recorder of ``bucketing.record_steps``, on the first rank only (every
    rank of a step sees the same shape)."""
    import torch.distributed as dist

    if path is None or (dist.is_initialized() and dist.get_rank() != 0):
        return None
    return StepRecorder(path)


def opaque_attention(plugin_config: Any, kind: str, enforce_eager: bool) -> bool:
    """Whether attention runs as vLLM's opaque op between compiled pieces
    (``hpu_mm.graph_attention``; ``auto``: traced on Gaudi, opaque elsewhere).
    Eager mode compiles nothing: its layers call the backend directly."""
    mode = plugin_config.graph_mode
    if mode == "eager" or (mode == "auto" and enforce_eager):
        return False
    choice = plugin_config.graph_attention
    if choice == "auto":
        return kind != "hpu"
    return bool(choice == "opaque")


def decode_form_for(kind: str) -> DecodeForm:
    """Flat paged decode on Gaudi (the official plugin's form); elsewhere the
    batched block table, which measured faster on the CPU (docs/performance.md,
    decode attention, 2026-12-01) and uses the device's SDPA."""
    return "flat" if kind == "hpu" else "batched"


class ShapePolicy:
    """Pads each step to its bucket and counts real and padded tokens."""

    def __init__(
        self,
        buckets: BucketSet | None,
        max_pad_ratio: float = 2.0,
        decode_form: DecodeForm | None = None,
        recorder: StepRecorder | None = None,
    ) -> None:
        self.buckets = buckets
        # The served steps' exact shapes, for the planner (bucketing.record_steps).
        self.recorder = recorder
        self.decode_form: DecodeForm = decode_form or decode_form_for(dev.device_kind())
        self.bucketer = (
            Bucketer(buckets, max_pad_ratio) if buckets is not None else None
        )

    def __call__(self, exact: StepShape, num_reqs: int) -> tuple[StepShape, int]:
        metrics.SCHEDULED_TOKENS.inc(exact.num_tokens)
        if self.recorder is not None:
            self.recorder.record(
                num_reqs,
                exact.num_decodes,
                exact.decode_blocks,
                exact.num_prefill_tokens,
                exact.prefill_blocks,
            )
        if self.bucketer is None:
            return exact, num_reqs
        padded = self.bucketer.pad(
            StepSizes(
                num_reqs=num_reqs,
                num_decodes=exact.num_decodes,
                decode_blocks=exact.decode_blocks,
                prefill_tokens=exact.num_prefill_tokens,
                prefill_blocks=exact.prefill_blocks,
            )
        )
        if padded.fallbacks:
            metrics.FALLBACK_BUCKETS.inc()
        shape = StepShape(
            num_decodes=padded.num_decodes,
            decode_blocks=padded.decode_blocks,
            num_prefill_tokens=padded.prefill_tokens,
            prefill_blocks=padded.prefill_blocks,
        )
        pad = shape.num_tokens - exact.num_tokens
        metrics.PADDED_TOKENS.inc(pad)
        bucket = str(shape.num_tokens)
        metrics.BUCKET_PADDED_TOKENS.labels(bucket=bucket).inc(pad)
        metrics.BUCKET_SCHEDULED_TOKENS.labels(bucket=bucket).inc(exact.num_tokens)
        return shape, padded.batch
