"""Which checkpoint file a tensor came from, for load errors a user can act on.

vLLM's loader hands a model's ``load_weights`` a stream of ``(name, tensor)``
without the file; a load that fails names the file by looking the name up in
the checkpoint directory (``model.safetensors.index.json``, else the headers of
the ``*.safetensors`` files). Only on the error path.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

Weights = Iterable[tuple[str, torch.Tensor]]


class CheckpointWeightError(ValueError):
    """A checkpoint tensor the model cannot take, named with its file."""


def weight_file(model_path: str, name: str) -> str:
    """The checkpoint file holding tensor ``name`` (best effort)."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            if name in weight_map:
                return str(folder / weight_map[name])
        from safetensors import safe_open

        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                if name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    return str(file)
    except (OSError, ValueError):
        pass
    return f"a checkpoint file of {model_path}"


def model_path_of(config: Any) -> str:
    """Where the checkpoint was read from (transformers records it)."""
    return str(getattr(config, "_name_or_path", "") or "the checkpoint")


def load_naming_the_weight(
    load: Callable[[Weights], set[str]],
    weights: Weights,
    *,
    model: str,
    model_path: str,
    known_prefixes: Sequence[str],
) -> set[str]:
    """``load(weights)``; a ``ValueError`` is raised again with the checkpoint
    name of the tensor being loaded, its file and ``known_prefixes``.

    vLLM's ``AutoWeightsLoader`` consumes the stream lazily and fails on the
    tensor it has just read, under its mapped name; the last name read from the
    stream is the checkpoint's own.
    """
    last: list[str] = []

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            last[:] = [name]
            yield name, tensor

    try:
        return load(tracked())
    except CheckpointWeightError:
        raise
    except ValueError as e:
        if not last:
            raise
        name = last[0]
        raise CheckpointWeightError(
            f"could not load {model} weight {name!r} from "
            f"{weight_file(model_path, name)}: {e}. The loader knows the "
            f"prefixes {list(known_prefixes)}"
        ) from e
