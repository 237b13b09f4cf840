"""HF transformers reference for the tiny Qwen2.5-VL and Qwen3-VL (float32, CPU,
greedy).

- ``tiny_qwen_dir(name)``: ``models/tiny-qwen2_5-vl`` (or ``tiny-qwen3-vl``),
  built on first use;
- ``qwen_prompt(n)``: the one prompt string both vLLM and HF get, with ``n``
  ``<|vision_start|><|image_pad|><|vision_end|>`` placeholders (the processor
  expands each pad to the image's merged-patch count);
- ``hf_qwen_inputs`` / ``hf_qwen_greedy``: the images-only processor saved with
  the model (PIL image processor, ``vllm_hpu_mm.models.qwen_processor``) and
  the checkpoint's transformers class's ``generate`` (eager attention, eos off).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from tests.mm_reference import MODELS_DIR, greedy_generate, hf_vlm_greedy
from tools import tiny_model_specs as specs
from tools.build_tiny_models import build_tiny_model

QWEN_MODEL = "tiny-qwen2_5-vl"


def tiny_qwen_dir(name: str = QWEN_MODEL) -> str:
    """Path of ``models/<name>`` (built on first use; kept when current)."""
    return str(build_tiny_model(MODELS_DIR, name))


def _architecture(model_dir: str) -> str:
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return str(config["architectures"][0])


def qwen_prompt(
    num_images: int, question: str = "What is shown?", preamble: str = ""
) -> str:
    """A user turn with ``num_images`` image placeholders, then ``question``,
    and the assistant header (the tiny model's Llama-3-like chat layout)."""
    images = specs.QWEN_IMAGE_PLACEHOLDER * num_images
    return (
        "<|start_header_id|>user<|end_header_id|>\n\n"
        f"{preamble}{images}{question}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@functools.cache
def load_hf_qwen(model_dir: str) -> Any:
    import transformers

    cls = getattr(transformers, _architecture(model_dir))
    model = cls.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    return model


@functools.cache
def load_hf_qwen_processor(model_dir: str) -> Any:
    from vllm_hpu_mm.models import qwen_processor

    return qwen_processor.IMAGES_ONLY[_architecture(model_dir)].from_pretrained(
        model_dir
    )


def hf_qwen_inputs(
    model_dir: str, prompt: str, images: Sequence[Any], add_special_tokens: bool = True
) -> Any:
    """The processor's inputs. ``add_special_tokens`` as the vLLM side
    tokenizes: True (BOS prepended) for ``LLM.generate`` on a text prompt,
    False for a chat-template rendering (which writes BOS itself)."""
    processor = load_hf_qwen_processor(model_dir)
    return processor(
        text=[prompt],
        images=list(images) or None,
        return_tensors="pt",
        add_special_tokens=add_special_tokens,
    )


def hf_qwen_greedy(
    model_dir: str,
    prompt: str,
    images: Sequence[Any],
    max_new_tokens: int,
    add_special_tokens: bool = True,
) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy continuation of exactly ``max_new_tokens`` ids)."""
    model = load_hf_qwen(model_dir)
    inputs = hf_qwen_inputs(model_dir, prompt, images, add_special_tokens)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, hf_vlm_greedy(model, inputs, max_new_tokens)


def num_image_tokens(model_dir: str, image: Any) -> int:
    """Placeholder tokens the processor gives ``image`` (merged patches)."""
    grid = hf_qwen_inputs(model_dir, qwen_prompt(1), [image])["image_grid_thw"]
    merge = specs.QWEN_MERGE_SIZE
    return int(grid.prod()) // merge**2


Case = tuple[str, list[Any]]  # (prompt, images in placeholder order)


def check_parity(
    llm: Any, model_dir: str, cases: Sequence[Case], max_new_tokens: int
) -> list[Any]:
    """Generate ``cases`` as one batch with ``llm`` (greedy, eos ignored):
    prompt ids and greedy ids equal HF's. Returns vLLM's outputs."""
    requests = [
        {"prompt": p, "multi_modal_data": {"image": ims}} if ims else {"prompt": p}
        for p, ims in cases
    ]
    outputs = greedy_generate(llm, requests, max_new_tokens)
    for i, ((prompt, images), out) in enumerate(zip(cases, outputs, strict=True)):
        want_prompt, want = hf_qwen_greedy(model_dir, prompt, images, max_new_tokens)
        assert list(out.prompt_token_ids) == want_prompt, f"case {i}: prompt ids"
        assert list(out.outputs[0].token_ids) == want, f"case {i}: {prompt!r}"
    return outputs


# --- video ------------------------------------------------------------------

Video = tuple[Any, dict[str, Any]]  # (frames [T, H, W, 3] uint8, vLLM's metadata)


def write_video(
    path: Any,
    frames: int = 6,
    size: tuple[int, int] = (48, 32),
    fps: float = 4.0,
    variant: int = 0,
) -> Any:
    """A short MJPG AVI of moving colour bands written with OpenCV; ``size`` is
    (width, height). Returns ``path``."""
    import cv2
    import numpy as np

    width, height = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, size)
    assert writer.isOpened(), f"OpenCV cannot write {path}"
    xs, ys = np.meshgrid(np.arange(width), np.arange(height))
    for t in range(frames):
        frame = np.stack(
            [
                (xs * 5 + t * 30 + variant * 50) % 256,
                (ys * 7 + variant * 20) % 256,
                np.full_like(xs, (t * 40 + variant * 90) % 256),
            ],
            -1,
        ).astype(np.uint8)
        writer.write(frame)
    writer.release()
    return path


def load_video(path: Any, num_frames: int = 32) -> Video:
    """``path`` decoded as the server decodes a ``video_url``: vLLM's video
    loader (OpenCV), up to ``num_frames`` frames, with its metadata."""
    from vllm.multimodal.media import ImageMediaIO, VideoMediaIO

    loaded = VideoMediaIO(ImageMediaIO(), num_frames=num_frames).load_file(path)
    frames, metadata = getattr(loaded, "media", loaded)
    return frames, dict(metadata)


def qwen_video_prompt(images: int, videos: int, question: str = "What happens?") -> str:
    """A user turn with ``images`` image then ``videos`` video placeholders."""
    from vllm_hpu_mm.models.qwen_processor import QWEN_VIDEO_PROMPT

    media = specs.QWEN_IMAGE_PLACEHOLDER * images + QWEN_VIDEO_PROMPT * videos
    return (
        "<|start_header_id|>user<|end_header_id|>\n\n"
        f"{media}{question}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def hf_qwen_video_inputs(
    model_dir: str,
    prompt: str,
    images: Sequence[Any],
    videos: Sequence[Video],
    add_special_tokens: bool = True,
) -> Any:
    """The processor's inputs for images and videos: transformers' processor
    ``__call__`` with the torchvision-free video processor, each video's
    metadata as vLLM passes it (its frames already sampled by the loader).

    The loader's ``do_sample_frames`` says whether the frames are the whole
    video (the processor may sample them: Qwen3-VL at 2 fps) or already
    sampled (it subsampled a video longer than ``num_frames``: the processor
    takes them as they are, and Qwen3-VL's timestamps come from the loader's
    ``frames_indices``); it is passed to the processor as such."""
    from transformers.video_utils import VideoMetadata

    processor = load_hf_qwen_processor(model_dir)
    metadata = [
        VideoMetadata(**{k: v for k, v in m.items() if k != "do_sample_frames"})
        for _, m in videos
    ]
    sampling = {bool(m.get("do_sample_frames", True)) for _, m in videos}
    assert len(sampling) <= 1, "one processor call: whole and sampled videos apart"
    kwargs = {"do_sample_frames": sampling.pop()} if sampling else {}
    return processor(
        text=[prompt],
        images=list(images) or None,
        videos=[frames for frames, _ in videos] or None,
        video_metadata=metadata or None,
        return_tensors="pt",
        add_special_tokens=add_special_tokens,
        **kwargs,
    )


def hf_qwen_video_greedy(
    model_dir: str,
    prompt: str,
    images: Sequence[Any],
    videos: Sequence[Video],
    max_new_tokens: int,
    add_special_tokens: bool = True,
) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) of HF's model on the processor's inputs
    (``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``)."""
    model = load_hf_qwen(model_dir)
    inputs = hf_qwen_video_inputs(model_dir, prompt, images, videos, add_special_tokens)
    inputs.pop("video_metadata", None)
    return inputs["input_ids"][0].tolist(), hf_vlm_greedy(model, inputs, max_new_tokens)


VideoCase = tuple[str, list[Any], list[Video]]  # (prompt, images, videos)


def check_video_parity(
    llm: Any, model_dir: str, cases: Sequence[VideoCase], max_new_tokens: int
) -> list[Any]:
    """``check_parity`` for prompts with videos (and images)."""
    requests = []
    for prompt, images, videos in cases:
        data: dict[str, Any] = {}
        if images:
            data["image"] = images
        if videos:
            data["video"] = videos
        requests.append({"prompt": prompt, "multi_modal_data": data})
    outputs = greedy_generate(llm, requests, max_new_tokens)
    for i, ((prompt, images, videos), out) in enumerate(
        zip(cases, outputs, strict=True)
    ):
        want_prompt, want = hf_qwen_video_greedy(
            model_dir, prompt, images, videos, max_new_tokens
        )
        assert list(out.prompt_token_ids) == want_prompt, f"case {i}: prompt ids"
        assert list(out.outputs[0].token_ids) == want, f"case {i}: {prompt!r}"
    return outputs
