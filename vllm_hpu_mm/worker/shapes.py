"""The runner's shape policy: bucket sets from the config, padding with counters."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.config import VllmConfig

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


def first_rank() -> bool:
    """Whether this process is the first rank (every rank of a step sees the
    same shape, so one counts it)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def step_recorder(path: str | None) -> StepRecorder | None:
    """The recorder of ``bucketing.record_steps``, on the first rank only."""
    if path is None or not first_rank():
        return None
    return StepRecorder(path)


def observe_step(exact: StepShape, num_reqs: int) -> None:
    """The served step's exact sizes into the ``step_shape`` histogram."""
    axes = [("tokens", exact.num_tokens), ("requests", num_reqs)]
    if exact.num_decodes:
        axes += [("decode_rows", exact.num_decodes)]
        axes += [("decode_blocks", exact.decode_blocks)]
    if exact.num_prefill_tokens:
        axes += [("prefill_tokens", exact.num_prefill_tokens)]
    if exact.prefill_blocks:  # a causal part has no block axis
        axes += [("prefill_blocks", exact.prefill_blocks)]
    for axis, value in axes:
        metrics.STEP_SHAPE.labels(axis=axis).observe(value)


class ShapePolicy:
    """Pads each step to its bucket and counts real and padded tokens."""

    def __init__(
        self,
        buckets: BucketSet | None,
        max_pad_ratio: float = 2.0,
        decode_form: DecodeForm = "flat",
        recorder: StepRecorder | None = None,
        prefill_forms: bool = True,
    ) -> None:
        """``decode_form``: the execution plan's (``ExecutionPlan.decode_form``);
        ``prefill_forms``: one-request prefill parts keep their own form
        (``layout.PrefillForm``: the static plan, ``bucketing.prefill_one_request``),
        else every prefill part runs in tiles."""
        self.prefill_forms = prefill_forms
        self.buckets = buckets
        # The served steps' exact shapes, for the planner (bucketing.record_steps).
        self.recorder = recorder
        # The step_shape histogram and the prefill-form counter: set by
        # ``start_serving`` on the first rank.
        self.observing = False
        self.decode_form: DecodeForm = decode_form
        self.bucketer = (
            Bucketer(buckets, max_pad_ratio) if buckets is not None else None
        )

    def start_serving(self) -> None:
        """Warmup is over: record (``record_steps``) and observe the served
        steps from now on."""
        if self.recorder is not None:
            self.recorder.start()
        self.observing = first_rank()

    def __call__(self, exact: StepShape, num_reqs: int) -> tuple[StepShape, int]:
        if not self.prefill_forms and exact.prefill_form != "tiles":
            exact = dataclasses.replace(exact, prefill_form="tiles")
        if exact.num_prefill_tokens and self.observing:
            metrics.PREFILL_FORM_STEPS.labels(form=exact.prefill_form).inc()
        if exact.prefill_form == "causal":
            # its gather covers the bucket's rows: no prefill block axis to
            # pad, record or plan for
            exact = dataclasses.replace(exact, prefill_blocks=0)
        metrics.SCHEDULED_TOKENS.inc(exact.num_tokens)
        if self.observing:
            observe_step(exact, num_reqs)
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
            prefill_form=exact.prefill_form,
        )
        pad = shape.num_tokens - exact.num_tokens
        metrics.PADDED_TOKENS.inc(pad)
        bucket = str(shape.num_tokens)
        metrics.BUCKET_PADDED_TOKENS.labels(bucket=bucket).inc(pad)
        metrics.BUCKET_SCHEDULED_TOKENS.labels(bucket=bucket).inc(exact.num_tokens)
        return shape, padded.batch
