"""vLLM multimodal processing for Mllama: one ``<|image|>`` token per image.

The prompt keeps HF's layout: each image is a single ``<|image|>`` token that
self-attention sees like any other token; the image itself is read only by the
gated cross-attention layers. The placeholder of an image is therefore that one
token (widened to start at 0 for the first image, see ``apply``) with ``is_embed``
all False: vLLM's scheduler never schedules an encoder
run for it and charges it no encoder budget. The plugin's runner encodes every
image of a request when the request arrives (the tokens before the first image
already read all vision rows, see ``vllm_hpu_mm.multimodal.cross_attention``)
and keeps the cross-attention K/V in its cross-attention cache.

Per image, the processed fields are HF's, with the prompt batch dimension
dropped: ``pixel_values`` [max_tiles, 3, tile, tile], ``aspect_ratio_ids`` [],
``aspect_ratio_mask`` [max_tiles] and ``num_tiles`` [].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import BatchFeature
from vllm.multimodal.inputs import (
    MultiModalFieldConfig,
    MultiModalKwargsItems,
    PlaceholderRange,
)
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)

from vllm_hpu_mm.multimodal.token_ids import require_image_token_id

IMAGE_TOKEN = "<|image|>"


def _no_embeds(full: list[int]) -> torch.Tensor:
    """No prompt position takes an encoder output: cross-attention reads images."""
    return torch.zeros(len(full), dtype=torch.bool)


class MllamaProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Any:
        from transformers import MllamaConfig

        return self.ctx.get_hf_config(MllamaConfig)

    def get_hf_processor(self, **kwargs: object) -> Any:
        from transformers import MllamaProcessor

        return self.ctx.get_hf_processor(MllamaProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        # An image occupies one prompt token and no encoder-output rows.
        return {"image": 1}

    def tile_size(self) -> int:
        return int(self.get_hf_config().vision_config.image_size)

    def max_num_tiles(self) -> int:
        return int(self.get_hf_config().vision_config.max_num_tiles)


class MllamaDummyInputsBuilder(BaseDummyInputsBuilder[MllamaProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_TOKEN * mm_counts.get("image", 0)

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: Any = None,
    ) -> Any:
        # The widest tiling: every tile of the image is real.
        side = self.info.tile_size()
        return {
            "image": self._get_dummy_images(
                width=side * self.info.max_num_tiles(),
                height=side,
                num_images=mm_counts.get("image", 0),
                overrides=(mm_options or {}).get("image"),
            )
        }


class MllamaMultiModalProcessor(BaseMultiModalProcessor[MllamaProcessingInfo]):
    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        """Tie the prefix cache to the request's images.

        Every token of an Mllama prompt depends on every image (the tokens before
        the first image read all of them), but vLLM keys a KV block by the items
        whose placeholder it overlaps. So the first image's placeholder is widened
        to start at position 0 (its ``<|image|>`` token stays its last position),
        and the request gets a cache salt naming all its images, which enters the
        first block's hash and so every block's. A caller's own ``cache_salt``
        replaces ours; the widened placeholder still keys the blocks by the first
        image.
        """
        out = super().apply(inputs, timing_ctx)
        places = out.get("mm_placeholders", {}).get("image")
        if places and isinstance(places, list):
            end = places[0].offset + places[0].length
            places[0] = PlaceholderRange(
                offset=0, length=end, is_embed=torch.zeros(end, dtype=torch.bool)
            )
            out["cache_salt"] = "mllama-images:" + ",".join(out["mm_hashes"]["image"])
        return out

    def _get_hf_mm_text(self, mm_counts: Mapping[str, int]) -> str | None:
        return None  # the prompt is tokenized by vLLM; images go in alone

    def _call_hf_processor(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        data = dict(hf_data)
        if "images" not in data:
            return super()._call_hf_processor(data, hf_kwargs)
        processor = self.info.get_hf_processor(**hf_kwargs)
        out = processor.image_processor(
            images=[list(data["images"])],  # type: ignore[call-overload]
            return_tensors="pt",
        )
        num_images = out["pixel_values"].shape[1]
        return (
            BatchFeature(
                {
                    "pixel_values": out["pixel_values"][0],
                    "aspect_ratio_ids": out["aspect_ratio_ids"][0],
                    "aspect_ratio_mask": out["aspect_ratio_mask"][0],
                    "num_tiles": torch.tensor(out["num_tiles"][0], dtype=torch.int64)
                    if "num_tiles" in out
                    else out["aspect_ratio_mask"][0].sum(-1),
                }
            )
            if num_images
            else BatchFeature({})
        )

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return {
            name: MultiModalFieldConfig.batched("image")
            for name in (
                "pixel_values",
                "aspect_ratio_ids",
                "aspect_ratio_mask",
                "num_tiles",
            )
        }

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        image_id = require_image_token_id(self.info.get_hf_config())
        return [
            PromptReplacement(
                modality="image",
                target=[image_id],
                replacement=PromptUpdateDetails(full=[image_id], is_embed=_no_embeds),
            )
        ]
