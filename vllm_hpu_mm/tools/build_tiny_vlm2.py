"""Build a tiny, randomly initialised Idefics3 offline and deterministically.

Usage::

    python -m vllm_hpu_mm.tools.build_tiny_vlm2 --out models [--force]

Writes ``<out>/tiny-idefics3``: a transformers ``Idefics3ForConditionalGeneration``
(the SmolVLM / Idefics3 architecture) that vLLM 0.33 serves in-tree
(``vllm/model_executor/models/idefics3.py``). It is the second vision-language
model next to ``build_tiny_llava``'s LLaVA:

- vision: a SigLIP-like ``Idefics3VisionTransformer``, 32x32 images, 4x4 patches
  (64 patches), hidden 32, 2 layers, 2 heads;
- connector: pixel shuffle (scale factor 2: 64 patches -> 16 rows of 4*32) and
  one bias-free linear map 128 -> 64;
- text: the tiny Llama of ``build_tiny_models`` (same base config and
  tokenizer, plus the Idefics3 special tokens). float32.

Each image becomes ``<fake_token_around_image><global-img>`` + 16 ``<image>``
tokens + ``<fake_token_around_image>`` (image splitting is off, so every image
is resized to one 32x32 tile). The processor is an ``Idefics3Processor`` around
the PIL ``Idefics3ImageProcessorPil`` (no torchvision), with ``build_tiny_llava``'s
chat template (``<image>`` where a message has an image part).

Why not PaliGemma (the first choice)? vLLM 0.33 treats ``paligemma`` as a
multimodal prefix-LM (``ModelConfig.is_mm_prefix_lm``: bidirectional attention
over each image's placeholder run), and transformers' PaliGemma attends
bidirectionally over the whole prompt prefix; the plugin's attention is causal
only. Idefics3 is causal on both sides.

Idefics3 has no ``hf_to_vllm_mapper``: vLLM loads the transformers module names
as they are (``model.vision_model.*``, ``model.connector.*``, ``model.text_model.*``,
``lm_head.*``). The builder writes exactly those names, checks that nothing else
is in the file, loads the model back with transformers and checks that every
tensor is identical and that no key is missing or unexpected.

Nothing is downloaded. An existing build is kept unless ``--force`` is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_hpu_mm.tools import build_tiny_llava as llava
from vllm_hpu_mm.tools import build_tiny_models as tiny
from vllm_hpu_mm.tools import checkpoints

NAME = "tiny-idefics3"
ARCHITECTURE = "Idefics3ForConditionalGeneration"
SEED = 200
# Bump when what is built changes: older builds are then rebuilt without --force.
# The stamp also carries build_tiny_models.BUILD_VERSION (the tokenizer's source).
VLM2_BUILD_VERSION = 1
WEIGHTS_FILE = checkpoints.WEIGHTS_FILE

IMAGE_TOKEN = llava.IMAGE_TOKEN  # "<image>", as in Idefics3Processor
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
# Tile tags of image splitting (off here); the released tokenizers have them.
ROW_COL_TOKENS = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]

IMAGE_SIZE = 32
PATCH_SIZE = 4
SCALE_FACTOR = 2
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 16
# Token ids around an image: <fake><global-img> <image>*16 <fake>.
NUM_PLACEHOLDER_TOKENS = NUM_IMAGE_TOKENS + 3

VISION_CONFIG: dict[str, Any] = {
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "num_channels": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    # As wide as the text model's, so that different images give clearly
    # different features (the default 0.02 leaves them nearly alike).
    "initializer_range": tiny.BASE_CONFIG["initializer_range"],
}

# The names vLLM's Idefics3ForConditionalGeneration.load_weights takes as they are.
CHECKPOINT_PREFIXES = (
    "model.vision_model.",
    "model.connector.",
    "model.text_model.",
    "lm_head.",
)

CHAT_TEMPLATE = llava.CHAT_TEMPLATE


def build_vlm2_tokenizer() -> Any:
    """``build_tiny_models``' tokenizer plus the Idefics3 special tokens."""
    from tokenizers import AddedToken

    tok = tiny.build_tokenizer()
    new = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN]
    new += ROW_COL_TOKENS
    added = tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in new],
        special_tokens=True,
    )
    assert added == len(new), "the Idefics3 tokens must be new"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_processor(tok: Any) -> Any:
    """``Idefics3Processor`` with the PIL image processor (no torchvision)."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=NUM_IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    assert len(tok) == len(processor.tokenizer), "the processor added tokens"
    return processor


def build_config(tok: Any) -> Any:
    """The ``Idefics3Config`` of the tiny model (text config = the tiny Llama's)."""
    from transformers import Idefics3Config, Idefics3VisionConfig

    ids = tok.convert_tokens_to_ids
    text_config = checkpoints.text_config(tok)
    # pad_token_id is taken by Idefics3Config.__post_init__ (default: Idefics3-8B's
    # 128002), not a declared field: pass it through **kwargs.
    pad: dict[str, Any] = {"pad_token_id": ids(tiny.PAD)}
    return Idefics3Config(
        vision_config=Idefics3VisionConfig(**VISION_CONFIG, dtype="float32"),
        text_config=text_config,
        image_token_id=ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=False,
        architectures=[ARCHITECTURE],
        dtype="float32",
        **pad,
    )


def checkpoint_state_dict(model: Any) -> dict[str, Any]:
    """The model's tensors under their checkpoint (= module) names, contiguous."""
    tensors = {
        name: tensor.detach().contiguous().clone()
        for name, tensor in model.state_dict().items()
    }
    bad = sorted(n for n in tensors if not n.startswith(CHECKPOINT_PREFIXES))
    if bad:
        raise ValueError(f"unexpected Idefics3 parameter names: {bad[:5]}")
    return tensors


def verify_checkpoint(model_dir: str | Path, expected: Mapping[str, Any]) -> None:
    """Load ``model_dir`` with transformers; every tensor must equal ``expected``.

    ``expected`` maps checkpoint names to tensors. Raises ``AssertionError`` on a
    missing, unexpected or mismatched key or on a tensor that differs.
    """
    from transformers import Idefics3ForConditionalGeneration

    checkpoints.verify_checkpoint(
        model_dir,
        expected,
        model_class=Idefics3ForConditionalGeneration,
        prefixes=CHECKPOINT_PREFIXES,
        unmapped="names vLLM's idefics3 loader does not take",
        state_dict=checkpoint_state_dict,
    )


def build_model(seed: int = SEED) -> tuple[Any, Any, Any]:
    """(tokenizer, config, randomly initialised model); deterministic in ``seed``."""
    from transformers import Idefics3ForConditionalGeneration

    tok = build_vlm2_tokenizer()
    config = build_config(tok)
    model = checkpoints.init_model(Idefics3ForConditionalGeneration, config, seed)
    return tok, config, model


def _save_vlm2(model_dir: Path, seed: int) -> None:
    """Initialise the tiny Idefics3 with ``seed`` and save it to ``model_dir``."""
    tok, config, model = build_model(seed)
    processor = build_processor(tok)
    checkpoints.save_model(
        model_dir,
        tok=tok,
        config=config,
        tensors=checkpoint_state_dict(model),
        build_processor=lambda _tok: processor,
        verify=verify_checkpoint,
        stamp={
            "build_version": tiny.BUILD_VERSION,
            "vlm2_build_version": VLM2_BUILD_VERSION,
            "architecture": ARCHITECTURE,
            "seed": seed,
        },
    )


def _is_built(model_dir: Path) -> bool:
    """A complete build of the current versions is in ``model_dir``."""
    return checkpoints.is_built(model_dir, "vlm2_build_version", VLM2_BUILD_VERSION)


def build_tiny_vlm2(out: str | Path, force: bool = False) -> Path:
    """Build ``<out>/tiny-idefics3`` unless it exists (or ``force``); return it."""
    return checkpoints.build_into(
        out,
        NAME,
        force=force,
        is_built=_is_built,
        save=lambda model_dir: _save_vlm2(model_dir, SEED),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    return checkpoints.main(
        argv, "Build the tiny offline Idefics3 model (second VLM).", build_tiny_vlm2
    )


if __name__ == "__main__":
    raise SystemExit(main())
