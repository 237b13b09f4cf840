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

import argparse
import json
import os
import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from vllm_hpu_mm.tools import build_tiny_llava as llava
from vllm_hpu_mm.tools import build_tiny_models as tiny

NAME = "tiny-idefics3"
ARCHITECTURE = "Idefics3ForConditionalGeneration"
SEED = 200
# Bump when what is built changes: older builds are then rebuilt without --force.
# The stamp also carries build_tiny_models.BUILD_VERSION (the tokenizer's source).
VLM2_BUILD_VERSION = 1
WEIGHTS_FILE = llava.WEIGHTS_FILE

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
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig

    ids = tok.convert_tokens_to_ids
    text_config = LlamaConfig(
        **tiny.BASE_CONFIG,
        vocab_size=len(tok),
        bos_token_id=ids(tiny.BOS),
        eos_token_id=[ids(tiny.EOS), ids(tiny.EOT)],
        pad_token_id=ids(tiny.PAD),
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )
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
    import torch
    from safetensors import safe_open
    from transformers import Idefics3ForConditionalGeneration

    with safe_open(str(Path(model_dir) / WEIGHTS_FILE), "pt") as f:
        names = set(f.keys())
    assert names == set(expected), "checkpoint names differ from the model's"
    bad = sorted(n for n in names if not n.startswith(CHECKPOINT_PREFIXES))
    assert not bad, f"names vLLM's idefics3 loader does not take: {bad[:5]}"

    model, info = cast(
        Any,
        Idefics3ForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32, output_loading_info=True
        ),
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers did not load the checkpoint cleanly: {problems}"
    loaded = checkpoint_state_dict(model)
    assert set(loaded) == set(expected), "reloaded model has other parameters"
    differ = sorted(n for n in loaded if not torch.equal(loaded[n], expected[n]))
    assert not differ, f"weights differ after reload: {differ[:5]}"


def build_model(seed: int = SEED) -> tuple[Any, Any, Any]:
    """(tokenizer, config, randomly initialised model); deterministic in ``seed``."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    tok = build_vlm2_tokenizer()
    config = build_config(tok)
    random.seed(seed)
    torch.manual_seed(seed)
    model: Any = Idefics3ForConditionalGeneration(config)
    model = model.to(torch.float32).eval()
    return tok, config, model


def _save_vlm2(model_dir: Path, seed: int) -> None:
    """Initialise the tiny Idefics3 with ``seed`` and save it to ``model_dir``."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tok, config, model = build_model(seed)
    processor = build_processor(tok)
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_state_dict(model)
    save_file(tensors, str(model_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(model_dir)
    text = config.text_config
    GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    ).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)

    verify_checkpoint(model_dir, tensors)
    stamp = {
        "build_version": tiny.BUILD_VERSION,
        "vlm2_build_version": VLM2_BUILD_VERSION,
        "architecture": ARCHITECTURE,
        "seed": seed,
    }
    (model_dir / tiny.STAMP_FILE).write_text(json.dumps(stamp) + "\n")


def _is_built(model_dir: Path) -> bool:
    """A complete build of the current versions is in ``model_dir``."""
    if not tiny._is_built(model_dir):
        return False
    try:
        stamp = json.loads((model_dir / tiny.STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        stamp.get("vlm2_build_version") == VLM2_BUILD_VERSION
        and (model_dir / "processor_config.json").is_file()
    )


def build_tiny_vlm2(out: str | Path, force: bool = False) -> Path:
    """Build ``<out>/tiny-idefics3`` unless it exists (or ``force``); return it."""
    out_dir = Path(out)
    model_dir = out_dir / NAME
    if _is_built(model_dir) and not force:
        print(f"{NAME}: exists at {model_dir} (use --force to rebuild)")
        return model_dir
    # Build next to the target, then swap it in: no half-written model dir.
    tmp_dir = out_dir / f".{NAME}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        _save_vlm2(tmp_dir, SEED)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp_dir.rename(model_dir)
    print(f"{NAME}: built at {model_dir}")
    return model_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        description="Build the tiny offline Idefics3 model (second VLM)."
    )
    parser.add_argument("--out", default="models", help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild if it exists")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    build_tiny_vlm2(args.out, force=args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
