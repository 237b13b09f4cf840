"""The vLLM platform of the plugin.

One class per device kind (hpu, cuda, cpu) over one shared base: vLLM reads
device facts as class attributes, and ``vllm_hpu_mm.register()`` returns the path
of the class that matches ``device.select_device()``. Everything else (worker,
model runner, attention backend) is the same code on every device.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_hpu_mm import device

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.inputs import EngineInput
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams

logger = logging.getLogger("vllm.hpu_mm.platform")

ATTN_BACKEND_CLS = "vllm_hpu_mm.attention.backend.HpuMMAttentionBackend"
COMMUNICATOR_CLS = "vllm_hpu_mm.communicator.HpuMMCommunicator"


class _HpuMMPlatformBase(Platform):
    _enum = PlatformEnum.OOT
    # vLLM's own @torch.compile helpers (sampler logprobs, vocab-parallel
    # embedding, CustomOp.maybe_compile) use this backend.
    simple_compile_backend = "inductor"
    # The quantization methods the plugin runs (FP8 weights, vllm_hpu_mm.quant);
    # ``verify_quantization`` refuses every other one at start-up, in the
    # process that parses the config.
    supported_quantization: list[str] = ["fp8", "compressed-tensors"]

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    # ---- device facts (through the device module) ----------------------------
    # vLLM calls both in the API-server process (EngineArgs.get_batch_defaults,
    # dtype checks): on HPU they answer without touching the card.
    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return device.device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return device.total_memory(device_id)

    @classmethod
    def set_device(cls, dev: torch.device) -> None:
        device.set_device(dev)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        device.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls) -> Any:
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(
        cls, device: torch.types.Device | None = None
    ) -> float:
        from vllm_hpu_mm import device as dev

        free, total = dev.memory_info()
        return float(total - free)

    @classmethod
    def use_sync_weight_loader(cls) -> bool:
        # On HPU each weight's loader ends with a device synchronisation:
        # narrowed copies into a parameter otherwise pile up in the bridge's
        # queue (lazy mode: one growing graph) and run out of device memory
        # on large checkpoints (vllm-gaudi ``platform.py``
        # ``set_synchronized_weight_loader``, "preventing Llama 405B OOM").
        return device.device_kind() == "hpu"

    @classmethod
    def make_synced_weight_loader(cls, original_weight_loader: Any) -> Any:
        # vLLM's default calls torch._sync (XLA's lazy tensors) on non-CPU
        # parameters; HPU synchronises its device (whose simulated tensors are
        # host tensors, so the parameter's device does not tell).
        if not cls.use_sync_weight_loader():
            return original_weight_loader

        def synced_weight_loader(param: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_weight_loader(param, *args, **kwargs)
            device.synchronize()
            return out

        return synced_weight_loader

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        # torch.distributed collectives over dist_backend (hccl, nccl or gloo),
        # HPU lazy mode's graph cut before each (vllm_hpu_mm.communicator).
        return COMMUNICATOR_CLS

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # The execution plan's (vllm_hpu_mm.plan): traced into the compiled graph
        # (static; the graph key is then the whole step shape), or vLLM's opaque
        # attention op between compiled pieces (dynamic; the key is the token
        # count). Read when the attention layers are built, under the engine's
        # current vLLM config.
        from vllm_hpu_mm.plan import current_plan

        return current_plan().opaque_attention

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        # The block size is chosen once, in check_and_update_config (128 on
        # Gaudi, platform_config._set_block_size). vLLM 0.33 would reset a block
        # size the user did not give to the backend's preferred one (16) in the
        # worker after the runner has read it (executor start-up), so the KV
        # spec and the runner's metadata would disagree. No hybrid models here.
        return None

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def supports_structured_output(cls) -> bool:
        # The worker splits execute_model from sample_tokens(grammar_output)
        # and applies vLLM's grammar bitmask to the persistent batch's rows.
        return True

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # Every slot applied by masked GEMMs: static shapes (``lora.punica``).
        return "vllm_hpu_mm.lora.punica.PunicaWrapperHPUMM"

    # ---- selection -------------------------------------------------------------
    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: Any,
        attn_selector_config: Any,
        num_heads: int | None = None,
    ) -> str:
        # use_mm_prefix (bidirectional image spans) is served: the models whose
        # rule the kernels do not implement are refused at start-up instead
        # (platform_config._reject_unsupported).
        unsupported = [
            name
            for name in ("use_mla", "use_sparse", "has_sink")
            if getattr(attn_selector_config, name, False)
        ]
        if unsupported:
            raise NotImplementedError(
                f"vllm-hpu-mm attention does not support {', '.join(unsupported)} "
                "(this model needs an attention kind the plugin lacks)"
            )
        return ATTN_BACKEND_CLS

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        """Refuse a quantized checkpoint (or ``--quantization``) while the config
        is built, before any weight loads: otherwise a method the plugin has no
        kernels for fails at load time or mid-serving. A supported method gets
        the plugin's config class registered in this process, before vLLM
        builds the quantization config from it."""
        if quant in cls.supported_quantization:
            from vllm_hpu_mm.quant.methods import register_quantization

            register_quantization()
            return
        supported = ", ".join(cls.supported_quantization) or "none"
        raise ValueError(
            f"vllm-hpu-mm does not run {quant!r} quantization (the checkpoint's "
            "quantization_config or --quantization). Quantization methods it "
            f"runs: {supported} (FP8 weights); unquantized checkpoints in bfloat16, "
            "float16 or "
            "float32 are served. Use an unquantized checkpoint, or serve this one "
            "with another vLLM platform."
        )

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm_hpu_mm.platform_config import update_vllm_config

        update_vllm_config(vllm_config, cls.device_type)

    @classmethod
    def validate_request(
        cls,
        processed_inputs: EngineInput,
        params: SamplingParams | PoolingParams,
    ) -> None:
        from vllm_hpu_mm.platform_config import validate_sampling_params
        from vllm_hpu_mm.serving import check_request

        validate_sampling_params(params)
        check_request(processed_inputs)


class HpuMMPlatform(_HpuMMPlatformBase):
    """Intel Gaudi."""

    device_name = "hpu"
    device_type = "hpu"
    dispatch_key = "HPU"
    dist_backend = "hccl"
    ray_device_key = "HPU"
    # Habana's per-process card selection; device.select_card narrows it per
    # local rank.
    device_control_env_var = device.VISIBLE_MODULES_ENV
    # Inductor cannot compile HPU tensors; Habana's Dynamo backend can.
    simple_compile_backend = "hpu_backend"

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        _force_bfloat16(vllm_config)
        if device.simulated():
            # The simulated Gaudi computes on host tensors (vllm_hpu_mm.gaudi_sim).
            vllm_config.device_config.device = device.torch_device()
        super().check_and_update_config(vllm_config)


def _force_bfloat16(vllm_config: VllmConfig) -> None:
    """float16 checkpoints run in bfloat16 on Gaudi, as the official plugin
    does (vllm-gaudi ``platform.py``): Gaudi's kernels and recipes are tuned for
    bfloat16, and vLLM's ``dtype="auto"`` keeps an fp16 checkpoint (such as
    llava-1.5) in fp16."""
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "dtype", None) != torch.float16:
        return
    model_config.dtype = torch.bfloat16  # type: ignore[union-attr]
    logger.info(
        "HPU: the model's float16 is served as bfloat16 (Gaudi runs bfloat16, as "
        "the official plugin does)"
    )


class SimulatedHpuMMPlatform(HpuMMPlatform):
    """Intel Gaudi simulated on the host (``vllm_hpu_mm.gaudi_sim``).

    Everything is Gaudi's but the dispatch key: the simulated card's tensors
    are host tensors, so the ops vLLM registers for the platform's key
    (``direct_register_custom_op`` reads ``current_platform.dispatch_key``:
    ``vllm::torch_sdpa_wrapper`` of the vision encoders' attention, among
    others) must be registered for ``CPU`` to be callable at all; on a real
    card they are ``HPU`` kernels taking ``HPU`` tensors."""

    dispatch_key = "CPU"


class CudaMMPlatform(_HpuMMPlatformBase):
    """NVIDIA GPU fallback: the same code path, on CUDA."""

    device_name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"
    dist_backend = "nccl"
    ray_device_key = "GPU"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"


class CpuMMPlatform(_HpuMMPlatformBase):
    """CPU fallback (CI): the same code path, on the host."""

    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    # Ray needs a resource name it knows; a local CPU cluster offers "HPU"
    # slots (`ray start --head --resources '{"HPU": 2}'`).
    ray_device_key = "HPU"
    device_control_env_var = "VLLM_HPU_MM_VISIBLE_DEVICES"


PLATFORM_CLASSES: dict[str, type[_HpuMMPlatformBase]] = {
    "hpu": HpuMMPlatform,
    "cuda": CudaMMPlatform,
    "cpu": CpuMMPlatform,
}
