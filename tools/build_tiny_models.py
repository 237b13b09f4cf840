"""Build the tiny, randomly initialised test models offline and deterministically.

Usage::

    python -m tools.build_tiny_models --out models [--force] [--only NAME]

Writes one directory per spec of ``tiny_model_specs`` (``tiny-llama``,
``tiny-mistral``, ``tiny-llava``, ``tiny-llava-released``, ``tiny-idefics3``,
``tiny-mllama``, ``tiny-qwen2_5-vl``, ``tiny-qwen3-vl``, ``tiny-gemma3``,
``tiny-gemma3-released``). Every model goes through the same steps: the shared
tokenizer plus the model's tokens, its config, random weights from its seed,
then transformers' own ``save_pretrained`` for the model, the generation
config, the tokenizer and the processor: the checkpoint holds exactly what
transformers
writes. Where released checkpoints lay the tensors out differently (LLaVA's CLIP
tower), a second spec writes that layout by renaming the saved tensors'
prefixes. Each build is loaded back with transformers (nothing missing,
unexpected or different) before a stamp marks it complete, and is swapped into
place whole. Nothing is downloaded. A complete build of the current spec is kept
unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from tools import tokenizer as tk
from tools.tiny_model_specs import SPECS, TinyModelSpec

# Bump when the steps below change: every older build is then rebuilt.
BUILD_VERSION = 2
STAMP_FILE = "tiny_model_build.json"
INDEX_FILE = "model.safetensors.index.json"


def model_specs() -> dict[str, TinyModelSpec]:
    """Model directory name -> spec."""
    return {spec.name: spec for spec in SPECS}


def init_model(spec: TinyModelSpec) -> tuple[Any, Any]:
    """(tokenizer, randomly initialised float32 eval model); deterministic."""
    import torch
    import transformers

    tok = tk.build_tokenizer(
        spec.added_tokens,
        spec.chat_template,
        plain_tokens=spec.plain_tokens,
        named_tokens=dict(spec.named_tokens),
    )
    config = spec.config(tok)
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.model_class)(config)
    model = model.to(torch.float32).eval()
    if spec.post_init is not None:
        spec.post_init(model, spec.seed)
    return tok, model


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards of the index)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """Every tensor name in the checkpoint, sorted."""
    from safetensors import safe_open

    names: list[str] = []
    for file in weight_files(Path(model_dir)):
        with safe_open(str(file), "pt") as f:
            names.extend(f.keys())
    return sorted(names)


def _renamed(name: str, layout: Sequence[tuple[str, str]]) -> str:
    for old, new in layout:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def convert_layout(model_dir: Path, layout: Sequence[tuple[str, str]]) -> None:
    """Rename the tensors of a saved checkpoint in place: the first ``(old, new)``
    prefix pair that matches a name replaces ``old`` by ``new``."""
    from safetensors.torch import load_file, save_file

    for file in weight_files(model_dir):
        tensors = load_file(str(file))
        renamed = {_renamed(n, layout): t for n, t in tensors.items()}
        assert len(renamed) == len(tensors), f"{file}: the layout merges names"
        save_file(renamed, str(file), metadata={"format": "pt"})
    index = model_dir / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {
            _renamed(n, layout): f for n, f in data["weight_map"].items()
        }
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def verify(model_dir: Path, spec: TinyModelSpec, model: Any) -> None:
    """transformers loads ``model_dir`` cleanly and gets ``model``'s tensors."""
    import torch
    import transformers

    cls = getattr(transformers, spec.model_class)
    loaded, info = cast(
        Any,
        cls.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True),
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{spec.name}: transformers did not load cleanly: {problems}"
    want, got = model.state_dict(), loaded.state_dict()
    assert set(want) == set(got), f"{spec.name}: reloaded with other parameters"
    differ = sorted(n for n in want if not torch.equal(want[n], got[n]))
    assert not differ, f"{spec.name}: tensors differ after reload: {differ[:5]}"


def stamp(spec: TinyModelSpec) -> dict[str, Any]:
    """What a complete build of ``spec`` records (and is recognised by)."""
    return {
        "build_version": BUILD_VERSION,
        "model_version": spec.version,
        "seed": spec.seed,
        "released_layout": [list(pair) for pair in spec.released_layout],
    }


def save_tiny_model(
    spec: TinyModelSpec, model_dir: Path, max_shard_size: str | None = None
) -> None:
    """Initialise ``spec``'s model, save it all with ``save_pretrained``, convert
    to the released layout if the spec has one, verify, and stamp."""
    from transformers import GenerationConfig

    tok, model = init_model(spec)
    model_dir.mkdir(parents=True, exist_ok=True)
    sharding = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(model_dir, **sharding)
    text = model.config.get_text_config()
    GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    ).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    if spec.processor is not None:
        spec.processor(tok).save_pretrained(model_dir)
    if spec.released_layout:
        convert_layout(model_dir, spec.released_layout)
    verify(model_dir, spec, model)
    # Last: the stamp marks a complete build.
    (model_dir / STAMP_FILE).write_text(json.dumps(stamp(spec)) + "\n")


def is_built(model_dir: Path, spec: TinyModelSpec) -> bool:
    """A complete build of the current ``spec`` is in ``model_dir``."""
    try:
        found = json.loads((model_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return found == stamp(spec) and (model_dir / "config.json").is_file()


def build_tiny_model(out: str | Path, name: str, force: bool = False) -> Path:
    """Build ``<out>/<name>`` unless it is built (or ``force``); return its path."""
    specs = model_specs()
    if name not in specs:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(specs)}")
    spec = specs[name]
    out_dir = Path(out)
    model_dir = out_dir / name
    if is_built(model_dir, spec) and not force:
        print(f"{name}: exists at {model_dir} (use --force to rebuild)")
        return model_dir
    # Build next to the target, then swap it in: no half-written model dir.
    tmp_dir = out_dir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        save_tiny_model(spec, tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp_dir.rename(model_dir)
    print(f"{name}: built at {model_dir}")
    return model_dir


def build_tiny_models(
    out: str | Path, force: bool = False, names: Sequence[str] | None = None
) -> dict[str, Path]:
    """Build the tiny models (all, or ``names``) under ``out``; name -> path."""
    wanted = list(model_specs()) if names is None else list(names)
    return {name: build_tiny_model(out, name, force) for name in wanted}


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
