"""What the tiny vision-language model builders share.

``build_tiny_llava`` and ``build_tiny_vlm2`` differ in the model (class, config,
tokenizer, processor, checkpoint names). Their text config (the tiny Llama's) and
how a model is seeded, saved, checked after saving, stamped and swapped into place
are the same and live here. Each builder passes in what is its own: the
transformers model class, the checkpoint name prefixes vLLM's loader takes, the
state-dict-to-checkpoint mapping.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from vllm_hpu_mm.tools import build_tiny_models as tiny

WEIGHTS_FILE = "model.safetensors"


def text_config(tok: Any) -> Any:
    """The tiny Llama's ``LlamaConfig`` (``build_tiny_models``) for ``tok``."""
    from transformers import LlamaConfig

    ids = tok.convert_tokens_to_ids
    return LlamaConfig(
        **tiny.BASE_CONFIG,
        vocab_size=len(tok),
        bos_token_id=ids(tiny.BOS),
        eos_token_id=[ids(tiny.EOS), ids(tiny.EOT)],
        pad_token_id=ids(tiny.PAD),
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def init_model(model_class: Any, config: Any, seed: int) -> Any:
    """``model_class(config)`` randomly initialised with ``seed``, float32, eval."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    model: Any = model_class(config)
    return model.to(torch.float32).eval()


def verify_checkpoint(
    model_dir: str | Path,
    expected: Mapping[str, Any],
    *,
    model_class: Any,
    prefixes: tuple[str, ...],
    unmapped: str,
    state_dict: Callable[[Any], dict[str, Any]],
) -> None:
    """Load ``model_dir`` with ``model_class``; every tensor must equal ``expected``.

    ``expected`` maps checkpoint names to tensors; every name must start with one
    of ``prefixes`` (``unmapped`` words the failure). ``state_dict`` maps the
    reloaded model to checkpoint names. Raises ``AssertionError`` on a missing,
    unexpected or mismatched key or on a tensor that differs.
    """
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / WEIGHTS_FILE), "pt") as f:
        names = set(f.keys())
    assert names == set(expected), "checkpoint names differ from the model's"
    bad = sorted(n for n in names if not n.startswith(prefixes))
    assert not bad, f"{unmapped}: {bad[:5]}"

    model, info = cast(
        Any,
        model_class.from_pretrained(
            model_dir, dtype=torch.float32, output_loading_info=True
        ),
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers did not load the checkpoint cleanly: {problems}"
    loaded = state_dict(model)
    assert set(loaded) == set(expected), "reloaded model has other parameters"
    differ = sorted(n for n in loaded if not torch.equal(loaded[n], expected[n]))
    assert not differ, f"weights differ after reload: {differ[:5]}"


def save_model(
    model_dir: Path,
    *,
    tok: Any,
    config: Any,
    tensors: Mapping[str, Any],
    build_processor: Callable[[Any], Any],
    verify: Callable[[Path, Mapping[str, Any]], None],
    stamp: Mapping[str, Any],
) -> None:
    """Write weights, configs, tokenizer and processor; verify; write the stamp.

    The stamp is written last, after ``verify``: it marks a complete build.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(model_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(model_dir)
    text = config.text_config
    GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    ).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    build_processor(tok).save_pretrained(model_dir)

    verify(model_dir, tensors)
    (model_dir / tiny.STAMP_FILE).write_text(json.dumps(dict(stamp)) + "\n")


def is_built(model_dir: Path, version_key: str, version: int) -> bool:
    """A complete build stamped ``version_key: version`` is in ``model_dir``."""
    if not tiny._is_built(model_dir):
        return False
    try:
        stamp = json.loads((model_dir / tiny.STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        stamp.get(version_key) == version
        and (model_dir / "processor_config.json").is_file()
    )


def build_into(
    out: str | Path,
    name: str,
    *,
    force: bool,
    is_built: Callable[[Path], bool],
    save: Callable[[Path], None],
) -> Path:
    """Build ``<out>/<name>`` with ``save`` unless it exists (or ``force``)."""
    out_dir = Path(out)
    model_dir = out_dir / name
    if is_built(model_dir) and not force:
        print(f"{name}: exists at {model_dir} (use --force to rebuild)")
        return model_dir
    # Build next to the target, then swap it in: no half-written model dir.
    tmp_dir = out_dir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        save(tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp_dir.rename(model_dir)
    print(f"{name}: built at {model_dir}")
    return model_dir


def main(
    argv: Sequence[str] | None,
    description: str,
    build: Callable[..., Path],
) -> int:
    """Command line of a builder: ``--out`` and ``--force``, then ``build``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default="models", help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild if it exists")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    build(args.out, force=args.force)
    return 0
