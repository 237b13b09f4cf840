"""Offline ``vllm.LLM`` on the plugin with the second VLM (tiny Idefics3): greedy
parity with HF transformers.

The model is ``models/tiny-idefics3`` (``tools.build_tiny_models``):
SigLIP-like tower, pixel-shuffle connector, tiny Llama. Every image becomes
``<fake_token_around_image><global-img>`` + 16 ``<image>`` +
``<fake_token_around_image>`` (19 prompt ids, 16 of them take an image embedding).

One engine for the module, with an 8-token step budget: each image's placeholder
run is cut across three or four prefill steps (and, in the batch, shared with
other requests' chunks and decodes). Both sides get the same prompt text; the
HF ``Idefics3Processor`` expands it (BOS + image placeholders) and vLLM must
report the same ``prompt_token_ids``. Greedy, ``ignore_eos``, 10 new tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.mm_reference import (
    check_vlm_parity,
    engine_lifetime,
    hf_vlm_greedy,
    load_hf_processor,
    load_hf_vlm,
)
from tools import tiny_model_specs as specs

pytestmark = pytest.mark.e2e

MAX_NEW = 10
# Smaller than one image's 19 placeholder ids (vLLM accepts any budget >=
# max_num_seqs; the encoder budget and cache are raised to one image's 16 rows).
BUDGET = 8
MAX_NUM_SEQS = 4


# --- images (Pillow, deterministic) ---------------------------------------------


def _image(kind: str, size: tuple[int, int]) -> Any:
    """A deterministic RGB image of ``size`` = (width, height)."""
    from PIL import Image, ImageDraw

    w, h = size
    if kind == "bands":
        img = Image.new("RGB", size, (20, 40, 200))
        draw = ImageDraw.Draw(img)
        for x in range(0, w, 6):
            draw.rectangle((x, 0, x + 2, h - 1), fill=(240, 200, 30))
        draw.ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=(200, 20, 20))
        return img
    if kind == "checker":
        img = Image.new("RGB", size, (250, 250, 250))
        draw = ImageDraw.Draw(img)
        for y in range(0, h, 5):
            for x in range((y // 5) % 2 * 5, w, 10):
                draw.rectangle((x, y, x + 4, y + 4), fill=(10, 120, 60))
        return img
    if kind == "gradient":
        img = Image.new("RGB", size)
        img.putdata(
            [(255 * x // w, 255 * y // h, 128) for y in range(h) for x in range(w)]
        )
        return img
    raise ValueError(kind)


IMAGES = {
    "bands_40x24": ("bands", (40, 24)),
    "checker_24x40": ("checker", (24, 40)),
    "gradient_32x32": ("gradient", (32, 32)),
}


def image(name: str) -> Any:
    kind, size = IMAGES[name]
    return _image(kind, size)


# --- prompts --------------------------------------------------------------------


def user_prompt(text: str, with_image: bool) -> str:
    """SmolVLM-style prompt: ``User:<image>text<end_of_utterance>\\nAssistant:``."""
    img = specs.IDEFICS3_IMAGE_TOKEN if with_image else ""
    return f"User:{img}{text}{specs.IDEFICS3_END_OF_UTTERANCE}\nAssistant:"


@dataclass
class Case:
    prompt: str
    images: list[Any] = field(default_factory=list)

    def vllm_input(self) -> dict[str, Any]:
        if not self.images:
            return {"prompt": self.prompt}
        return {"prompt": self.prompt, "multi_modal_data": {"image": self.images}}


def image_case(name: str, text: str = "Describe the picture.") -> Case:
    return Case(user_prompt(text, with_image=True), [image(name)])


def text_case(text: str = "What is the capital of France?") -> Case:
    return Case(user_prompt(text, with_image=False))


# --- HF reference ---------------------------------------------------------------


def hf_model(model_dir: str) -> Any:
    return load_hf_vlm(model_dir)


def hf_processor(model_dir: str) -> Any:
    return load_hf_processor(model_dir)


def hf_inputs(model_dir: str, case: Case) -> Any:
    assert case.prompt.count(specs.IDEFICS3_IMAGE_TOKEN) == len(case.images)
    return hf_processor(model_dir)(
        text=case.prompt, images=list(case.images) or None, return_tensors="pt"
    )


def hf_prompt_ids(model_dir: str, case: Case) -> list[int]:
    return hf_inputs(model_dir, case)["input_ids"][0].tolist()


def hf_greedy(model_dir: str, case: Case) -> list[int]:
    return hf_vlm_greedy(hf_model(model_dir), hf_inputs(model_dir, case), MAX_NEW)


# --- engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_idefics3_dir: str) -> str:
    return tiny_idefics3_dir


@pytest.fixture(scope="module")
def token_ids(model_dir: str) -> dict[str, int]:
    tok = hf_processor(model_dir).tokenizer
    names = (
        specs.IDEFICS3_IMAGE_TOKEN,
        specs.IDEFICS3_FAKE_IMAGE_TOKEN,
        specs.IDEFICS3_GLOBAL_IMAGE_TOKEN,
    )
    return {t: tok.convert_tokens_to_ids(t) for t in names}


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[Any]:
    from vllm import LLM

    engine = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        seed=0,
    )
    yield from engine_lifetime(engine)


def check_parity(llm: Any, model_dir: str, cases: Sequence[Case]) -> list[Any]:
    """Generate ``cases`` as one batch: prompt ids and greedy ids equal HF's."""
    return check_vlm_parity(
        llm,
        cases,
        lambda c: hf_prompt_ids(model_dir, c),
        lambda c: hf_greedy(model_dir, c),
        MAX_NEW,
    )


def placeholder_runs(ids: Sequence[int], token_ids: dict[str, int]) -> list[int]:
    """Offsets of ``<fake><global-img><image>*16<fake>`` runs; asserts their shape."""
    fake = token_ids[specs.IDEFICS3_FAKE_IMAGE_TOKEN]
    glob = token_ids[specs.IDEFICS3_GLOBAL_IMAGE_TOKEN]
    img = token_ids[specs.IDEFICS3_IMAGE_TOKEN]
    n = specs.IDEFICS3_NUM_IMAGE_TOKENS
    starts = [i for i, t in enumerate(ids) if t == glob]
    for s in starts:
        run = list(ids[s - 1 : s - 1 + specs.IDEFICS3_NUM_PLACEHOLDER_TOKENS])
        assert run == [fake, glob, *[img] * n, fake], run
    assert sum(t == img for t in ids) == n * len(starts)
    return [s - 1 for s in starts]


# --- tests ----------------------------------------------------------------------


def test_platform_is_plugin(llm: Any) -> None:
    from vllm.platforms import current_platform

    assert type(current_platform).__module__.startswith("vllm_hpu_mm.")


def test_one_image(llm: Any, model_dir: str, token_ids: dict[str, int]) -> None:
    case = image_case("bands_40x24")
    ids = hf_prompt_ids(model_dir, case)
    bos = hf_processor(model_dir).tokenizer.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1, ids
    (offset,) = placeholder_runs(ids, token_ids)
    # The placeholder run really is cut: it spans several BUDGET-token steps.
    end = offset + specs.IDEFICS3_NUM_PLACEHOLDER_TOKENS - 1
    assert end // BUDGET - offset // BUDGET >= 2, (offset, BUDGET)
    check_parity(llm, model_dir, [case])


def test_text_only(llm: Any, model_dir: str, token_ids: dict[str, int]) -> None:
    case = text_case()
    assert placeholder_runs(hf_prompt_ids(model_dir, case), token_ids) == []
    check_parity(llm, model_dir, [case])


def test_mixed_batch_two_images(
    llm: Any, model_dir: str, token_ids: dict[str, int]
) -> None:
    """Two different images (same question) and a text prompt in one batch."""
    cases = [
        image_case("checker_24x40", "What is in this image?"),
        text_case("Please answer in a single clear sentence."),
        image_case("gradient_32x32", "What is in this image?"),
    ]
    for case in cases:
        assert len(placeholder_runs(hf_prompt_ids(model_dir, case), token_ids)) == len(
            case.images
        )
    got = check_parity(llm, model_dir, cases)
    # Same text, different images: the image features reach the logits.
    assert got[0] != got[2], got
