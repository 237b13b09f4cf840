"""Models that the plugin registers or adapts, in every process that runs one."""

from __future__ import annotations

# Lazy ("module:class"): registering imports nothing of vLLM's llava.py.
LLAVA_CLASS = "vllm_hpu_mm.models.llava:LlavaForConditionalGeneration"
QWEN2_5_VL_CLASS = "vllm_hpu_mm.models.qwen_vl:Qwen2_5_VLForConditionalGeneration"
QWEN3_VL_CLASS = "vllm_hpu_mm.models.qwen_vl:Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE_CLASS = "vllm_hpu_mm.models.qwen_vl:Qwen3VLMoeForConditionalGeneration"
GEMMA3_CLASS = "vllm_hpu_mm.models.gemma3:Gemma3ForConditionalGeneration"


def register_all() -> None:
    """Called from the ``vllm.general_plugins`` entry point. Idempotent."""
    from vllm_hpu_mm.models.compat import (
        torchvision_works,
        use_pil_gemma3_image_processor,
        use_pil_pixtral_image_processor,
        use_pil_qwen2_vl_image_processor,
        use_torchvision_free_qwen3_video_processor,
    )

    # vLLM's llava.py imports its Pixtral code, whose transformers image
    # processor needs torchvision; the PIL twin computes the same token counts.
    use_pil_pixtral_image_processor()
    # The same for vLLM's Qwen2-VL family (Qwen2.5-VL, Qwen3-VL).
    use_pil_qwen2_vl_image_processor()
    # vLLM's Qwen3-VL recognises video processors by transformers' class.
    use_torchvision_free_qwen3_video_processor()
    # Likewise gemma3_mm.py names the torchvision Gemma 3 image processor.
    use_pil_gemma3_image_processor()

    from vllm import ModelRegistry

    from vllm_hpu_mm.models.mllama import MODEL_CLASS

    # Upstream vLLM dropped Mllama with V0; the plugin serves it on V1.
    ModelRegistry.register_model("MllamaForConditionalGeneration", MODEL_CLASS)
    # vLLM's LLaVA, also loading the tower layout transformers 5 writes.
    ModelRegistry.register_model("LlavaForConditionalGeneration", LLAVA_CLASS)
    if not torchvision_works():
        # transformers' Qwen2.5-VL processor needs a torchvision video
        # processor: serve images through the images-only processor.
        ModelRegistry.register_model(
            "Qwen2_5_VLForConditionalGeneration", QWEN2_5_VL_CLASS
        )
        ModelRegistry.register_model("Qwen3VLForConditionalGeneration", QWEN3_VL_CLASS)
        ModelRegistry.register_model(
            "Qwen3VLMoeForConditionalGeneration", QWEN3_VL_MOE_CLASS
        )
    # vLLM's Gemma 3, also loading the tower layout transformers 5 writes.
    ModelRegistry.register_model("Gemma3ForConditionalGeneration", GEMMA3_CLASS)
