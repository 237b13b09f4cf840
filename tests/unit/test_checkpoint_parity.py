"""Every tiny checkpoint, in every layout users bring, holds the same tensors in
vLLM (through the plugin) as in HF transformers.

Layouts: what ``save_pretrained`` writes (every builder's directory), the
released llava-hf layout (``tiny-llava-released``), and transformers' module
names as a saved ``state_dict()`` writes them (Mllama, LLaVA). One fresh
interpreter runs ``tests.checkpoint_probe`` over all of them: vLLM's own
``get_model`` on the CPU against ``from_pretrained``, parameter by parameter
(see that module for the name mapping and the fused projections).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MODELS_DIR
from tests.fresh_interpreter import run_for_result
from tools.build_tiny_models import build_tiny_models, model_specs

# The mixture-of-experts checkpoint holds its experts fused (vLLM's w13/w2,
# transposed against what transformers saves): its load is checked by HF greedy
# parity (tests/e2e/test_qwen3_vl_moe.py) and the layout function
# (tests/unit/test_moe_kernel.py), and the probe's one model-parallel set-up
# has no expert-parallel group for it.
BUILT = [name for name in model_specs() if "moe" not in name]
MODULE_NAME_LAYOUT = ["tiny-mllama", "tiny-llava", "tiny-gemma3"]


def save_with_module_names(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with its weights re-saved as transformers' ``state_dict()``."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


EXTRA_TENSOR = {
    "tiny-mllama": "vision_model.transformer.layers.0.bogus.weight",
    "tiny-llava": "vision_tower.encoder.layers.0.bogus.weight",
    "tiny-gemma3": "vision_tower.encoder.layers.0.bogus.weight",
}


def save_with_extra_tensor(model_dir: Path, out: Path, name: str) -> Path:
    """``model_dir`` with one more tensor, ``name``, that no model parameter takes."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    tensors = load_file(str(out / "model.safetensors")) | {name: torch.zeros(2)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Layout label -> model directory."""
    built = build_tiny_models(MODELS_DIR)
    out = {name: str(path) for name, path in built.items() if name in BUILT}
    tmp = tmp_path_factory.mktemp("module_names")
    for name in MODULE_NAME_LAYOUT:
        out[f"{name} (module names)"] = str(
            save_with_module_names(built[name], tmp / name)
        )
    for name, extra in EXTRA_TENSOR.items():
        out[f"{name} (extra tensor)"] = str(
            save_with_extra_tensor(built[name], tmp / f"{name}-extra", extra)
        )
    return out


@pytest.fixture(scope="module")
def probe(dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Any:
    args = [*dirs.values(), f"--in-tree-llava={dirs['tiny-llava']}"]
    result = run_for_result(
        ["-m", "tests.checkpoint_probe", *args],
        tmp_path_factory.mktemp("vllm"),
        timeout=600,
    )
    return {label: result[d] for label, d in dirs.items()} | {
        "in_tree_llava": result["in_tree_llava"]
    }


def test_module_name_layouts_differ_from_save_pretrained(dirs: dict[str, str]) -> None:
    from tools.build_tiny_models import checkpoint_names

    for name in MODULE_NAME_LAYOUT:
        saved = checkpoint_names(dirs[name])
        modules = checkpoint_names(dirs[f"{name} (module names)"])
        assert len(saved) == len(modules) and not set(saved) & set(modules)


@pytest.mark.parametrize(
    "label", [*BUILT, *(f"{n} (module names)" for n in MODULE_NAME_LAYOUT)]
)
def test_vllm_holds_the_tensors_hf_holds(probe: Any, label: str) -> None:
    res = probe[label]
    assert "error" not in res, res.get("error")
    assert res["num_params"] > 0
    assert res["unmatched_vllm"] == [], "vLLM parameters with no HF tensor"
    assert res["differ"] == [], "vLLM parameters that differ from HF's"
    assert res["unused_hf"] == [], "HF tensors vLLM did not take"
    assert res["documented_drops_seen"]


def test_llava_and_mllama_run_the_plugins_classes(probe: Any) -> None:
    assert probe["tiny-llava"]["vllm_class"] == (
        "vllm_hpu_mm.models.llava.LlavaForConditionalGeneration"
    )
    assert probe["tiny-mllama"]["vllm_class"].startswith("vllm_hpu_mm.models.mllama")
    assert probe["tiny-idefics3"]["vllm_class"].startswith("vllm.model_executor")
    # Without torchvision: vLLM's Qwen2.5-VL with the images-only processor.
    assert probe["tiny-qwen2_5-vl"]["vllm_class"] == (
        "vllm_hpu_mm.models.qwen_vl.Qwen2_5_VLForConditionalGeneration"
    )
    assert probe["tiny-qwen3-vl"]["vllm_class"] == (
        "vllm_hpu_mm.models.qwen_vl.Qwen3VLForConditionalGeneration"
    )
    for name in ("tiny-gemma3", "tiny-gemma3-released"):
        assert probe[name]["vllm_class"] == (
            "vllm_hpu_mm.models.gemma3.Gemma3ForConditionalGeneration"
        )


def test_in_tree_llava_rejects_save_pretrained_layout(probe: Any) -> None:
    """Why the plugin's LLaVA subclass exists; when this fails, it can go."""
    error = probe["in_tree_llava"]
    assert error is not None and "'vision_tower.embeddings'" in error


@pytest.mark.parametrize("name", list(EXTRA_TENSOR))
def test_a_tensor_no_parameter_takes_is_named_with_its_file(
    probe: Any, dirs: dict[str, str], name: str
) -> None:
    error = probe[f"{name} (extra tensor)"].get("error")
    assert error is not None, "the extra tensor was accepted"
    assert repr(EXTRA_TENSOR[name]) in error
    assert str(Path(dirs[f"{name} (extra tensor)"]) / "model.safetensors") in error
    assert "'vision_tower.vision_model.'" in error or "'vision_model.'" in error
