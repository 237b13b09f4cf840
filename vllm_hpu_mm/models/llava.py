"""vLLM's in-tree LLaVA, also taking the checkpoint layout transformers 5 writes.

Released llava-hf checkpoints (and vLLM's ``LlavaForConditionalGeneration``) name
a CLIP or SigLIP tower ``vision_tower.vision_model.*``. transformers 5's
``CLIPVisionModel`` has no ``vision_model`` level any more (its loader strips the
prefix on the way in), so ``save_pretrained`` writes ``vision_tower.*`` (and a
saved ``state_dict()`` ``model.vision_tower.*``), which vLLM 0.33's own
``hf_to_vllm_mapper`` passes through to a parameter that does not exist. The
subclass below adds one rule to that mapper, only when vLLM's tower nests its
parameters under ``vision_model`` (CLIP, SigLIP; not Pixtral): a tower name that
does not already say ``vision_model.`` gets it. A tensor that cannot be loaded is
reported with its checkpoint name and file. Everything else is vLLM's class.

When it can go: once vLLM's LLaVA maps the flat tower layout itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models import llava
from vllm.model_executor.models.utils import WeightsMapper

from vllm_hpu_mm.models.checkpoint_files import load_naming_the_weight, model_path_of

# (model.)vision_tower.X -> (model.)vision_tower.vision_model.X unless X says it.
FLAT_TOWER_MAPPER = WeightsMapper(
    orig_to_new_regex={
        re.compile(r"^(model\.)?vision_tower\.(?!vision_model\.)"): (
            r"\1vision_tower.vision_model."
        )
    }
)


class LlavaForConditionalGeneration(llava.LlavaForConditionalGeneration):
    """vLLM's LLaVA; loads ``vision_tower.*`` and ``vision_tower.vision_model.*``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if hasattr(self.vision_tower, "vision_model"):
            # Regexes run before the prefix map: the nested name then takes
            # vLLM's own "model.vision_tower." -> "vision_tower." rule.
            self.hf_to_vllm_mapper = type(self).hf_to_vllm_mapper | FLAT_TOWER_MAPPER

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_tower_model(self, super().load_weights, weights, "LLaVA")


def load_tower_model(
    model: Any,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]],
    weights: Iterable[tuple[str, torch.Tensor]],
    name: str,
) -> set[str]:
    """``load`` (vLLM's ``load_weights``) of a model whose vision tower may be
    saved flat or nested: an unknown tensor is named with the prefixes the
    model's mapper knows, the nested tower's included."""
    prefixes = model.hf_to_vllm_mapper.orig_to_new_prefix
    known = sorted({*prefixes, *(p for p in prefixes.values() if p)})
    return load_naming_the_weight(
        load,
        weights,
        model=name,
        model_path=model_path_of(model.config),
        known_prefixes=[*known, "vision_tower.vision_model."],
    )
