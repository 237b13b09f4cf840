"""LoRA adapters on the plugin's runner: static-shape punica ops and the step's
adapter mapping (see docs/lora.md)."""
