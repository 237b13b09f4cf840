"""HF transformers reference for the tiny LLaVA (float32, CPU, greedy), and test images.

- ``tiny_llava_dir()``: ``models/tiny-llava``, built with the repository's builder
  on first use;
- ``make_image`` / ``named_image``: deterministic Pillow images of several sizes and
  aspect ratios (gradients, checkerboards, stripes, solid colours);
- ``llava_prompt(n)``: the one prompt string both vLLM and HF get, with ``n``
  ``<image>`` tokens;
- ``hf_llava_greedy``: greedy continuation with ``LlavaForConditionalGeneration``
  and the saved processor (eos disabled, so it always runs ``max_new_tokens``);
- ``hf_llava_chat_inputs``: the prompt the chat template renders for a chat with
  images, and its processed token ids, as ``vllm serve``'s chat endpoint builds it.
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tools import tiny_model_specs as specs
from tools.build_tiny_models import build_tiny_model

IMAGE_TOKEN = specs.LLAVA_IMAGE_TOKEN
NUM_IMAGE_TOKENS = specs.LLAVA_NUM_IMAGE_TOKENS
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


def tiny_llava_dir() -> str:
    """Path of ``models/tiny-llava`` (built on first use; kept when current)."""
    return str(build_tiny_model(MODELS_DIR, "tiny-llava"))


# --- images ---------------------------------------------------------------------


def make_image(kind: str, size: tuple[int, int], variant: int = 0) -> Any:
    """A deterministic RGB ``PIL.Image`` of ``size`` = (width, height).

    ``kind``: ``"gradient"``, ``"checkerboard"``, ``"stripes"`` or ``"solid"``.
    ``variant`` changes the colours (and the cell size), so that images of one
    kind and size can still differ (distinct encoder-cache keys).
    """
    import numpy as np
    from PIL import Image

    w, h = size
    v = variant
    if kind == "gradient":
        x = np.broadcast_to(np.linspace(0, 255, w, dtype=np.float32)[None, :], (h, w))
        y = np.broadcast_to(np.linspace(0, 255, h, dtype=np.float32)[:, None], (h, w))
        rgb = np.stack([(x + 37 * v) % 256, y, 255 - (x + y) / 2], axis=-1)
    elif kind == "checkerboard":
        cells = (np.indices((h, w)) // (4 + 2 * (v % 3))).sum(axis=0) % 2
        rgb = np.stack(
            [cells * 255, cells * (40 + 50 * v) % 256, 255 - cells * 255], axis=-1
        )
    elif kind == "stripes":
        yy, xx = np.indices((h, w))
        band = ((xx + yy) // (3 + v)) % 3
        palette = np.array([[230, 20, 20], [20, 200, 40], [30, 30, 220]])
        rgb = np.roll(palette, v, axis=0)[band]
    elif kind == "solid":
        colour = ((60 + 71 * v) % 256, (200 - 53 * v) % 256, (120 + 29 * v) % 256)
        rgb = np.broadcast_to(np.array(colour), (h, w, 3))
    else:
        raise ValueError(f"unknown image kind {kind!r}")
    return Image.fromarray(np.ascontiguousarray(rgb).astype(np.uint8), mode="RGB")


# name -> (kind, (width, height)); sizes other than 32x32 are resized and
# centre-cropped by the CLIP image processor (16 image tokens whatever the size).
TEST_IMAGE_SPECS: dict[str, tuple[str, tuple[int, int]]] = {
    "gradient_40x24": ("gradient", (40, 24)),
    "checker_24x40": ("checkerboard", (24, 40)),
    "solid_32x32": ("solid", (32, 32)),
    "stripes_64x48": ("stripes", (64, 48)),
}


def named_image(name: str, variant: int = 0) -> Any:
    """One of ``TEST_IMAGE_SPECS`` by name."""
    kind, size = TEST_IMAGE_SPECS[name]
    return make_image(kind, size, variant)


def png_bytes(image: Any) -> bytes:
    """The image encoded as PNG."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(image: Any) -> str:
    """``data:image/png;base64,...`` for an OpenAI ``image_url`` content part."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


# --- prompts --------------------------------------------------------------------


def llava_prompt(
    num_images: int, question: str = "Describe the picture.", preamble: str = ""
) -> str:
    """The prompt text both sides get: one ``<image>`` token per image.

    ``llava_prompt(1)`` is ``"USER: <image>\\nDescribe the picture. ASSISTANT:"``;
    with 0 images there is no image token at all. ``preamble`` is text put before
    the first image (it moves the images' placeholders relative to the chunk
    boundaries of a chunked prefill).
    """
    images = (IMAGE_TOKEN + "\n") * num_images
    return "USER: " + preamble + images + question + " ASSISTANT:"


def image_offsets(prompt_ids: Sequence[int], image_token_id: int) -> list[int]:
    """Start of each image's placeholder run in expanded prompt ids."""
    return [
        i
        for i, t in enumerate(prompt_ids)
        if t == image_token_id and (i == 0 or prompt_ids[i - 1] != image_token_id)
    ]


# --- HF reference ---------------------------------------------------------------


@functools.cache
def load_hf_vlm(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    """The checkpoint's own transformers class (``architectures[0]`` of its
    config) in ``dtype`` (float32 unless told), eval, eos disabled."""
    import json
    from pathlib import Path

    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    model = cls.from_pretrained(model_dir, dtype=dtype).eval()
    # vLLM runs with ignore_eos=True in the comparisons: never stop early here.
    model.generation_config.eos_token_id = None
    return model


def load_hf_llava(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    """``LlavaForConditionalGeneration`` (``load_hf_vlm``)."""
    return load_hf_vlm(model_dir, dtype)


@functools.cache
def load_hf_processor(model_dir: str) -> Any:
    """The saved processor (``AutoProcessor``: PIL image processors)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def hf_llava_inputs(
    model_dir: str,
    prompt_text: str,
    images: Sequence[Any],
    add_special_tokens: bool = True,
) -> Any:
    """The processor's tensors for one prompt (``<image>`` expanded to 16 ids)."""
    processor = load_hf_processor(model_dir)
    assert prompt_text.count(IMAGE_TOKEN) == len(images), (prompt_text, len(images))
    return processor(
        text=prompt_text,
        images=list(images) or None,
        add_special_tokens=add_special_tokens,
        return_tensors="pt",
    )


def hf_llava_prompt_ids(
    model_dir: str,
    prompt_text: str,
    images: Sequence[Any],
    add_special_tokens: bool = True,
) -> list[int]:
    """The expanded prompt ids (what vLLM reports as ``prompt_token_ids``)."""
    inputs = hf_llava_inputs(model_dir, prompt_text, images, add_special_tokens)
    return inputs["input_ids"][0].tolist()


def hf_llava_greedy(
    model_dir: str,
    prompt_text: str,
    images: Sequence[Any],
    max_new_tokens: int,
    add_special_tokens: bool = True,
) -> list[int]:
    """Greedy continuation of ``prompt_text`` with ``images`` (exactly
    ``max_new_tokens`` ids). ``add_special_tokens`` as the vLLM side tokenizes:
    True for ``LLM.generate`` on a text prompt (BOS prepended), False for a
    chat-template rendering (which writes BOS itself)."""
    model = load_hf_llava(model_dir)
    inputs = hf_llava_inputs(model_dir, prompt_text, images, add_special_tokens)
    n_image = int((inputs["input_ids"] == model.config.image_token_index).sum())
    assert n_image == NUM_IMAGE_TOKENS * len(images), n_image
    return hf_vlm_greedy(model, inputs, max_new_tokens)


def hf_vlm_greedy(model: Any, inputs: Any, max_new_tokens: int) -> list[int]:
    """HF ``generate``, greedy, of any VLM on its processor's ``inputs`` (batch
    of one): exactly ``max_new_tokens`` new ids (eos off, as vLLM's ignore_eos)."""
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=model.config.text_config.pad_token_id,
        )
    generated = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(generated) == max_new_tokens, (len(generated), max_new_tokens)
    return list(generated)


def hf_llava_greedy_steps(
    model_dir: str,
    prompt_text: str,
    images: Sequence[Any],
    max_new_tokens: int,
    dtype: torch.dtype,
    add_special_tokens: bool = True,
) -> tuple[list[int], torch.Tensor]:
    """``hf_llava_greedy`` in ``dtype``, with HF's ``[steps, vocab]`` logits
    (for ``tests.hf_reference.compare_greedy_bf16``)."""
    model = load_hf_llava(model_dir, dtype)
    inputs = hf_llava_inputs(model_dir, prompt_text, images, add_special_tokens)
    return hf_vlm_greedy_steps(model, inputs, max_new_tokens)


def hf_vlm_greedy_steps(
    model: Any, inputs: Any, max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """``hf_vlm_greedy`` with HF's ``[steps, vocab]`` logits (for
    ``tests.hf_reference.compare_greedy_bf16``); floating inputs (pixel
    values) in the model's dtype, as a bfloat16 user of transformers passes
    them."""
    inputs = {
        k: v.to(model.dtype) if torch.is_floating_point(v) else v
        for k, v in inputs.items()
    }
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=model.config.text_config.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(tokens) == max_new_tokens, (len(tokens), max_new_tokens)
    return tokens, torch.cat([step.float() for step in out.logits], dim=0)


def chat_messages(question: str, num_images: int) -> list[dict[str, Any]]:
    """HF-style chat messages: ``num_images`` image parts, then the text."""
    content: list[dict[str, Any]] = [{"type": "image"}] * num_images
    content = [*content, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def hf_llava_chat_prompt(model_dir: str, question: str, num_images: int) -> str:
    """The model's chat template applied by the HF processor (generation prompt
    added; it starts with BOS, so tokenize it without special tokens)."""
    processor = load_hf_processor(model_dir)
    return processor.apply_chat_template(
        chat_messages(question, num_images), add_generation_prompt=True, tokenize=False
    )


def hf_decode(model_dir: str, ids: Sequence[int]) -> str:
    """Decode like vLLM's OpenAI server (special tokens skipped)."""
    return load_hf_processor(model_dir).tokenizer.decode(
        list(ids), skip_special_tokens=True
    )


def engine_lifetime(llm: Any) -> Iterator[Any]:
    """Yield a ``vllm.LLM`` to a fixture, then shut its engine core down now
    (not at garbage collection), so the next engine starts on a free machine."""
    import gc

    try:
        yield llm
    finally:
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del llm
        gc.collect()


def greedy_generate(llm: Any, inputs: Sequence[Any], max_new_tokens: int) -> list[Any]:
    """``llm.generate`` of ``inputs`` as one batch, greedy, ignoring eos."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    outputs = llm.generate(list(inputs), params, use_tqdm=False)
    assert len(outputs) == len(inputs)
    return outputs


def check_vlm_parity(
    llm: Any,
    cases: Sequence[Any],
    hf_prompt_ids: Any,
    hf_greedy: Any,
    max_new: int,
) -> list[Any]:
    """Generate ``cases`` (with ``images`` and ``vllm_input()``) as one batch:
    each prompt's ids equal ``hf_prompt_ids(case)`` and its greedy ids
    ``hf_greedy(case)``; every difference is listed. Returns vLLM's outputs."""
    outputs = greedy_generate(llm, [c.vllm_input() for c in cases], max_new)
    problems = []
    for i, (c, out) in enumerate(zip(cases, outputs, strict=True)):
        want_prompt = hf_prompt_ids(c)
        if list(out.prompt_token_ids) != want_prompt:
            problems.append(
                f"case {i} ({len(c.images)} images): prompt ids differ\n"
                f"  vllm: {list(out.prompt_token_ids)}\n  hf:   {want_prompt}"
            )
            continue
        got, want = list(out.outputs[0].token_ids), hf_greedy(c)
        if got != want:
            problems.append(
                f"case {i} ({len(c.images)} images, prompt len {len(want_prompt)}): "
                f"greedy ids differ\n  vllm: {got}\n  hf:   {want}"
            )
    assert not problems, "vLLM != HF:\n" + "\n".join(problems)
    return outputs
