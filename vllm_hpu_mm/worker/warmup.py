"""Warmup: run every step shape once before the server reports ready.

``step_shapes`` lists every graph key serving can produce from the bucket set
(decode parts and prefill parts; with attention as an opaque op, a graph is keyed
by its token rows, and ``token_shapes`` keeps one shape per token count); each
runs the model body once (a step of
padding rows only: they write the null block and read key 0, so the KV cache
of real requests is never touched), and each batch bucket runs the logits head
once, and (on the static path, ``sampler_padding``) the sampler at that
batch size in each sampling configuration. In graph mode that is when every
graph is compiled; afterwards the compile counter's phase becomes "serving",
and any compilation it counts is a shape warmup missed.

On Gaudi the step shapes, logits sizes and sampler calls run in the bridge's
compile-only mode (``device.compile_only_mode``): recipes are compiled, not
executed, so nothing here may read a tensor's value back to the host (the
padding steps are built from host arrays; the sampler's warmup metadata from
Python values). The encoders' warmup runs outside it, executed: their inputs
are processed images whose shapes the warmup reads from the processor
(the official plugin keeps an opt-out of compile-only mode for such
data-dependent multimodal paths).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from vllm_hpu_mm import device as dev
from vllm_hpu_mm import metrics
from vllm_hpu_mm.attention.metadata import StepShape, build_metadata
from vllm_hpu_mm.bucketing.buckets import (
    one_request_shapes,
    step_shapes,
    token_shapes,
)
from vllm_hpu_mm.worker.multimodal import warm_up_encoder
from vllm_hpu_mm.worker.sampler_padding import (
    counted_compiles,
    sampler_batch_sizes,
    warm_up_sampler,
)
from vllm_hpu_mm.worker.shapes import engine_limits

if TYPE_CHECKING:
    from vllm_hpu_mm.worker.model_runner import HpuMMModelRunner

logger = logging.getLogger("vllm.hpu_mm.warmup")

PROGRESS_EVERY_S = 30.0  # a progress log line at most this often


class WarmupProgress:
    """Log lines of warmup's progress: shapes done out of the total, the time
    spent and the time left at the mean pace so far, at most every
    ``every_s`` seconds and once at the end (a server's log has no progress
    bar; the bar is ``hpu_mm.warmup.progress_bar``)."""

    def __init__(
        self,
        total: int,
        every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total = total
        self.done = 0
        self.every_s = every_s
        self.clock = clock
        self.start = self.last = clock()

    def line(self) -> str:
        elapsed = self.clock() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else None
        return f"Warmup: {self.done}/{self.total} shapes in {elapsed:.0f} s, " + (
            f"about {left:.0f} s left" if left is not None else "time left unknown"
        )

    def step(self) -> str | None:
        """One shape done; the line logged, if it is time for one."""
        self.done += 1
        now = self.clock()
        if self.done < self.total and now - self.last < self.every_s:
            return None
        self.last = now
        text = self.line()
        logger.info("%s", text)
        return text


def _padding_only_step(runner: HpuMMModelRunner, shape: StepShape) -> None:
    empty = np.zeros(0, np.int64)
    num_tokens = shape.num_tokens
    md = build_metadata(
        empty,
        empty,
        np.zeros((0, 1), np.int64),
        empty,
        runner.block_size,
        shape,
        runner.device,
        runner.buffers,
        runner.plan.attention_metadata,
        # A bidirectional-image model's steps always carry (possibly empty) spans.
        spans=np.zeros((0, 2), np.int64) if runner.bidirectional_images else None,
    )
    # Distinct buffers, as in serving: Dynamo guards on aliasing, so one
    # tensor passed twice would compile a graph that serving never reuses.
    zeros = np.zeros(num_tokens, np.int64)
    input_ids = runner.buffers.put("input_ids", zeros)
    positions = runner.buffers.put("positions", runner.zero_positions(num_tokens))
    assert runner.graphs is not None
    if runner.mm is not None:  # the merge is compiled per token shape too
        runner.mm.attach_maps(md, [])
    runner.graphs.run_step(
        md,
        runner.vllm_config,
        input_ids,
        positions,
        None if runner.mm is None else runner.mm.merge,
    )


@torch.inference_mode()
def warm_up(runner: HpuMMModelRunner) -> None:
    graphs = runner.graphs
    assert graphs is not None
    buckets = runner.shapes.buckets
    cfg = runner.plugin_config.warmup
    if cfg.skip or graphs.mode == "eager" or buckets is None:
        reason = (
            "hpu_mm.warmup.skip is set"
            if cfg.skip
            else "eager mode compiles nothing"
            if graphs.mode == "eager"
            else "bucketing is off"
        )
        graphs.counter.phase = "serving"
        logger.info("Warmup skipped: %s", reason)
        return
    hidden_size = runner.model_config.get_hidden_size()
    dtype: torch.dtype = runner.model_config.dtype  # type: ignore[assignment]
    limits = engine_limits(runner.vllm_config)
    decode, prefill = step_shapes(buckets, limits, runner.shapes.decode_form)
    if graphs.plan.opaque_attention:  # graphs keyed by token rows: one shape per count
        decode, prefill = token_shapes(decode, prefill)
    work: list[StepShape | int] = [StepShape(b, n, 0, 0) for b, n in decode]
    work += [StepShape(0, 0, t, n) for t, n in prefill]
    if runner.shapes.prefill_forms:  # one-request prefill parts: graphs of their own
        one = one_request_shapes(buckets, limits)
        work += [StepShape(0, 0, t, n, form) for t, n, form in one]
        prefill = prefill + [(t, n) for t, n, _ in one]
    if runner.stage.is_last:  # logits and sampling: the last pipeline stage's
        work += list(buckets.batch)
    sampler_sizes = sampler_batch_sizes(runner.plan, buckets)
    max_logprobs = int(runner.model_config.max_logprobs)
    sampler_calls = 0
    start = time.perf_counter()
    logger.info(
        "Warmup: %d shapes (%d decode, %d prefill, %d logits sizes), backend %s",
        len(work),
        len(decode),
        len(prefill),
        len(work) - len(decode) - len(prefill),
        graphs.counter.inner,
    )
    progress = WarmupProgress(len(work))
    # Gaudi: graphs compiled, not run (a no-op elsewhere); nothing in this
    # block reads a tensor's value back to the host.
    with dev.compile_only_mode() as compile_only:
        for item in tqdm(
            work, desc="vllm-hpu-mm warmup", unit="shape", disable=not cfg.progress_bar
        ):
            if isinstance(item, StepShape):
                _padding_only_step(runner, item)
                progress.step()
                continue
            hidden = torch.zeros(item, hidden_size, dtype=dtype, device=runner.device)
            logits = graphs.logits(hidden)  # [item, V]
            if item in sampler_sizes:
                with counted_compiles(graphs.counter):
                    sampler_calls += warm_up_sampler(
                        runner.sampler, logits, max_logprobs
                    )
            progress.step()
    encoder_shapes = 0
    if runner.mm is not None or runner.cross is not None:
        logger.info("Warmup: the encoder's buckets")
    if runner.mm is not None:
        encoder_shapes = warm_up_encoder(runner, runner.vllm_config)
    if runner.cross is not None:
        encoder_shapes = runner.cross.warm_up()
    graphs.counter.phase = "serving"
    seconds = time.perf_counter() - start
    metrics.WARMUP_SECONDS.set(seconds)
    logger.info(
        "Warmup finished in %.1f s: %d step shapes (%d decode + %d prefill, "
        "%s decode, attention %s), %d logits sizes, %d sampler calls at %s, "
        "%d encoder sizes; %d compilations (%s, backend %s)%s",
        seconds,
        len(decode) + len(prefill),
        len(decode),
        len(prefill),
        runner.shapes.decode_form,
        "opaque: one shape per token count"
        if graphs.plan.opaque_attention
        else "traced: every step shape",
        len(buckets.batch),
        sampler_calls,
        f"batch sizes {list(sampler_sizes)}" if sampler_sizes else "no padded size",
        encoder_shapes,
        graphs.compiles,
        f"{graphs.regions} decoder layers compiled regionally"
        if graphs.regions
        else "whole body",
        graphs.counter.inner,
        f"; {dev.COMPILE_ONLY_SETTING}: compiled without running"
        if compile_only
        else "",
    )
