"""The tiny LLaVA builder, and vLLM's llava code on this machine without torchvision.

HF transformers runs the model offline on Pillow-made images; a subprocess (so that
the ``sys.modules`` alias does not leak into other tests) imports vLLM's llava.py
after ``use_pil_pixtral_image_processor()``, builds vLLM's LLaVA from the checkpoint
and loads the weights through vLLM's own ``load_weights``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import MODELS_DIR, REPO_ROOT
from vllm_hpu_mm.models.compat import PIL_PIXTRAL_MODULE
from vllm_hpu_mm.tools import build_tiny_llava as builder


@pytest.fixture(scope="module")
def tiny_llava_dir() -> Path:
    """``models/tiny-llava``, built on first use."""
    return builder.build_tiny_llava(MODELS_DIR)


def _image(kind: str, size: tuple[int, int] = (48, 40)):
    """A deterministic RGB test image: a gradient or a checkerboard."""
    import numpy as np
    from PIL import Image

    w, h = size
    if kind == "gradient":
        x = np.linspace(0, 255, w, dtype=np.float32)[None, :]
        y = np.linspace(0, 255, h, dtype=np.float32)[:, None]
        rgb = np.stack([x + 0 * y, y + 0 * x, 255 - (x + y) / 2], axis=-1)
    else:
        cells = (np.indices((h, w)) // 8).sum(axis=0) % 2
        rgb = np.stack([cells * 255, cells * 40, 255 - cells * 255], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), mode="RGB")


def test_build_is_idempotent(tiny_llava_dir: Path) -> None:
    weights = tiny_llava_dir / builder.WEIGHTS_FILE
    before = weights.stat().st_mtime_ns
    assert builder.build_tiny_llava(MODELS_DIR) == tiny_llava_dir
    assert weights.stat().st_mtime_ns == before
    stamp = json.loads((tiny_llava_dir / "tiny_model_build.json").read_text())
    assert stamp["llava_build_version"] == builder.LLAVA_BUILD_VERSION


def test_checkpoint_uses_llava_hf_names_and_reloads(tiny_llava_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_llava_dir / builder.WEIGHTS_FILE))
    prefixes = {
        p for p in builder.CHECKPOINT_PREFIXES if any(n.startswith(p) for n in tensors)
    }
    assert prefixes == set(builder.CHECKPOINT_PREFIXES)
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in tensors
    # Deterministic: a fresh in-memory build has exactly the saved tensors.
    fresh = builder.checkpoint_state_dict(builder.build_model()[2])
    assert set(fresh) == set(tensors)
    assert all(torch.equal(fresh[n], tensors[n]) for n in tensors)
    # Reloading with transformers gives the very same tensors, nothing missing.
    builder.verify_checkpoint(tiny_llava_dir, tensors)


def test_hf_generate_with_image(tiny_llava_dir: Path) -> None:
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    model = LlavaForConditionalGeneration.from_pretrained(
        tiny_llava_dir, dtype=torch.float32
    ).eval()
    config = model.config
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.count(builder.IMAGE_TOKEN) == 1

    outputs = []
    for kind in ("gradient", "checkerboard"):
        inputs = processor(text=prompt, images=_image(kind), return_tensors="pt")
        assert inputs["pixel_values"].shape == (1, 3, 32, 32)
        n_image = int((inputs["input_ids"] == config.image_token_index).sum())
        assert n_image == builder.NUM_IMAGE_TOKENS == 16
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert new, "nothing generated"
        outputs.append(new)
    assert outputs[0] != outputs[1], "different images should change greedy output"


_VLLM_CHECK = textwrap.dedent(
    """
    import json, socket, sys
    from vllm_hpu_mm.models import compat
    compat.use_pil_pixtral_image_processor()
    compat.use_pil_pixtral_image_processor()  # idempotent
    aliased = sys.modules[compat.TORCHVISION_PIXTRAL_MODULE]
    import vllm.model_executor.models.llava as llava
    import importlib.util, torch
    from safetensors.torch import load_file
    # The model-info inspection normally runs in a fresh subprocess that only
    # loads the plugins; the plugin is not wired yet, so inspect in-process.
    import vllm.model_executor.models.registry as registry
    registry._run_in_subprocess = lambda fn: fn()
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment, initialize_model_parallel)
    from vllm.multimodal import MULTIMODAL_REGISTRY

    model_dir = sys.argv[1]
    res = {
        "torchvision": importlib.util.find_spec("torchvision") is not None,
        "aliased_to": aliased.__name__,
        "llava_imported": True,
    }
    names = sorted(load_file(model_dir + "/model.safetensors"))
    mapper = llava.LlavaForConditionalGeneration.hf_to_vllm_mapper
    res["renamed"] = [n for n in names if mapper._map_name(n) != n]

    mc = ModelConfig(model=model_dir, dtype="float32")
    proc = MULTIMODAL_REGISTRY.create_processor(mc)
    res["num_image_tokens"] = proc.info.get_num_image_tokens(
        image_width=48, image_height=40)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        with torch.device("cpu"):
            model = llava.LlavaForConditionalGeneration(vllm_config=vc)
        ckpt = load_file(model_dir + "/model.safetensors")
        loaded = model.load_weights(ckpt.items())
    params = dict(model.named_parameters())
    res["not_loaded"] = sorted(set(params) - loaded)
    stacked = {".q_proj.": ".qkv_proj.", ".k_proj.": ".qkv_proj.",
               ".v_proj.": ".qkv_proj.", ".gate_proj.": ".gate_up_proj.",
               ".up_proj.": ".gate_up_proj."}
    def vllm_name(n):
        for a, b in stacked.items():
            n = n.replace(a, b)
        return n
    res["unused_ckpt"] = sorted(n for n in ckpt if vllm_name(n) not in loaded)
    v = "vision_tower.vision_model."
    att = v + "encoder.layers.0.self_attn."
    lm = "language_model.model.layers.0.self_attn."
    pairs = {
        "language_model.model.embed_tokens.weight": ckpt[
            "language_model.model.embed_tokens.weight"],
        "language_model.lm_head.weight": ckpt["language_model.lm_head.weight"],
        "multi_modal_projector.linear_1.weight": ckpt[
            "multi_modal_projector.linear_1.weight"],
        v + "embeddings.patch_embedding.weight": ckpt[
            v + "embeddings.patch_embedding.weight"],
        att + "qkv_proj.weight": torch.cat(
            [ckpt[att + p + "_proj.weight"] for p in "qkv"]),
        lm + "qkv_proj.weight": torch.cat(
            [ckpt[lm + p + "_proj.weight"] for p in "qkv"]),
    }
    # Vocabulary-parallel layers pad the vocabulary (641 -> a multiple of 64).
    res["equal"] = {
        k: bool(torch.equal(params[k][: t.shape[0]], t)) for k, t in pairs.items()
    }
    print("RESULT " + json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def vllm_check(tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run ``_VLLM_CHECK`` in a fresh interpreter; return its result dict."""
    # A private cache root: the in-process model inspection must not leave a
    # cached model info behind that would hide a missing alias in later runs.
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm"))}
    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_CHECK, str(tiny_llava_dir)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_vllm_llava_imports_with_pil_pixtral(vllm_check: dict) -> None:
    assert vllm_check["llava_imported"]
    if not vllm_check["torchvision"]:
        assert vllm_check["aliased_to"] == PIL_PIXTRAL_MODULE


def test_vllm_loads_every_weight(vllm_check: dict) -> None:
    # Already in the layout vLLM loads: its mapper renames nothing.
    assert vllm_check["renamed"] == []
    assert vllm_check["not_loaded"] == []
    # vLLM builds the tower only up to vision_feature_layer=-2 and drops the
    # post-layernorm; everything else in the checkpoint is consumed.
    for name in vllm_check["unused_ckpt"]:
        assert name.startswith(
            (
                "vision_tower.vision_model.encoder.layers.1.",
                "vision_tower.vision_model.post_layernorm.",
            )
        ), name
    assert all(vllm_check["equal"].values()), vllm_check["equal"]
    assert vllm_check["num_image_tokens"] == builder.NUM_IMAGE_TOKENS
