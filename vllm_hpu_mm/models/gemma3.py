"""vLLM's in-tree Gemma 3 (vision), also taking the tower layout transformers 5 writes.

Released Gemma 3 checkpoints (and vLLM's ``Gemma3ForConditionalGeneration``)
name the SigLIP tower ``vision_tower.vision_model.*``; transformers 5's
``save_pretrained`` writes ``vision_tower.*`` (its ``SiglipVisionModel`` has no
``vision_model`` level any more), which vLLM 0.33's mapper passes through to a
parameter that does not exist. As for LLaVA (``models.llava``), one mapper rule
adds the level when a tower name lacks it; a tensor that cannot be loaded is
reported with its checkpoint name and file. Everything else is vLLM's class:
the bidirectional attention among an image's tokens is the attention backend's
(``prefill_tile_span_*`` in the metadata).

When it can go: once vLLM's Gemma 3 maps the flat tower layout itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models import gemma3_mm

from vllm_hpu_mm.models.llava import FLAT_TOWER_MAPPER, load_tower_model


class Gemma3ForConditionalGeneration(gemma3_mm.Gemma3ForConditionalGeneration):
    """vLLM's Gemma 3; loads ``vision_tower.*`` and ``vision_tower.vision_model.*``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # Regexes run before the prefix map: the nested name then takes vLLM's
        # own "model.vision_tower." -> "vision_tower." rule.
        self.hf_to_vllm_mapper = type(self).hf_to_vllm_mapper | FLAT_TOWER_MAPPER

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_tower_model(self, super().load_weights, weights, "Gemma 3")
