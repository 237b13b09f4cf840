"""Build the tiny, randomly initialised test models offline and deterministically.

Usage::

    python -m vllm_hpu_mm.tools.build_tiny_models --out models [--force]

Writes ``<out>/tiny-llama`` (Llama, GQA) and ``<out>/tiny-mistral`` (Mistral with a
16-token sliding window). Both share a byte-level BPE tokenizer trained here on a
few built-in sentences, with Llama-3-style special tokens and chat template.
Nothing is downloaded. A model whose directory already holds ``config.json`` and
weights is left alone unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SEED = 0  # per-model seed = SEED + position in model_specs()
# Bump when what is built changes: older builds are then rebuilt without --force.
BUILD_VERSION = 1
STAMP_FILE = "tiny_model_build.json"
VOCAB_SIZE = 640  # BPE target; the trained vocabulary ends up at most this size

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT]

# Llama-3-like: every message is "<|start_header_id|>role<|end_header_id|>\n\n
# content<|eot_id|>"; the generation prompt opens an assistant header.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A small language model can still produce text one token at a time.",
    "Paris is the capital of France, and Rome is the capital of Italy.",
    "She opened the window to let the cool morning air into the room.",
    "Every good test checks one behaviour and explains what went wrong.",
    "The train to the mountains leaves at seven o'clock every evening.",
    "We planted tomatoes, beans and sunflowers in the garden this spring.",
    "Numbers like 3, 14, 159 and 2653 appear in many simple examples.",
    "He wrote a short letter to his grandmother and posted it on Monday.",
    "The library closes early on weekends, so bring your books back soon.",
    "Clouds gathered over the hills before the first drops of rain fell.",
    "A careful engineer measures twice and changes the code only once.",
    "The cat slept on the warm windowsill while the kettle boiled.",
    "Ships carry containers across the ocean from one harbour to another.",
    "Please answer the question in a single clear and friendly sentence.",
    "Hello! How are you today? I am fine, thank you for asking.",
    "What is the weather like in London during the month of November?",
    "The orchestra played a quiet piece before the long final symphony.",
    "Bread, cheese, apples and water were packed for the long walk.",
    "Memory is divided into blocks, and each block holds a few tokens.",
    "The teacher asked the students to read the third chapter aloud.",
    "Bright stars filled the night sky above the silent desert camp.",
    "Our team meets every Tuesday to review progress and plan the week.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The museum shows paintings, old maps and a very large clock.",
    "If the server is healthy, it answers requests within a second.",
    "Birds sang in the trees as the sun rose over the quiet village.",
    "Write a poem about the sea, the wind and a small wooden boat.",
    "The recipe needs two eggs, a cup of flour and a pinch of salt.",
    "Tomorrow we will travel north by car and stop for lunch on the way.",
    "The user asked a question and the assistant gave a short reply.",
    "Good morning, everyone; let us begin with a brief summary.",
]

# Shared by both models: small, GQA (4 query heads, 2 KV heads of size 16).
# initializer_range is far above the usual 0.02 so that random logits are spread
# out: greedy decoding then moves from token to token instead of repeating one.
BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "initializer_range": 0.25,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def build_tokenizer() -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a fast HF tokenizer."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    # Like Llama 3: encoding with special tokens prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[EOS, START_HEADER, END_HEADER],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _is_built(model_dir: Path) -> bool:
    """Config, weights and a stamp of the current ``BUILD_VERSION`` are present."""
    has_weights = any(model_dir.glob("*.safetensors"))
    if not ((model_dir / "config.json").is_file() and has_weights):
        return False
    try:
        stamp = json.loads((model_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp.get("build_version") == BUILD_VERSION


def _save_model(
    model_dir: Path,
    config_cls: Callable[..., Any],
    extra: dict[str, Any],
    tok: Any,
    seed: int,
) -> None:
    """Randomly initialise ``config_cls`` with ``seed`` and save it with ``tok``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    ids = tok.convert_tokens_to_ids
    config = config_cls(
        **BASE_CONFIG,
        **extra,
        vocab_size=len(tok),
        bos_token_id=ids(BOS),
        eos_token_id=[ids(EOS), ids(EOT)],
        pad_token_id=ids(PAD),
        dtype="float32",
    )
    random.seed(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    stamp = {"build_version": BUILD_VERSION, "seed": seed}
    (model_dir / STAMP_FILE).write_text(json.dumps(stamp) + "\n")


def model_specs() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Model directory name -> (transformers config class, extra config fields)."""
    from transformers import LlamaConfig, MistralConfig

    return {
        "tiny-llama": (LlamaConfig, {}),
        "tiny-mistral": (MistralConfig, {"sliding_window": 16}),
    }


def build_tiny_models(
    out: str | Path, force: bool = False, names: Sequence[str] | None = None
) -> dict[str, Path]:
    """Build the tiny models under ``out``; return name -> model directory.

    Existing models are kept unless ``force``. ``names`` restricts what is built.
    """
    out_dir = Path(out)
    specs = model_specs()
    wanted = list(specs) if names is None else list(names)
    unknown = sorted(set(wanted) - set(specs))
    if unknown:
        raise ValueError(f"unknown tiny model(s): {', '.join(unknown)}")
    tok = None
    result: dict[str, Path] = {}
    for name in wanted:
        model_dir = out_dir / name
        result[name] = model_dir
        if _is_built(model_dir) and not force:
            print(f"{name}: exists at {model_dir} (use --force to rebuild)")
            continue
        if tok is None:
            tok = build_tokenizer()
        config_cls, extra = specs[name]
        seed = SEED + list(specs).index(name)
        # Build next to the target, then swap it in: no half-written model dir.
        tmp_dir = out_dir / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        _save_model(tmp_dir, config_cls, extra, tok, seed)
        shutil.rmtree(model_dir, ignore_errors=True)
        tmp_dir.rename(model_dir)
        print(f"{name}: built at {model_dir}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description="Build the tiny offline test models.")
    parser.add_argument("--out", default="models", help="output directory")
    parser.add_argument(
        "--force", action="store_true", help="rebuild models that already exist"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(model_specs()),
        help="build only this model (repeatable)",
    )
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    build_tiny_models(args.out, force=args.force, names=args.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
