"""Models that the plugin registers with vLLM's ModelRegistry."""

from __future__ import annotations


def register_all() -> None:
    """Register every out-of-tree model. Idempotent; called in each process."""
    # The multimodal models (Mllama) register here as they land.
    return None
