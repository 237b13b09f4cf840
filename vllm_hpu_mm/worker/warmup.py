"""Warmup: run every bucket once before the server reports ready.

Each token bucket runs the model body once (a step of padding rows only: they
write the null block and read key 0, so the KV cache of real requests is never
touched) and each batch bucket runs the logits head once. In graph mode that is
when every graph is compiled; afterwards the compile counter's phase becomes
"serving", and any compilation it counts is a shape warmup missed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm
from vllm.forward_context import set_forward_context

from vllm_hpu_mm import metrics
from vllm_hpu_mm.attention.metadata import StepShape, build_metadata
from vllm_hpu_mm.worker.multimodal import warm_up_encoder

if TYPE_CHECKING:
    from vllm_hpu_mm.worker.model_runner import HpuMMModelRunner

logger = logging.getLogger("vllm.hpu_mm.warmup")


def _padding_only_step(runner: HpuMMModelRunner, num_tokens: int) -> None:
    empty = np.zeros(0, np.int64)
    shape = StepShape(
        num_decodes=0, decode_blocks=0, num_prefill_tokens=num_tokens, prefill_blocks=1
    )
    md = build_metadata(
        empty,
        empty,
        np.zeros((0, 1), np.int64),
        empty,
        runner.block_size,
        shape,
        runner.device,
        runner.buffers,
    )
    # Distinct buffers, as in serving: Dynamo guards on aliasing, so one
    # tensor passed twice would compile a graph that serving never reuses.
    zeros = np.zeros(num_tokens, np.int64)
    input_ids = runner.buffers.put("input_ids", zeros)
    positions = runner.buffers.put("positions", zeros)
    assert runner.graphs is not None
    embeds = None
    if runner.mm is not None:  # multimodal models run on merged embeddings
        embeds = runner.mm.model.embed_input_ids(input_ids)
    with set_forward_context(md, runner.vllm_config, num_tokens=num_tokens):
        if embeds is None:
            runner.graphs.body(input_ids, positions)
        else:
            runner.graphs.body(None, positions, embeds)


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
    work = [("tokens", n) for n in buckets.tokens] + [
        ("batch", n) for n in buckets.batch
    ]
    start = time.perf_counter()
    for axis, n in tqdm(
        work, desc="vllm-hpu-mm warmup", unit="graph", disable=not cfg.progress_bar
    ):
        if axis == "tokens":
            _padding_only_step(runner, n)
        else:
            hidden = torch.zeros(n, hidden_size, dtype=dtype, device=runner.device)
            graphs.logits(hidden)
    encoder_shapes = 0
    if runner.mm is not None:
        encoder_shapes = warm_up_encoder(runner, runner.vllm_config)
    if runner.cross is not None:
        encoder_shapes = runner.cross.warm_up()
    graphs.counter.phase = "serving"
    seconds = time.perf_counter() - start
    metrics.WARMUP_SECONDS.set(seconds)
    decode = len(buckets.batch)
    prefill = len([t for t in buckets.tokens if t not in buckets.batch])
    logger.info(
        "Warmup finished in %.1f s: %d prefill + %d decode graphs "
        "(%d body sizes, %d logits sizes, %d encoder sizes, %d compilations)",
        seconds,
        prefill,
        decode,
        len(buckets.tokens),
        len(buckets.batch),
        encoder_shapes,
        graphs.compiles,
    )
