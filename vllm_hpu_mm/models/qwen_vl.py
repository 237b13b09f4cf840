"""vLLM's in-tree Qwen2.5-VL and Qwen3-VL, served for images and video without
torchvision.

transformers 5 builds ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` only
together with a video processor, and every Qwen video processor it has is
torchvision-based (``BaseVideoProcessor`` is a torchvision backend);
``ProcessorMixin`` refuses ``video_processor=None``. This environment has no
working torchvision (the registry's wheel does not load beside the CPU torch;
the matching torch + torchvision pair is a 5.5 GB CUDA build). The plugin
therefore takes a torchvision-free path, as it does for LLaVA's Pixtral import
(``models.compat``):

- ``Qwen2_5_VLImageProcessor`` / ``Qwen3VLImageProcessor``
  (``models.qwen_processor``): transformers' processor classes built from the
  tokenizer and the PIL image processor, with the numpy/torch video processor
  of ``models.qwen_video`` attached. A released checkpoint's files load into
  them unchanged; inputs are processed by transformers' own ``__call__``;
- the ``*ForConditionalGeneration`` classes below: vLLM's, with processing info
  that builds those processors. Both modalities are offered; vLLM's video
  loader (OpenCV) decodes the frames.

Registered only when torchvision does not work (``models.register_all``); with
torchvision vLLM's own classes and processors serve video as well.

When it can go: once torchvision is part of the environment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from vllm.model_executor.models import qwen2_5_vl, qwen3_vl, qwen3_vl_moe
from vllm.multimodal import MULTIMODAL_REGISTRY

from vllm_hpu_mm.models.expert_layout import published_expert_layout
from vllm_hpu_mm.models.qwen_processor import (
    Qwen2_5_VLImageProcessor,
    Qwen3VLImageProcessor,
)


class ImagesOnlyProcessingInfo(qwen2_5_vl.Qwen2_5_VLProcessingInfo):
    """Qwen2.5-VL's processing info over the torchvision-free processor."""

    def get_hf_processor(self, **kwargs: object) -> Qwen2_5_VLImageProcessor:  # type: ignore[override]
        return self.ctx.get_hf_processor(Qwen2_5_VLImageProcessor, **kwargs)


@MULTIMODAL_REGISTRY.register_processor(
    qwen2_5_vl.Qwen2_5_VLMultiModalProcessor,
    info=ImagesOnlyProcessingInfo,
    dummy_inputs=qwen2_5_vl.Qwen2_5_VLDummyInputsBuilder,
)
class Qwen2_5_VLForConditionalGeneration(qwen2_5_vl.Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL with the torchvision-free processor."""


class Qwen3VLImagesOnlyProcessingInfo(qwen3_vl.Qwen3VLProcessingInfo):
    """Qwen3-VL's processing info over the torchvision-free processor (images
    and video; vLLM recognises its video processor through
    ``compat.use_torchvision_free_qwen3_video_processor``)."""

    def get_hf_processor(self, **kwargs: object) -> Qwen3VLImageProcessor:  # type: ignore[override]
        return self.ctx.get_hf_processor(Qwen3VLImageProcessor, **kwargs)


@MULTIMODAL_REGISTRY.register_processor(
    qwen3_vl.Qwen3VLMultiModalProcessor,
    info=Qwen3VLImagesOnlyProcessingInfo,
    dummy_inputs=qwen3_vl.Qwen3VLDummyInputsBuilder,
)
class Qwen3VLForConditionalGeneration(qwen3_vl.Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL with the torchvision-free processor."""


class Qwen3VLMoeImagesOnlyProcessingInfo(
    Qwen3VLImagesOnlyProcessingInfo, qwen3_vl_moe.Qwen3VLMoeProcessingInfo
):
    """Qwen3-VL's info over the MoE model's config class; images only (video
    on the MoE model is not tested yet)."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        # Qwen3-VL's own adds video pixel bounds to the video scope: skip to
        # its parent's, as for an images-only model.
        parent = qwen3_vl.Qwen3VLProcessingInfo
        return super(parent, self).get_supported_mm_processor_kwargs()

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        return {"image": self.get_max_image_tokens()}


@MULTIMODAL_REGISTRY.register_processor(
    qwen3_vl.Qwen3VLMultiModalProcessor,
    info=Qwen3VLMoeImagesOnlyProcessingInfo,
    dummy_inputs=qwen3_vl.Qwen3VLDummyInputsBuilder,
)
class Qwen3VLMoeForConditionalGeneration(
    qwen3_vl_moe.Qwen3VLMoeForConditionalGeneration
):
    """vLLM's Qwen3-VL-MoE with the images-only processor (its experts on
    ``vllm_hpu_mm.moe``)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        # vLLM's Qwen3-MoE layers read ``norm_topk_prob``, which transformers
        # 5's Qwen3-VL-MoE text config does not define: its router always
        # renormalises the top-k weights (modeling_qwen3_vl_moe.py), so a
        # checkpoint without the key means True.
        text = vllm_config.model_config.hf_config.text_config
        if not hasattr(text, "norm_topk_prob"):
            text.norm_topk_prob = True
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._expert_dims = (int(text.hidden_size), int(text.moe_intermediate_size))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        hidden, inter = self._expert_dims
        return super().load_weights(
            (name, published_expert_layout(name, w, hidden, inter))
            for name, w in weights
        )
