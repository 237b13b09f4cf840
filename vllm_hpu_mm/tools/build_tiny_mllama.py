"""Build a tiny, randomly initialised Mllama (Llama 3.2 Vision) offline.

Usage::

    python -m vllm_hpu_mm.tools.build_tiny_mllama --out models [--force]

Writes ``<out>/tiny-mllama``: a transformers ``MllamaForConditionalGeneration``
shaped like Llama-3.2-11B-Vision but tiny. Vision: 32x32 tiles of 8x8 patches
(16 patches + CLS = 17 rows per tile, padded to 24 inside the encoder, like 1601 ->
1608 in the real model), up to 4 tiles per image, 5 local layers with
intermediate layers [1, 2, 4] (the real model's [3, 7, 15, 23, 30] of 32), 2 gated
global layers. Text: 5 layers of which 1 and 3 are gated cross-attention layers,
GQA, Llama 3 RoPE scaling. The tokenizer is ``build_tiny_models``' plus
``<|image|>`` with id ``text vocab_size`` (as 128256 in the real model: outside the
LM head, inside the 8 extra embedding rows).

transformers initialises every tanh gate at zero (an untrained model ignores its
images); here the gates get random non-zero values so that images change the
output and the parity tests can tell a wrong image apart.

The weights are saved under transformers 5's names (``model.vision_model.*``,
``model.language_model.*``, ``model.multi_modal_projector.*``, ``lm_head.*``),
which the plugin's Mllama loader takes. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_hpu_mm.tools import build_tiny_models as tiny
from vllm_hpu_mm.tools import checkpoints

NAME = "tiny-mllama"
SEED = 300
MLLAMA_BUILD_VERSION = 1

IMAGE_TOKEN = "<|image|>"
TILE_SIZE = 32
PATCH_SIZE = 8
MAX_NUM_TILES = 4
INTERMEDIATE_LAYERS = [1, 2, 4]

VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "hidden_act": "gelu",
    "num_hidden_layers": 5,
    "num_global_layers": 2,
    "attention_heads": 2,
    "intermediate_size": 64,
    "vision_output_dim": 32 * (1 + len(INTERMEDIATE_LAYERS)),
    "image_size": TILE_SIZE,
    "patch_size": PATCH_SIZE,
    "max_num_tiles": MAX_NUM_TILES,
    "intermediate_layers_indices": INTERMEDIATE_LAYERS,
    "initializer_range": 0.25,
    "norm_eps": 1e-5,
}

TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "cross_attention_layers": [1, 3],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "initializer_range": 0.25,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
}

# The text template of build_tiny_models, with image parts rendered as <|image|>.
_TEXT_PART = "{% if part['type'] == 'text' %}"
assert _TEXT_PART in tiny.CHAT_TEMPLATE
CHAT_TEMPLATE = tiny.CHAT_TEMPLATE.replace(
    _TEXT_PART,
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}",
)
CHECKPOINT_PREFIXES = ("model.vision_model.", "model.language_model.",
                       "model.multi_modal_projector.", "lm_head.")  # fmt: skip


def build_mllama_tokenizer() -> tuple[Any, int]:
    """(tokenizer with ``<|image|>``, text vocab size = the image token's id)."""
    from tokenizers import AddedToken

    tok = tiny.build_tokenizer()
    text_vocab = len(tok)
    tok.add_tokens(
        [AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True
    )
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == text_vocab
    tok.chat_template = CHAT_TEMPLATE
    return tok, text_vocab


def build_processor(tok: Any) -> Any:
    """``MllamaProcessor`` with the PIL image processor (no torchvision)."""
    from transformers import MllamaImageProcessorPil, MllamaProcessor

    image_processor = MllamaImageProcessorPil(
        size={"height": TILE_SIZE, "width": TILE_SIZE},
        max_image_tiles=MAX_NUM_TILES,
    )
    return MllamaProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE
    )


def build_config(tok: Any, text_vocab: int) -> Any:
    from transformers import MllamaConfig, MllamaTextConfig, MllamaVisionConfig

    ids = tok.convert_tokens_to_ids
    text = MllamaTextConfig(
        **TEXT_CONFIG,
        vocab_size=text_vocab,
        bos_token_id=ids(tiny.BOS),
        eos_token_id=[ids(tiny.EOS), ids(tiny.EOT)],
        pad_token_id=ids(tiny.PAD),
        dtype="float32",
    )
    vision = MllamaVisionConfig(**VISION_CONFIG, dtype="float32")
    return MllamaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids(IMAGE_TOKEN),
        architectures=["MllamaForConditionalGeneration"],
        dtype="float32",
    )


def randomize_gates(model: Any, seed: int) -> None:
    """Give every tanh gate a random value in [0.4, 1.0): non-zero, both signs."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate", "_gate", "gate_attn", "gate_ffn")):
                mag = 0.4 + 0.6 * torch.rand(param.shape, generator=gen)
                sign = torch.where(torch.rand(param.shape, generator=gen) < 0.2, -1, 1)
                param.copy_(mag * sign)


def state_dict(model: Any) -> dict[str, Any]:
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}


def verify_checkpoint(model_dir: str | Path, expected: Mapping[str, Any]) -> None:
    from transformers import MllamaForConditionalGeneration

    checkpoints.verify_checkpoint(
        model_dir,
        expected,
        model_class=MllamaForConditionalGeneration,
        prefixes=CHECKPOINT_PREFIXES,
        unmapped="names the plugin's Mllama loader does not map",
        state_dict=state_dict,
    )


def build_model(seed: int = SEED) -> tuple[Any, Any, Any]:
    """(tokenizer, config, randomly initialised model); deterministic in ``seed``."""
    from transformers import MllamaForConditionalGeneration

    tok, text_vocab = build_mllama_tokenizer()
    config = build_config(tok, text_vocab)
    model = checkpoints.init_model(MllamaForConditionalGeneration, config, seed)
    randomize_gates(model, seed)
    return tok, config, model


def _save(model_dir: Path, seed: int) -> None:
    tok, config, model = build_model(seed)
    checkpoints.save_model(
        model_dir,
        tok=tok,
        config=config,
        tensors=state_dict(model),
        build_processor=build_processor,
        verify=verify_checkpoint,
        stamp={
            "build_version": tiny.BUILD_VERSION,
            "mllama_build_version": MLLAMA_BUILD_VERSION,
            "seed": seed,
        },
    )


def _is_built(model_dir: Path) -> bool:
    return checkpoints.is_built(model_dir, "mllama_build_version", MLLAMA_BUILD_VERSION)


def build_tiny_mllama(out: str | Path, force: bool = False) -> Path:
    """Build ``<out>/tiny-mllama`` unless it exists (or ``force``); return its path."""
    return checkpoints.build_into(
        out,
        NAME,
        force=force,
        is_built=_is_built,
        save=lambda model_dir: _save(model_dir, SEED),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return checkpoints.main(
        argv, "Build the tiny offline Mllama model.", build_tiny_mllama
    )


if __name__ == "__main__":
    raise SystemExit(main())
