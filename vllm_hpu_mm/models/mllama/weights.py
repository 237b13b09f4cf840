"""Checkpoint names of Mllama (Llama 3.2 Vision) and how the plugin's model takes them.

Two layouts name the same tensors:

- **published** (what every released Llama-3.2-Vision checkpoint holds, and what
  transformers 5's ``save_pretrained`` writes): ``language_model.model.*``,
  ``language_model.lm_head.*``, ``vision_model.*``, ``multi_modal_projector.*``;
- **module names** of transformers 5's ``MllamaForConditionalGeneration`` (a
  ``state_dict()`` saved as it is): ``model.language_model.*``, ``lm_head.*``,
  ``model.vision_model.*``, ``model.multi_modal_projector.*``.

The plugin's model is built with the module names, so ``LAYOUT_MAPPER`` (the
model's ``hf_to_vllm_mapper``) maps the published prefixes onto them and leaves
module names alone. Inside the text model, ``TEXT_MAPPER`` stacks the
self-attention q/k/v and the MLP gate/up projections into vLLM's fused
``qkv_proj`` / ``gate_up_proj`` (the cross-attention projections stay apart). Both
are vLLM ``WeightsMapper``s applied by ``AutoWeightsLoader``, as in-tree models do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from vllm.model_executor.models.utils import WeightsMapper

from vllm_hpu_mm.models.checkpoint_files import CheckpointWeightError, weight_file

# published prefix -> module-name prefix
PUBLISHED_TO_MODULE: dict[str, str] = {
    "language_model.model.": "model.language_model.",
    "language_model.lm_head.": "lm_head.",
    "vision_model.": "model.vision_model.",
    "multi_modal_projector.": "model.multi_modal_projector.",
}
LAYOUT_MAPPER = WeightsMapper(orig_to_new_prefix=PUBLISHED_TO_MODULE)

TEXT_PREFIX = "model.language_model."
TEXT_MAPPER = WeightsMapper(
    orig_to_new_stacked={
        # checkpoint name part: (fused parameter name part, shard id)
        ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
        ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
        ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
        ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
        ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
    }
)

KNOWN_PREFIXES: tuple[str, ...] = (
    *PUBLISHED_TO_MODULE,
    *PUBLISHED_TO_MODULE.values(),
)


class MllamaWeightError(CheckpointWeightError):
    """A checkpoint tensor the model has no parameter for, or a missing one."""


def parameter_name(checkpoint_name: str) -> str | None:
    """The model parameter a checkpoint tensor loads into (None: dropped).

    The same two mappers ``AutoWeightsLoader`` applies on the way down: the layout
    mapper at the top, the text model's stacking below ``model.language_model.``.
    """
    name = LAYOUT_MAPPER.map_name(checkpoint_name)
    if name is None or not name.startswith(TEXT_PREFIX):
        return name
    rest = TEXT_MAPPER.map_name(name[len(TEXT_PREFIX) :])
    return None if rest is None else TEXT_PREFIX + rest


def checked(
    weights: Iterable[tuple[str, torch.Tensor]],
    parameters: set[str],
    model_path: str,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``weights`` on; raise on the first one that maps to no parameter.

    ``AutoWeightsLoader`` would silently drop an unknown ``*.bias`` (it ignores
    unexpected biases for GPTQ checkpoints) and names only the mapped name of
    anything else; this names the checkpoint tensor, its file and the layouts.
    """
    for name, tensor in weights:
        target = parameter_name(name)
        if target is not None and target not in parameters:
            raise MllamaWeightError(
                f"unexpected Mllama weight {name!r} in {weight_file(model_path, name)}: "
                f"it maps to {target!r}, which the model does not have. The loader "
                f"knows the published prefixes {list(PUBLISHED_TO_MODULE)} and the "
                f"transformers module prefixes {list(PUBLISHED_TO_MODULE.values())}"
            )
        yield name, tensor


def check_complete(loaded: set[str], parameters: set[str], model_path: str) -> None:
    """Raise naming the parameters no checkpoint tensor filled."""
    missing = sorted(parameters - loaded)
    if missing:
        raise MllamaWeightError(
            f"Mllama checkpoint {model_path} lacks {len(missing)} tensor(s) for "
            f"{missing[:5]}"
        )
