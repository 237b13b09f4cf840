"""The images-only Qwen2.5-VL processor (transformers only, no vLLM, no torchvision).

Why it exists: see ``vllm_hpu_mm.models.qwen_vl``. The tiny model builder saves
through it and the HF reference of the tests loads through it, so vLLM and HF
get the same prompt ids and pixel values.
"""

from __future__ import annotations

from typing import Any

from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen2_5_VLImageProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` for images only: no video sub-processor."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        # The token attributes Qwen2_5_VLProcessor.__init__ sets, then the
        # mixin's checks over this signature's two sub-processors.
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(
            self, image_processor, tokenizer, chat_template=chat_template, **kwargs
        )
