"""Mllama (Llama 3.2 Vision) on vLLM V1 through the plugin's runner."""

MODEL_CLASS = "vllm_hpu_mm.models.mllama.model:MllamaForConditionalGeneration"
