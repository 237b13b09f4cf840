"""Quantized checkpoints: FP8 weights (``fp8`` and ``compressed-tensors``).

``methods.register_quantization`` installs the plugin's configs in vLLM (in the
worker, before the model is built); ``fp8_linear`` holds the layers' weights and
matmul. See docs/quantization.md.
"""
