"""Prometheus metrics of the plugin, exported on vLLM's /metrics.

The counters live in the worker process; ``vllm serve`` merges every process's
values because ``vllm_hpu_mm.register()`` (which runs before prometheus_client
is first imported) points PROMETHEUS_MULTIPROC_DIR at a fresh directory when the
operator has not set one. Import this module only from worker-side code.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from vllm_hpu_mm.bucketing.record import STEP_SHAPE_EDGES

PREFIX = "vllm_hpu_mm:"

GRAPH_COMPILES = Counter(
    PREFIX + "graph_compiles",
    "Graph compilations (counted inside the compiler backend), by phase.",
    ["phase"],  # "warmup" or "serving"
)
PADDED_TOKENS = Counter(
    PREFIX + "padded_tokens",
    "Token rows added by bucket padding (not real tokens).",
)
SCHEDULED_TOKENS = Counter(
    PREFIX + "scheduled_tokens",
    "Real tokens run by the model (the denominator of the padding ratio).",
)
BUCKET_PADDED_TOKENS = Counter(
    PREFIX + "bucket_padded_tokens",
    "Padding token rows, by the step's token bucket (padded token rows).",
    ["bucket"],
)
BUCKET_SCHEDULED_TOKENS = Counter(
    PREFIX + "bucket_scheduled_tokens",
    "Real tokens, by the step's token bucket (padded token rows).",
    ["bucket"],
)
PREFILL_FORM_STEPS = Counter(
    PREFIX + "prefill_form_steps",
    "Steps with prefill rows, by the form their bucket runs them in: tiles, "
    "request (one request's rows as one tile) or causal (one fresh prompt).",
    ["form"],
)
FALLBACK_BUCKETS = Counter(
    PREFIX + "fallback_buckets",
    "Steps whose shape fitted no prepared bucket and took the fallback size.",
)
STEP_SIZE_EDGES = STEP_SHAPE_EDGES
"""Histogram edges of ``STEP_SHAPE``: every size up to 16, then 16 an octave up to
2**18 (an axis value above the last lands in ``+Inf``), fine enough for
``vllm-hpu-mm buckets plan --metrics`` to plan from."""
STEP_SHAPE = Histogram(
    PREFIX + "step_shape",
    "Exact (unpadded) sizes of the served steps, by axis (first rank; warmup and "
    "the memory profile not counted): tokens (decode rows + prefill tokens), "
    "requests, decode_rows, decode_blocks (steps with decodes), prefill_tokens, "
    "prefill_blocks (steps with a prefill). The traffic to fit buckets to "
    "(vllm-hpu-mm buckets plan --metrics).",
    ["axis"],
    buckets=STEP_SIZE_EDGES,
)
WARMUP_SECONDS = Gauge(
    PREFIX + "warmup_seconds",
    "Seconds the last warmup took (0 when skipped).",
    multiprocess_mode="max",
)
ENCODER_RUNS = Counter(
    PREFIX + "encoder_runs",
    "Multimodal items run through the encoder (once per item while cached).",
)
VISION_PATCHES = Counter(
    PREFIX + "vision_patches",
    "Real image patches run through a patch-bucketed vision tower (Qwen2.5-VL).",
)
VISION_PADDING_PATCHES = Counter(
    PREFIX + "vision_padding_patches",
    "Padding patches added to reach the vision tower's patch bucket.",
)
MM_ITEMS = Counter(
    PREFIX + "mm_items",
    "Multimodal items received in requests.",
)
ENCODER_CACHE_ITEMS = Gauge(
    PREFIX + "encoder_cache_items",
    "Encoder outputs currently cached in the worker.",
    multiprocess_mode="max",
)


def counts_items_here() -> bool:
    """Whether this worker counts encoder runs and items: every tensor-parallel
    rank runs the encoders on the same items, so only rank 0 counts them (a
    single-process engine always does)."""
    from vllm.distributed import parallel_state

    return (
        not parallel_state.model_parallel_is_initialized()
        or parallel_state.get_tensor_model_parallel_rank() == 0
    )
