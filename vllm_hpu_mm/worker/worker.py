"""The plugin's worker: one process, one device, one model runner."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed import (
    ensure_model_parallel_initialized,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
)
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_hpu_mm import device as dev
from vllm_hpu_mm.patches import apply_patches
from vllm_hpu_mm.worker.model_runner import HpuMMModelRunner

logger = logging.getLogger("vllm.hpu_mm.worker")


def kv_cache_budget(
    total: int, free: int, utilization: float, activation: int, graph_fraction: float
) -> int:
    """Bytes for the KV cache: the usable share of the device, less what is in
    use (weights, the cross-attention cache), the profiled peak of the largest
    step, and ``graph_fraction`` of what remains (kept for compiled graphs)."""
    in_use = total - free
    rest = int(total * utilization) - in_use - activation
    reserve = int(max(rest, 0) * graph_fraction)
    budget = rest - reserve
    if budget <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: {total / 2**30:.2f} GiB x "
            f"gpu_memory_utilization {utilization} - {in_use / 2**30:.2f} GiB in "
            f"use - {activation / 2**30:.2f} GiB profiled peak - "
            f"{reserve / 2**30:.2f} GiB graph reserve "
            f"({graph_fraction} x the rest) = {budget / 2**30:.2f} GiB"
        )
    return budget


class HpuMMWorker(WorkerBase):
    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            vllm_config, local_rank, rank, distributed_init_method, is_driver_worker
        )
        from vllm_hpu_mm.config import load_plugin_config

        self.plugin_config = load_plugin_config(vllm_config)
        self.runner: HpuMMModelRunner | None = None
        # Pipeline parallelism: the last step's sends of intermediate tensors.
        self._pp_sends: list[Any] = []

    # ---- life cycle ---------------------------------------------------------------
    def init_device(self) -> None:
        apply_patches()
        # HPU: this worker's card via HABANA_VISIBLE_MODULES, before anything
        # touches the device; the device is un-indexed "hpu".
        pc = self.parallel_config
        self.device = dev.claim_device(
            pc.get_local_gpu_index(self.local_rank),
            pc.local_world_size * max(pc.data_parallel_size_local, 1),
        )
        dev.set_device(self.device)
        if dev.device_kind() == "hpu":
            from vllm_hpu_mm.fused_ops import register_fused_ops

            register_fused_ops()  # before the model's layers are built
        from vllm_hpu_mm.attention.encoder import register_encoder_attention

        # Every plan: each layer reads the plan when built (vLLM's form or
        # the static one).
        register_encoder_attention()
        from vllm_hpu_mm.moe import register_moe_method

        register_moe_method()  # MoE layers on the plugin's experts kernel
        apply_patches()  # those that wait for vLLM's MoE runner to be imported
        if self.model_config.quantization is not None:
            from vllm_hpu_mm.quant.methods import register_quantization

            register_quantization()  # FP8 linear layers (vllm_hpu_mm.quant)
        init_distributed_environment(
            pc.world_size,
            self.rank,
            self.distributed_init_method or "env://",
            self.local_rank,
            dev.dist_backend(),
        )
        ensure_model_parallel_initialized(
            pc.tensor_parallel_size, pc.pipeline_parallel_size
        )
        set_random_seed(self.model_config.seed)
        choice = dev.select_device()
        logger.info(
            "vllm-hpu-mm worker rank %d on %s: %s",
            self.rank,
            self.device,
            choice.reason,
        )
        self.runner = HpuMMModelRunner(
            self.vllm_config, self.device, self.plugin_config
        )
        self.model_runner = self.runner  # type: ignore[assignment]

    def _runner(self) -> HpuMMModelRunner:
        if self.runner is None:
            raise RuntimeError("init_device() has not run")
        return self.runner

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise NotImplementedError("vllm-hpu-mm does not load dummy weights")
        self._runner().load_model()

    def get_model(self) -> torch.nn.Module:
        return self._runner().get_model()

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may take."""
        cc = self.cache_config
        if cc.kv_cache_memory_bytes:
            return int(cc.kv_cache_memory_bytes)
        if dev.device_kind() == "cpu":
            logger.info(
                "KV cache on the host: %d MiB (set --kv-cache-memory-bytes to change)",
                dev.CPU_DEFAULT_KV_CACHE_BYTES // 2**20,
            )
            return dev.CPU_DEFAULT_KV_CACHE_BYTES
        activation = self._runner().profile_peak_activation_bytes()
        free, total = dev.memory_info()
        fraction = self.plugin_config.memory.graph_reserve_fraction
        budget = kv_cache_budget(
            total, free, cc.gpu_memory_utilization, activation, fraction
        )
        logger.info(
            "Memory: %.2f GiB total, %.2f GiB in use, %.2f GiB profiled peak, "
            "%.0f%% of the rest kept for graphs (hpu_mm.memory."
            "graph_reserve_fraction): %.2f GiB for the KV cache (bytes: total %d, "
            "in use %d, profiled peak %d, KV cache %d)",
            total / 2**30,
            (total - free) / 2**30,
            activation / 2**30,
            100 * fraction,
            budget / 2**30,
            total,
            total - free,
            activation,
            budget,
        )
        return budget

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self._runner().get_kv_cache_spec()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self._runner().initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        warmup = getattr(self._runner(), "warmup", None)
        if warmup is not None:
            warmup()
        return CompilationTimes(language_model=time.perf_counter() - start, encoder=0.0)

    # ---- serving -------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        """Run the model; None (the usual case) means vLLM calls
        ``sample_tokens`` next, with the step's grammar bitmask.

        Pipeline parallelism, as vLLM's GPU worker: a stage after the first
        receives the previous stage's intermediate tensors first; a stage
        before the last sends its own on (without waiting: the sends are
        waited for at the next step, before a forward could reuse memory
        they read) and returns None (its ``sample_tokens`` is empty)."""
        for handle in self._pp_sends:
            handle.wait()
        self._pp_sends = []
        runner = self._runner()
        intermediate = None
        forward = scheduler_output.total_num_scheduled_tokens > 0
        if forward and not runner.stage.is_first:
            # Received under inference mode (this method's decorator), as
            # warmup made its stand-ins: the compiled layers guard on it, and
            # a normal tensor would compile every layer graph again.
            received = get_pp_group().recv_tensor_dict(all_gather_group=get_tp_group())
            assert received is not None
            intermediate = IntermediateTensors(received)  # type: ignore[arg-type]
        out = runner.execute_model(scheduler_output, intermediate)
        if not isinstance(out, IntermediateTensors):
            return out
        handles = get_pp_group().isend_tensor_dict(
            out.tensors, all_gather_group=get_tp_group()
        )
        self._pp_sends = handles[1:]  # the first (metadata) is reaped by vLLM
        return None

    def sample_tokens(
        self, grammar_output: Any
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        return self._runner().sample_tokens(grammar_output)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def check_health(self) -> None:
        return None

    def reset_mm_cache(self) -> None:
        """vLLM's reset of the multimodal input caches (``LLM.reset_mm_cache``).

        The engine core keeps its scheduler's encoder-cache records here, so the
        encoder outputs it may still reuse stay; Mllama's image slots are the
        worker's own and are dropped (the inputs' pixels are sent again)."""
        runner = self._runner()
        if runner.cross is not None:
            self._log_reset("reset_mm_cache", runner.cross.reset(), "image slots")

    def reset_encoder_cache(self) -> None:
        """Drop cached encoder outputs and Mllama's idle image slots (vLLM calls it
        after a weight update, with the scheduler's records reset alongside)."""
        runner = self._runner()
        if runner.mm is not None:
            self._log_reset("reset_encoder_cache", runner.mm.store.clear(), "outputs")
        if runner.cross is not None:
            self._log_reset("reset_encoder_cache", runner.cross.reset(), "image slots")

    @staticmethod
    def _log_reset(call: str, dropped: int, what: str) -> None:
        logger.info("%s: dropped %d cached encoder %s", call, dropped, what)

    def peak_memory_bytes(self) -> int:
        """Peak device memory of this worker (0 on the CPU); read by the bench."""
        return dev.peak_memory_bytes()

    def get_cache_block_size_bytes(self) -> int:
        specs = self.get_kv_cache_spec()
        return sum(s.page_size_bytes for s in specs.values())

    # ---- LoRA (``worker.lora``) ------------------------------------------------
    def _lora(self) -> Any:
        lora = self._runner().lora
        if lora is None:
            raise RuntimeError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        return lora

    def add_lora(self, lora_request: Any) -> bool:
        return bool(self._lora().add(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        return bool(self._lora().remove(lora_id))

    def pin_lora(self, lora_id: int) -> bool:
        return bool(self._lora().pin(lora_id))

    def list_loras(self) -> set[int]:
        return set(self._lora().list())

    def shutdown(self) -> None:
        # The gauge's file outlives this process in the multiprocess directory
        # (read with "max" across processes): leave 0 behind, not stale items.
        from vllm_hpu_mm import metrics

        metrics.ENCODER_CACHE_ITEMS.set(0)
        self.runner = None
