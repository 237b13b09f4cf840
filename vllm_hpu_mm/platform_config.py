"""What the platform does to vLLM's config at start-up, and request checks.

``update_vllm_config`` is a short list of small steps, each one a function
below. ``validate_sampling_params`` runs in the API server before a request
reaches the engine core, so an unsupported option becomes a 400, never an
exception that would kill the engine.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.hpu_mm.platform")

WORKER_CLS = "vllm_hpu_mm.worker.worker.HpuMMWorker"
DEFAULT_BLOCK_SIZE = {"hpu": 128, "cuda": 16, "cpu": 16}


class UnsupportedConfigError(ValueError):
    """A vLLM option that this plugin cannot honour."""


def update_vllm_config(vllm_config: VllmConfig, device_type: str) -> None:
    """Check and adapt vLLM's config for the plugin (runs once per process)."""
    plugin_config = _load_plugin_config(vllm_config)  # 1. validate ours first
    _reject_unsupported(vllm_config)  # 2. features we do not implement
    _keep_images_whole(vllm_config)  # 2b. bidirectional images: never cut one
    _choose_worker(vllm_config)  # 3. our worker, whatever the device
    _set_block_size(vllm_config, device_type)  # 4. KV block size
    _set_scheduling(vllm_config)  # 5. async (vLLM's default) or sync: logged
    _set_compilation(vllm_config)  # 6. our runner owns graphs and warmup
    _install_request_checks(plugin_config, vllm_config)  # 7. 400s in the API server
    _set_shutdown_drain(vllm_config)  # 8. SIGTERM drains in-flight requests
    _set_cross_attention_limits(vllm_config)  # 9. Mllama: images per prompt
    _size_cross_attention_cache(plugin_config, vllm_config)  # 9b. Mllama: its slots
    _check_lazy_mode(plugin_config, vllm_config, device_type)  # 10. HPU lazy mode
    _set_worker_start_method(device_type)  # 11. HPU workers are spawned
    _enable_fused_ops(vllm_config, device_type)  # 12. Gaudi's fused norm, RoPE
    _set_gaudi_compile_env(plugin_config, device_type)  # 13. recipe cache, fuser
    logger.info(
        "vllm-hpu-mm config: device=%s block_size=%s max_num_seqs=%s "
        "max_num_batched_tokens=%s chunked_prefill=%s prefix_caching=%s plugin=%s",
        device_type,
        vllm_config.cache_config.block_size,
        vllm_config.scheduler_config.max_num_seqs,
        vllm_config.scheduler_config.max_num_batched_tokens,
        vllm_config.scheduler_config.enable_chunked_prefill,
        # vLLM's default (on for generation models) is kept: the runner serves
        # prefills that start after cached blocks, images included.
        getattr(vllm_config.cache_config, "enable_prefix_caching", None),
        plugin_config,
    )


def _load_plugin_config(vllm_config: VllmConfig) -> Any:
    from vllm_hpu_mm.config import load_plugin_config

    return load_plugin_config(vllm_config)


def _reject_unsupported(vllm_config: VllmConfig) -> None:
    problems = []
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding (--speculative-config)")
    lora = vllm_config.lora_config
    if lora is not None and getattr(lora, "enable_tower_connector_lora", False):
        # The runner maps adapters onto the language model's token rows only.
        problems.append(
            "LoRA on the vision tower and connector "
            "(--enable-tower-connector-lora); LoRA on the language model is served"
        )
    mc = vllm_config.model_config
    if mc is not None and mc.runner_type != "generate":
        problems.append(f"runner type {mc.runner_type!r} (only 'generate')")
    if mc is not None and getattr(mc, "is_mm_prefix_lm", False):
        hf_config = getattr(mc, "hf_config", None)
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not set(archs) & BIDIRECTIONAL_IMAGE_MODELS:
            # PaliGemma, Gemma 4, Molmo 2...: each has its own rule for which
            # tokens attend both ways; the kernels implement Gemma 3's (the
            # language layers are built from a text config, so the attention
            # selector never sees the flag: refuse here instead).
            problems.append(
                f"prefix-LM multimodal model {archs} (bidirectional attention "
                "over image tokens is served for "
                f"{', '.join(sorted(BIDIRECTIONAL_IMAGE_MODELS))} only)"
            )
    if vllm_config.kv_transfer_config is not None:
        problems.append("KV transfer connectors (--kv-transfer-config)")
    kv_dtype = _kv_cache_dtype_problem(vllm_config)
    if kv_dtype is not None:
        problems.append(kv_dtype)
    if problems:
        raise UnsupportedConfigError(
            "vllm-hpu-mm does not support: " + "; ".join(problems) + "."
        )


def _kv_cache_dtype_problem(vllm_config: VllmConfig) -> str | None:
    from vllm_hpu_mm.attention.kv_dtype import kv_cache_dtype_problem

    cc = vllm_config.cache_config
    skip = list(getattr(cc, "kv_cache_dtype_skip_layers", None) or [])
    return kv_cache_dtype_problem(str(cc.cache_dtype), skip)


# Prefix-LM multimodal models whose rule (the embedding tokens of one image
# attend to each other both ways, on top of causal attention, inside the sliding
# window on local layers) the attention kernels implement.
BIDIRECTIONAL_IMAGE_MODELS = frozenset({"Gemma3ForConditionalGeneration"})


def is_mm_prefix_lm(vllm_config: VllmConfig) -> bool:
    """Whether the image tokens of this model attend bidirectionally (vLLM's
    ``is_mm_prefix_lm``, cleared by vLLM when images are disabled)."""
    mc = vllm_config.model_config
    return bool(mc is not None and getattr(mc, "is_mm_prefix_lm", False))


def _keep_images_whole(vllm_config: VllmConfig) -> None:
    """Bidirectional image attention needs every token of an image in the
    same step: a token cannot attend to a key that a later chunk computes. As
    vLLM's CUDA platform does, turn on ``disable_chunked_mm_input``: chunked
    prefill then stops before an image that does not fit in the step and puts
    it whole in the next one (vLLM refuses a budget smaller than one image)."""
    sc = vllm_config.scheduler_config
    if not is_mm_prefix_lm(vllm_config) or not sc.is_multimodal_model:
        return
    if not sc.disable_chunked_mm_input:
        logger.info(
            "vllm-hpu-mm: bidirectional image attention: images are scheduled "
            "whole (disable_chunked_mm_input)"
        )
    sc.disable_chunked_mm_input = True
    # vLLM's Gemma 3 placeholders of consecutive images share one token (the
    # "\n\n" after one and before the next, joined into one): the first image
    # is still live in the encoder cache when the second is scheduled, so a
    # cache of one step's budget (vLLM's default; an image may take all of it)
    # would never admit the second and the request would wait for ever. Two
    # budgets always hold both.
    want = 2 * sc.max_num_batched_tokens
    if sc.encoder_cache_size < want:
        logger.info(
            "vllm-hpu-mm: encoder cache %d -> %d embedding rows (2 x "
            "max_num_batched_tokens: two consecutive whole images)",
            sc.encoder_cache_size,
            want,
        )
        sc.encoder_cache_size = want


def _choose_worker(vllm_config: VllmConfig) -> None:
    pc = vllm_config.parallel_config
    if pc.worker_cls not in ("auto", WORKER_CLS):
        logger.warning(
            "worker_cls=%s replaced by %s: the plugin's worker runs every device",
            pc.worker_cls,
            WORKER_CLS,
        )
    pc.worker_cls = WORKER_CLS


def _set_block_size(vllm_config: VllmConfig, device_type: str) -> None:
    cc = vllm_config.cache_config
    if not cc.user_specified_block_size or cc.block_size is None:
        cc.block_size = DEFAULT_BLOCK_SIZE[device_type]


def _set_scheduling(vllm_config: VllmConfig) -> None:
    # Async scheduling (vLLM's default where the executor allows it) is served:
    # the runner keeps sampled tokens on the device for the next step's inputs
    # and hands vLLM an output it waits for only when it reads it
    # (worker/async_output.py). Say which one this engine runs.
    sc = vllm_config.scheduler_config
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1 and sc.async_scheduling:
        # vLLM turns it off itself by default (and refuses it when asked for);
        # kept here should that change: the stages before the last learn the
        # sampled tokens from the scheduler, which sends them only when
        # scheduling is synchronous (worker/pipeline.py).
        sc.async_scheduling = False
    if pp > 1:
        logger.info(
            "vllm-hpu-mm: synchronous scheduling with %d pipeline stages: the "
            "stages before the last take the sampled tokens from the scheduler, "
            "which sends them only then (async scheduling is off); up to %d "
            "batches in flight, one a stage",
            pp,
            pp,
        )
        return
    logger.info(
        "vllm-hpu-mm: %s scheduling (--%sasync-scheduling)",
        "async" if sc.async_scheduling else "synchronous",
        "" if sc.async_scheduling else "no-",
    )


def _set_compilation(vllm_config: VllmConfig) -> None:
    from vllm.config import CompilationMode, CUDAGraphMode

    cc = vllm_config.compilation_config
    # vLLM's own compile pipeline and CUDA-graph capture are replaced by the
    # runner's graph wrapper (per bucket, per device).
    cc.mode = CompilationMode.NONE
    # vLLM IR ops (RMSNorm, fused add + RMSNorm, ...) call their implementation
    # directly instead of through a torch custom op: the custom-op wrapping is
    # for vLLM's own compile pipeline, which lowers the ops in an inductor pass;
    # ours has no such pass, so wrapped they stay opaque calls, unfused, in every
    # compiled graph (and cost a dispatch each in eager mode). vLLM had decided
    # this from its compile mode before the line above replaced it.
    cc.ir_enable_torch_wrap = False
    cc.cudagraph_mode = CUDAGraphMode.NONE
    cc.cudagraph_capture_sizes = []
    cc.max_cudagraph_capture_size = 0


DEFAULT_SHUTDOWN_DRAIN_S = 30
MLLAMA_DEFAULT_IMAGES_PER_PROMPT = 2


def _set_shutdown_drain(vllm_config: VllmConfig) -> None:
    # vLLM's default (0) aborts in-flight requests on SIGTERM. A serving pod is
    # stopped by SIGTERM on every rollout, so drain for up to 30 s instead (the
    # Kubernetes default grace period); --shutdown-timeout N still wins.
    if getattr(vllm_config, "shutdown_timeout", None) == 0:
        vllm_config.shutdown_timeout = DEFAULT_SHUTDOWN_DRAIN_S


def _set_cross_attention_limits(vllm_config: VllmConfig) -> None:
    """Mllama keeps each image's cross-attention K/V in a cache sized by the
    images per prompt: cap them (vLLM's default, 999, would size it absurdly),
    so that the API server refuses more with a 400. Under tensor parallelism
    the cross-attention layers split their query and KV heads over the ranks."""
    mc = getattr(vllm_config, "model_config", None)
    archs = getattr(getattr(mc, "hf_config", None), "architectures", None) or []
    if "MllamaForConditionalGeneration" not in archs:
        return
    tp = vllm_config.parallel_config.tensor_parallel_size
    text = getattr(mc.hf_config, "text_config", None)  # type: ignore[union-attr]
    heads = int(getattr(text, "num_attention_heads", 1))
    kv_heads = int(getattr(text, "num_key_value_heads", heads))
    if heads % tp or kv_heads % tp:
        raise UnsupportedConfigError(
            f"Mllama with --tensor-parallel-size {tp}: its {heads} query and "
            f"{kv_heads} KV heads must both be multiples of it (each rank holds "
            f"heads / tp of every attention layer)"
        )
    mm = getattr(mc, "multimodal_config", None)
    if mm is not None and "image" not in mm.limit_per_prompt:
        from vllm.config.multimodal import ImageDummyOptions

        mm.limit_per_prompt["image"] = ImageDummyOptions(
            count=MLLAMA_DEFAULT_IMAGES_PER_PROMPT, width=None, height=None
        )
        logger.info(
            "Mllama: at most %d images per prompt (set --limit-mm-per-prompt "
            "to change)",
            MLLAMA_DEFAULT_IMAGES_PER_PROMPT,
        )


def _size_cross_attention_cache(plugin_config: Any, vllm_config: VllmConfig) -> None:
    """Mllama's cross-attention cache holds what ``hpu_mm.memory.
    cross_attention_cache_gib`` allows (``models.mllama.cache_budget``), and
    vLLM's scheduler admits a request only when its images fit in it
    (``models.mllama.scheduling``): the slot count travels to the scheduler
    and the workers in vLLM's ``ec_manager_config.manager_config``."""
    from vllm_hpu_mm.models.mllama.cache_budget import SLOTS_KEY

    plan = cross_cache_plan(plugin_config, vllm_config)
    if plan is None:
        return
    ec = vllm_config.ec_manager_config
    ours = "vllm_hpu_mm.models.mllama.scheduling.CrossSlotEncoderCacheManager"
    if ec.encoder_cache_manager_cls not in (None, ours):
        raise UnsupportedConfigError(
            f"Mllama with --ec-manager-config encoder_cache_manager_cls="
            f"{ec.encoder_cache_manager_cls}: the plugin's own manager "
            f"({ours}) keeps the cross-attention cache's slots"
        )
    ec.encoder_cache_manager_cls = ours
    ec.manager_config = {**ec.manager_config, SLOTS_KEY: plan.slots}
    sc = vllm_config.scheduler_config
    module = "vllm_hpu_mm.models.mllama.scheduling."
    if sc.scheduler_cls is None:
        sc.scheduler_cls = module + (
            "AsyncCrossSlotScheduler" if sc.async_scheduling else "CrossSlotScheduler"
        )
    elif not str(sc.scheduler_cls).startswith(module):
        logger.warning(
            "Mllama with scheduler_cls=%s: requests are admitted without checking "
            "that their images fit the cross-attention cache's %d slots",
            sc.scheduler_cls,
            plan.slots,
        )
    logger.info("Mllama cross-attention cache: %s", plan.describe())
    _limit_images_to_slots(vllm_config, plan.slots)


def _limit_images_to_slots(vllm_config: VllmConfig, slots: int) -> None:
    """A request needs all its images in the cache at once: one with more
    images than slots would wait forever. vLLM's own per-prompt limit refuses
    it with a 400 before its images are processed (a refusal after processing,
    in ``validate_request``, would leave vLLM's multimodal processor cache
    believing the engine holds them)."""
    import dataclasses

    from vllm.config.multimodal import BaseDummyOptions

    mm = vllm_config.model_config.multimodal_config
    opts = mm.limit_per_prompt.get("image") if mm is not None else None
    if mm is None or not isinstance(opts, BaseDummyOptions) or opts.count <= slots:
        return
    count = opts.count
    mm.limit_per_prompt["image"] = dataclasses.replace(opts, count=slots)
    logger.warning(
        "Mllama: at most %d images per prompt (--limit-mm-per-prompt gave %d): the "
        "cross-attention cache holds %d images in all "
        "(hpu_mm.memory.cross_attention_cache_gib), and a request needs every one "
        "of its images there at once",
        slots,
        count,
        slots,
    )


def cross_cache_plan(plugin_config: Any, vllm_config: Any) -> Any:
    """The cross-attention cache's ``CrossCachePlan`` of an Mllama config
    (None for other models): per tensor-parallel rank, in the model's dtype."""
    from vllm_hpu_mm.models.mllama.cache_budget import (
        GIB,
        CrossCacheGeometry,
        plan_cross_cache,
    )

    mc = vllm_config.model_config
    archs = getattr(getattr(mc, "hf_config", None), "architectures", None) or []
    if "MllamaForConditionalGeneration" not in archs:
        return None
    limits = getattr(mc.multimodal_config, "limit_per_prompt", None) or {}
    per_prompt = limits.get("image", MLLAMA_DEFAULT_IMAGES_PER_PROMPT)
    geometry = CrossCacheGeometry.from_hf_config(
        mc.hf_config,
        dtype_bytes=mc.dtype.itemsize,
        tensor_parallel=vllm_config.parallel_config.tensor_parallel_size,
    )
    return plan_cross_cache(
        geometry,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        images_per_prompt=int(getattr(per_prompt, "count", per_prompt)),
        budget_bytes=int(plugin_config.memory.cross_attention_cache_gib * GIB),
    )


# ---- Gaudi process model (HPU only) ------------------------------------------------

MULTIPROC_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def _check_lazy_mode(
    plugin_config: Any, vllm_config: VllmConfig, device_type: str
) -> None:
    """Refuse torch.compile under HPU lazy mode (``PT_HPU_LAZY_MODE=1``): Dynamo
    and lazy mode are mutually exclusive. Lazy mode runs with
    ``graph_mode: eager`` (or ``--enforce-eager``): ops are queued and each step
    ends with ``mark_step``."""
    from vllm_hpu_mm import device

    if device_type != "hpu" or not device.is_lazy_mode():
        return
    mode = plugin_config.graph_mode
    if mode == "auto":
        enforce_eager = getattr(vllm_config.model_config, "enforce_eager", False)
        mode = "eager" if enforce_eager else "compile"
    if mode == "compile":
        raise UnsupportedConfigError(
            f"hpu_mm.graph_mode resolves to 'compile' (given "
            f"{plugin_config.graph_mode!r}) but the Habana bridge runs in lazy mode "
            "(PT_HPU_LAZY_MODE=1), where torch.compile is not supported. Start with "
            "PT_HPU_LAZY_MODE=0 (eager mode, the image's default) to compile, or "
            "keep lazy mode with --enforce-eager / hpu_mm.graph_mode='eager'."
        )
    logger.info("HPU lazy mode: the model runs eagerly, one mark_step per step")


def _set_worker_start_method(device_type: str) -> None:
    """Start HPU engine and worker processes with ``spawn``, as the official
    Gaudi plugin does (fork "might cause application hangs on exit"); an
    operator's explicit choice is kept, with a warning for ``fork``."""
    if device_type != "hpu":
        return
    given = os.environ.get(MULTIPROC_METHOD_ENV)
    if given is None:
        os.environ[MULTIPROC_METHOD_ENV] = "spawn"
        logger.info("HPU: %s=spawn (fork can hang on exit)", MULTIPROC_METHOD_ENV)
    elif given == "fork":
        logger.warning(
            "HPU: %s=fork was asked for and is kept, but fork can hang HPU "
            "processes on exit; unset it to use spawn",
            MULTIPROC_METHOD_ENV,
        )


def _set_gaudi_compile_env(plugin_config: Any, device_type: str) -> None:
    """HPU: the recipe cache at ``hpu_mm.warmup.compile_cache_dir`` and the
    graph compiler's parallel compilation (``device.gaudi_compile_env``; what
    the operator set is kept). Here, in the process that checks the config,
    because the bridge reads them when it initialises, which happens at device
    selection in every process: the engine and worker processes started after
    this inherit them."""
    if device_type != "hpu":
        return
    from vllm_hpu_mm import device

    added = device.gaudi_compile_env(os.environ, plugin_config.warmup.compile_cache_dir)
    os.environ.update(added)
    for key, value in added.items():
        logger.info("HPU: %s=%s", key, value)


def _enable_fused_ops(vllm_config: VllmConfig, device_type: str) -> None:
    """Turn on the out-of-tree RMSNorm / RoPE ops (``vllm_hpu_mm.fused_ops``),
    registered in the HPU worker."""
    if device_type != "hpu":
        return
    from vllm_hpu_mm.fused_ops import FUSED_OP_NAMES

    custom_ops = vllm_config.compilation_config.custom_ops
    for name in FUSED_OP_NAMES:
        if f"-{name}" not in custom_ops and f"+{name}" not in custom_ops:
            custom_ops.append(f"+{name}")


# ---- per-request checks (API-server side) ---------------------------------------


def _install_request_checks(plugin_config: Any, vllm_config: VllmConfig) -> None:
    from vllm_hpu_mm.serving import install

    install(plugin_config, vllm_config)


def validate_sampling_params(params: Any) -> None:
    """Raise RequestRejected (a ValueError, and a 400 in the API server: a bare
    ValueError raised there would become an empty 500) for a request the runner
    does not serve. Every vLLM sampling option is served (logits processors,
    structured outputs and prompt logprobs included); pooling is not."""
    from vllm.sampling_params import SamplingParams

    from vllm_hpu_mm.serving.errors import RequestRejected

    if not isinstance(params, SamplingParams):
        raise RequestRejected(
            "vllm-hpu-mm serves generation requests only (no pooling)"
        )
