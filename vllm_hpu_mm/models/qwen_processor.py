"""The Qwen2.5-VL and Qwen3-VL processors without torchvision (transformers only,
no vLLM).

Why they exist: see ``vllm_hpu_mm.models.qwen_vl``. Each is transformers'
processor class built from the tokenizer and the PIL image processor (its
``__init__`` names only those two, so ``ProcessorMixin`` loads nothing that
needs torchvision), with the torchvision-free video processor of
``models.qwen_video`` attached by ``from_pretrained``: transformers' own
``__call__`` then expands video placeholders (Qwen3-VL's timestamps included)
from that processor's output. The tiny model builder saves through them and the
HF reference of the tests loads through them, so vLLM and HF get the same prompt
ids and pixel values.
"""

from __future__ import annotations

from typing import Any

from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from vllm_hpu_mm.models.qwen_video import (
    Qwen2VLVideoProcessorNoTV,
    Qwen3VLVideoProcessorNoTV,
    QwenVideoProcessor,
)


def _attach_video_processor(
    processor: Any, video_cls: type[QwenVideoProcessor], model_dir: Any
) -> Any:
    """``processor`` with the checkpoint's torchvision-free video processor (its
    image settings when the checkpoint saved none for video)."""
    processor.video_processor = video_cls.from_pretrained(model_dir)
    return processor


class Qwen2_5_VLImageProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` with the PIL image processor and the
    torchvision-free video processor."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        processor = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        return _attach_video_processor(
            processor, Qwen2VLVideoProcessorNoTV, pretrained_model_name_or_path
        )

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


class Qwen3VLImageProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` with the PIL image processor and the
    torchvision-free video processor."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        processor = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        return _attach_video_processor(
            processor, Qwen3VLVideoProcessorNoTV, pretrained_model_name_or_path
        )

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        # The attributes Qwen3VLProcessor.__init__ sets (its video ones
        # included: the processor's __call__ reads them), then the mixin's
        # checks over this signature's two sub-processors.
        ids = tokenizer.convert_tokens_to_ids
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = ids(self.image_token)
        self.video_token_id = ids(self.video_token)
        ProcessorMixin.__init__(
            self, image_processor, tokenizer, chat_template=chat_template, **kwargs
        )
        self.vision_start_token = "<|vision_start|>"
        self.vision_end_token = "<|vision_end|>"
        self.vision_start_token_id = ids(self.vision_start_token)
        self.vision_end_token_id = ids(self.vision_end_token)


IMAGES_ONLY: dict[str, type[ProcessorMixin]] = {
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLImageProcessor,
    "Qwen3VLForConditionalGeneration": Qwen3VLImageProcessor,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLImageProcessor,
}
# The text one image stands for in a Qwen prompt (the processor expands the pad
# to the image's merged-patch count; vLLM's prompt update does the same).
QWEN_IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"
# The same for one video (expanded to its merged patches; by Qwen3-VL's
# processor to one "<t seconds>" + vision span per temporal patch).
QWEN_VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>"


def load_processor(model_path: str) -> Any:
    """transformers' processor of a checkpoint, or, for a Qwen VL checkpoint
    whose processor needs the torchvision video processor, its images-only twin
    (``AutoProcessor`` raises OSError there)."""
    import json
    from pathlib import Path

    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path)
    except OSError:
        config = json.loads((Path(model_path) / "config.json").read_text())
        arch = (config.get("architectures") or [""])[0]
        if arch not in IMAGES_ONLY:
            raise
        return IMAGES_ONLY[arch].from_pretrained(model_path)


def image_prompt(processor: Any) -> str | None:
    """The prompt text of one image for ``processor`` (None: it names none)."""
    if isinstance(processor, tuple(IMAGES_ONLY.values())):
        return QWEN_IMAGE_PROMPT
    token = getattr(processor, "image_token", None)
    return str(token) if token else None
