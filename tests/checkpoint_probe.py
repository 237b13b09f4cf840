"""Load checkpoints with vLLM (through the plugin) and with transformers; compare.

Run as ``python -m tests.checkpoint_probe DIR [DIR ...]`` in a fresh interpreter
(vLLM's model-parallel state must not leak into other tests). For every model
directory it builds the model class vLLM's registry picks for the checkpoint
(the plugin's registrations included) and loads it with vLLM's own
``get_model`` on the CPU (the default loader: safetensors iterator, the model's
``load_weights``, the loader's own check that every weight was initialised),
loads the same directory with transformers, and matches every vLLM parameter
with transformers' tensors under the documented name mapping (``HF_TO_VLLM``),
fused ``qkv_proj`` / ``gate_up_proj`` being the concatenation of their parts.
Prints one ``RESULT {json}`` line: per directory, what did not match.
"""

from __future__ import annotations

import json
import re
import socket
import sys
from typing import Any

import torch

# transformers 5 module-name prefix -> vLLM parameter-name prefix, per
# architecture. Empty: vLLM's modules carry transformers' names.
HF_TO_VLLM: dict[str, tuple[tuple[str, str], ...]] = {
    "LlamaForCausalLM": (),
    "MistralForCausalLM": (),
    "Idefics3ForConditionalGeneration": (),
    "MllamaForConditionalGeneration": (),
    "LlavaForConditionalGeneration": (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
    "Qwen2_5_VLForConditionalGeneration": (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.visual.", "visual."),
    ),
    "Qwen3VLForConditionalGeneration": (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.visual.", "visual."),
    ),
    # Same layout (the plugin's subclass of vLLM's Gemma 3 loads it).
    "Gemma3ForConditionalGeneration": (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
}
# transformers tensors vLLM builds no parameter for: the tiny LLaVA's tower runs
# up to vision_feature_layer=-2, so its last layer and post-layernorm never run.
NOT_IN_VLLM: dict[str, tuple[str, ...]] = {
    "LlavaForConditionalGeneration": (
        r"^vision_tower\.vision_model\.encoder\.layers\.1\.",
        r"^vision_tower\.vision_model\.post_layernorm\.",
    ),
}
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _vllm_name(hf_name: str, arch: str) -> str:
    for old, new in HF_TO_VLLM[arch]:
        if hf_name.startswith(old):
            return new + hf_name[len(old) :]
    return hf_name


def _expected(name: str, hf: dict[str, torch.Tensor]) -> list[str] | None:
    """The transformers names (already mapped) a vLLM parameter holds."""
    if name in hf:
        return [name]
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            names = [name.replace(f".{fused}.", f".{p}.") for p in parts]
            if all(n in hf for n in names):
                return names
    return None


def _column_order(name: str, hf_model: Any) -> torch.Tensor | None:
    """Columns a vLLM parameter holds in another order than transformers', by
    design: Mllama's projector reads ``encoder_states`` layer-major
    (``vllm_hpu_mm.models.mllama.vision.feature_order``), HF's features are
    interleaved; derived here from HF's own config."""
    if not name.endswith("multi_modal_projector.weight"):
        return None
    from vllm_hpu_mm.models.mllama.vision import feature_order

    vision = hf_model.config.vision_config
    return feature_order(vision.hidden_size, len(vision.intermediate_layers_indices))


def compare(vllm_model: Any, hf_model: Any, arch: str) -> dict[str, Any]:
    """What does not match between the two models' tensors."""
    hf = {_vllm_name(n, arch): t for n, t in hf_model.state_dict().items()}
    used: set[str] = set()
    unmatched, differ = [], []
    params = dict(vllm_model.named_parameters())
    for name, param in params.items():
        parts = _expected(name, hf)
        if parts is None:
            unmatched.append(name)
            continue
        used.update(parts)
        want = torch.cat([hf[p] for p in parts])
        columns = _column_order(name, hf_model)
        if columns is not None:
            want = want[:, columns]
        # Vocabulary-parallel layers pad the vocabulary to a multiple of 64.
        got = param.detach()[: want.shape[0]]
        if got.shape != want.shape or not torch.equal(got, want):
            differ.append(name)
    dropped = NOT_IN_VLLM.get(arch, ())
    unused = sorted(
        n for n in set(hf) - used if not any(re.match(p, n) for p in dropped)
    )
    drops_seen = [p for p in dropped if any(re.match(p, n) for n in set(hf) - used)]
    return {
        "vllm_class": type(vllm_model).__module__ + "." + type(vllm_model).__name__,
        "num_params": len(params),
        "unmatched_vllm": unmatched,
        "differ": differ,
        "unused_hf": unused,
        "documented_drops_seen": len(drops_seen) == len(dropped),
    }


def _vllm_config(model_dir: str) -> Any:
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(model=model_dir, dtype="float32")
    return VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))


def _init_distributed(model_dir: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(_vllm_config(model_dir)):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
        initialize_model_parallel(1, 1)


def probe(model_dir: str) -> dict[str, Any]:
    """Load ``model_dir`` with vLLM and transformers; ``compare``, or the error."""
    import transformers
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    vllm_config = _vllm_config(model_dir)
    arch = vllm_config.model_config.architectures[0]
    hf_model = getattr(transformers, arch).from_pretrained(
        model_dir, dtype=torch.float32
    )
    with set_current_vllm_config(vllm_config):
        try:
            vllm_model = get_model(vllm_config=vllm_config)
        except ValueError as e:
            return {"error": str(e)}
    return compare(vllm_model, hf_model, arch)


def in_tree_llava_error(model_dir: str) -> str | None:
    """vLLM's own LLaVA class (not the plugin's) loading ``model_dir``."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models import llava

    vllm_config = _vllm_config(model_dir)
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        model = llava.LlavaForConditionalGeneration(vllm_config=vllm_config)
        weights = load_file(f"{model_dir}/model.safetensors")
        try:
            model.load_weights(weights.items())
        except ValueError as e:
            return str(e)
    return None


def main(argv: list[str]) -> int:
    # Model inspection normally runs in a subprocess; do it in this one.
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()  # type: ignore[assignment]
    from vllm_hpu_mm import register_models

    register_models()  # the plugin's models and patches, as in every vLLM process
    dirs = [d for d in argv if not d.startswith("--")]
    _init_distributed(dirs[0])
    result: dict[str, Any] = {d: probe(d) for d in dirs}
    for arg in argv:
        if arg.startswith("--in-tree-llava="):
            result["in_tree_llava"] = in_tree_llava_error(arg.split("=", 1)[1])
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
