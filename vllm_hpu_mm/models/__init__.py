"""Models that the plugin registers or adapts, in every process that runs one."""

from __future__ import annotations

# Lazy ("module:class"): registering imports nothing of vLLM's llava.py.
LLAVA_CLASS = "vllm_hpu_mm.models.llava:LlavaForConditionalGeneration"
GEMMA3_CLASS = "vllm_hpu_mm.models.gemma3:Gemma3ForConditionalGeneration"


def register_all() -> None:
    """Called from the ``vllm.general_plugins`` entry point. Idempotent."""
    from vllm_hpu_mm.models.compat import (
        use_pil_gemma3_image_processor,
        use_pil_pixtral_image_processor,
    )

    # vLLM's llava.py imports its Pixtral code, whose transformers image
    # processor needs torchvision; the PIL twin computes the same token counts.
    use_pil_pixtral_image_processor()
    # Likewise gemma3_mm.py names the torchvision Gemma 3 image processor.
    use_pil_gemma3_image_processor()

    from vllm import ModelRegistry

    from vllm_hpu_mm.models.mllama import MODEL_CLASS

    # Upstream vLLM dropped Mllama with V0; the plugin serves it on V1.
    ModelRegistry.register_model("MllamaForConditionalGeneration", MODEL_CLASS)
    # vLLM's LLaVA, also loading the tower layout transformers 5 writes.
    ModelRegistry.register_model("LlavaForConditionalGeneration", LLAVA_CLASS)
    # vLLM's Gemma 3, also loading the tower layout transformers 5 writes.
    ModelRegistry.register_model("Gemma3ForConditionalGeneration", GEMMA3_CLASS)
