"""HF transformers' Mllama as the oracle for the plugin's Mllama.

The oracle takes the prompt token ids vLLM used (vLLM tokenizes the prompt
itself; the HF processor would add a second BOS) and builds every other input
with transformers' own code: pixel values and aspect-ratio ids/masks from the
image processor, the cross-attention mask from ``processing_mllama``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch

from tests.mm_reference import png_data_url
from tools.build_tiny_models import build_tiny_model
from tools.tiny_model_specs import MLLAMA_IMAGE_TOKEN

IMAGE_TOKEN = MLLAMA_IMAGE_TOKEN
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


def tiny_mllama_dir() -> str:
    """Path of ``models/tiny-mllama`` (built on first use; kept when current)."""
    return str(build_tiny_model(MODELS_DIR, "tiny-mllama"))


@cache
def _hf(model_dir: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    model = MllamaForConditionalGeneration.from_pretrained(
        model_dir, dtype=dtype
    ).eval()
    # vLLM runs with ignore_eos=True in the comparisons: never stop early here,
    # and do not mask eos either (min_new_tokens would forbid an eos that is
    # the argmax, as in bfloat16 on some CPUs, and change the oracle's tokens).
    model.generation_config.eos_token_id = None
    return model, AutoProcessor.from_pretrained(model_dir)


def hf_mllama_inputs(
    model_dir: str, prompt_token_ids: list[int], images: list[Any]
) -> dict[str, torch.Tensor]:
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    model, processor = _hf(model_dir)
    ids = torch.tensor([prompt_token_ids])
    inputs: dict[str, torch.Tensor] = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
    }
    if images:
        pix = processor.image_processor(images=[list(images)], return_tensors="pt")
        token_mask = get_cross_attention_token_mask(
            prompt_token_ids, model.config.image_token_index
        )
        mask = convert_sparse_cross_attention_mask_to_dense(
            [token_mask],
            num_tiles=pix["num_tiles"],
            max_num_tiles=processor.image_processor.max_image_tiles,
            length=len(prompt_token_ids),
        )
        inputs.update(
            pixel_values=pix["pixel_values"],
            aspect_ratio_ids=pix["aspect_ratio_ids"],
            aspect_ratio_mask=pix["aspect_ratio_mask"],
            cross_attention_mask=torch.as_tensor(mask),
        )
    return inputs


@torch.inference_mode()
def hf_mllama_greedy(
    model_dir: str, prompt_token_ids: list[int], images: list[Any], max_tokens: int
) -> list[int]:
    """Greedy continuation of one prompt by transformers (batch of one)."""
    model, _ = _hf(model_dir)
    inputs = hf_mllama_inputs(model_dir, prompt_token_ids, images)
    out = model.generate(
        **inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt_token_ids) :].tolist()


def mllama_chat(server: Any, images: list[Any], question: str, max_tokens: int) -> Any:
    """A greedy chat request with ``images`` (PNG data URLs) to a ``vllm serve``
    ``server``; the answer carries its prompt and output token ids."""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": png_data_url(im)}} for im in images
    ]
    body = {
        "model": server.model,
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]}
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return server.post("/v1/chat/completions", body)


@torch.inference_mode()
def hf_mllama_greedy_steps(
    model_dir: str,
    prompt_token_ids: list[int],
    images: list[Any],
    max_tokens: int,
    dtype: torch.dtype,
) -> tuple[list[int], torch.Tensor]:
    """``hf_mllama_greedy`` in ``dtype``, with HF's ``[steps, vocab]`` logits
    (for ``tests.hf_reference.compare_greedy_bf16``). The pixel values go in
    ``dtype``, as a bfloat16 user of transformers passes them."""
    model, _ = _hf(model_dir, dtype)
    inputs = hf_mllama_inputs(model_dir, prompt_token_ids, images)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    out = model.generate(
        **inputs,
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[0, len(prompt_token_ids) :].tolist()
    return tokens, torch.cat([step.float() for step in out.logits], dim=0)
