"""Build a tiny, randomly initialised LLaVA offline and deterministically.

Usage::

    python -m vllm_hpu_mm.tools.build_tiny_llava --out models [--force]

Writes ``<out>/tiny-llava``: a transformers ``LlavaForConditionalGeneration`` with a
tiny CLIP vision tower (32x32 images, 8x8 patches, so 16 patches + CLS), a two-layer
GELU projector and the tiny Llama text model of ``build_tiny_models`` (same base
config and tokenizer, plus an ``<image>`` special token). float32. The processor is
a ``LlavaProcessor`` around the PIL ``CLIPImageProcessorPil`` (no torchvision), with
a chat template that writes ``<image>`` where a message has an image content part.

The weights are written under the names of the released llava-hf checkpoints, the
ones vLLM 0.33's ``LlavaForConditionalGeneration.load_weights`` maps:
``language_model.model.*``, ``language_model.lm_head.*``,
``vision_tower.vision_model.*`` and ``multi_modal_projector.*``. (transformers 5's
``save_pretrained`` writes the tower as ``vision_tower.*`` without
``vision_model.``, which vLLM does not load.) Before the model is moved into place,
the builder loads it back with transformers and checks that every tensor is
identical and that no key is missing or unexpected.

Nothing is downloaded. An existing build is kept unless ``--force`` is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from vllm_hpu_mm.tools import build_tiny_models as tiny
from vllm_hpu_mm.tools import checkpoints

NAME = "tiny-llava"
SEED = 100
# Bump when what is built changes: older builds are then rebuilt without --force.
# The stamp also carries build_tiny_models.BUILD_VERSION (the tokenizer's source).
LLAVA_BUILD_VERSION = 1
WEIGHTS_FILE = checkpoints.WEIGHTS_FILE

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8
VISION_FEATURE_LAYER = -2
VISION_FEATURE_SELECT_STRATEGY: Literal["default", "full"] = "default"
# CLIP adds one CLS embedding; the "default" strategy drops it again.
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

VISION_CONFIG: dict[str, Any] = {
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "num_channels": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "projection_dim": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}

# The text template of build_tiny_models, with image parts rendered as <image>.
_TEXT_PART = "{% if part['type'] == 'text' %}"
assert _TEXT_PART in tiny.CHAT_TEMPLATE
CHAT_TEMPLATE = tiny.CHAT_TEMPLATE.replace(
    _TEXT_PART,
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}",
)

# transformers 5 module path -> released llava-hf checkpoint name (what vLLM loads).
HF_TO_CHECKPOINT_PREFIX: dict[str, str] = {
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}
CHECKPOINT_PREFIXES = tuple(HF_TO_CHECKPOINT_PREFIX.values())


def checkpoint_name(hf_name: str) -> str:
    """The llava-hf checkpoint name of a transformers-5 parameter name."""
    for old, new in HF_TO_CHECKPOINT_PREFIX.items():
        if hf_name.startswith(old):
            return new + hf_name[len(old) :]
    raise ValueError(f"unexpected LLaVA parameter name: {hf_name}")


def build_llava_tokenizer() -> Any:
    """``build_tiny_models``' tokenizer plus ``<image>`` and the image chat template."""
    from tokenizers import AddedToken

    tok = tiny.build_tokenizer()
    added = tok.add_tokens(
        [AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True
    )
    assert added == 1, "the <image> token must be new"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_processor(tok: Any) -> Any:
    """``LlavaProcessor`` with the PIL CLIP image processor (no torchvision)."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy=VISION_FEATURE_SELECT_STRATEGY,
        num_additional_image_tokens=1,  # CLIP's CLS embedding
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def build_config(tok: Any) -> Any:
    """The ``LlavaConfig`` of the tiny model (text config = the tiny Llama's)."""
    from transformers import CLIPVisionConfig, LlavaConfig

    ids = tok.convert_tokens_to_ids
    text_config = checkpoints.text_config(tok)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION_CONFIG, dtype="float32"),
        text_config=text_config,
        image_token_index=ids(IMAGE_TOKEN),
        image_seq_length=NUM_IMAGE_TOKENS,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        vision_feature_layer=VISION_FEATURE_LAYER,
        vision_feature_select_strategy=VISION_FEATURE_SELECT_STRATEGY,
        tie_word_embeddings=False,
        architectures=["LlavaForConditionalGeneration"],
        dtype="float32",
    )
    return config


def checkpoint_state_dict(model: Any) -> dict[str, Any]:
    """The model's tensors under their llava-hf checkpoint names (contiguous)."""
    return {
        checkpoint_name(name): tensor.detach().contiguous().clone()
        for name, tensor in model.state_dict().items()
    }


def verify_checkpoint(model_dir: str | Path, expected: Mapping[str, Any]) -> None:
    """Load ``model_dir`` with transformers; every tensor must equal ``expected``.

    ``expected`` maps checkpoint names to tensors. Raises ``AssertionError`` on a
    missing, unexpected or mismatched key or on a tensor that differs.
    """
    from transformers import LlavaForConditionalGeneration

    checkpoints.verify_checkpoint(
        model_dir,
        expected,
        model_class=LlavaForConditionalGeneration,
        prefixes=CHECKPOINT_PREFIXES,
        unmapped="names vLLM's llava loader does not map",
        state_dict=checkpoint_state_dict,
    )


def build_model(seed: int = SEED) -> tuple[Any, Any, Any]:
    """(tokenizer, config, randomly initialised model); deterministic in ``seed``."""
    from transformers import LlavaForConditionalGeneration

    tok = build_llava_tokenizer()
    config = build_config(tok)
    model = checkpoints.init_model(LlavaForConditionalGeneration, config, seed)
    return tok, config, model


def _save_llava(model_dir: Path, seed: int) -> None:
    """Randomly initialise the tiny LLaVA with ``seed`` and save it to ``model_dir``."""
    tok, config, model = build_model(seed)
    checkpoints.save_model(
        model_dir,
        tok=tok,
        config=config,
        tensors=checkpoint_state_dict(model),
        build_processor=build_processor,
        verify=verify_checkpoint,
        stamp={
            "build_version": tiny.BUILD_VERSION,
            "llava_build_version": LLAVA_BUILD_VERSION,
            "seed": seed,
        },
    )


def _is_built(model_dir: Path) -> bool:
    """A complete build of the current versions is in ``model_dir``."""
    return checkpoints.is_built(model_dir, "llava_build_version", LLAVA_BUILD_VERSION)


def build_tiny_llava(out: str | Path, force: bool = False) -> Path:
    """Build ``<out>/tiny-llava`` unless it exists (or ``force``); return its path."""
    return checkpoints.build_into(
        out,
        NAME,
        force=force,
        is_built=_is_built,
        save=lambda model_dir: _save_llava(model_dir, SEED),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    return checkpoints.main(
        argv, "Build the tiny offline LLaVA model.", build_tiny_llava
    )


if __name__ == "__main__":
    raise SystemExit(main())
