"""The tiny LLaVA, and vLLM's llava code on this machine without torchvision.

HF transformers runs the model offline on Pillow-made images; a subprocess (so that
the ``sys.modules`` alias does not leak into other tests) imports vLLM's llava.py
after ``use_pil_pixtral_image_processor()`` and builds vLLM's LLaVA processor from
the checkpoint. (Its weights against HF's: ``test_checkpoint_parity``.)
"""

from __future__ import annotations

import textwrap

import pytest

from tests.fresh_interpreter import run_for_result
from tools import tiny_model_specs as specs
from vllm_hpu_mm.models.compat import PIL_PIXTRAL_MODULE


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


def test_hf_generate_with_image(tiny_llava_dir: str) -> None:
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
    assert prompt.count(specs.LLAVA_IMAGE_TOKEN) == 1

    outputs = []
    for kind in ("gradient", "checkerboard"):
        inputs = processor(text=prompt, images=_image(kind), return_tensors="pt")
        assert inputs["pixel_values"].shape == (1, 3, 32, 32)
        n_image = int((inputs["input_ids"] == config.image_token_index).sum())
        assert n_image == specs.LLAVA_NUM_IMAGE_TOKENS == 16
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
    import importlib.util
    # The model-info inspection normally runs in a fresh subprocess that only
    # loads the plugins; the plugin is not wired yet, so inspect in-process.
    import vllm.model_executor.models.registry as registry
    registry._run_in_subprocess = lambda fn: fn()
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    model_dir = sys.argv[1]
    res = {
        "torchvision": importlib.util.find_spec("torchvision") is not None,
        "aliased_to": aliased.__name__,
        "llava_imported": True,
    }
    mc = ModelConfig(model=model_dir, dtype="float32")
    proc = MULTIMODAL_REGISTRY.create_processor(mc)
    res["num_image_tokens"] = proc.info.get_num_image_tokens(
        image_width=48, image_height=40)
    print("RESULT " + json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def vllm_check(tiny_llava_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run ``_VLLM_CHECK`` in a fresh interpreter; return its result dict."""
    return run_for_result(
        ["-c", _VLLM_CHECK, tiny_llava_dir], tmp_path_factory.mktemp("vllm")
    )


def test_vllm_llava_imports_with_pil_pixtral(vllm_check: dict) -> None:
    assert vllm_check["llava_imported"]
    if not vllm_check["torchvision"]:
        assert vllm_check["aliased_to"] == PIL_PIXTRAL_MODULE


def test_vllm_counts_the_image_tokens(vllm_check: dict) -> None:
    assert vllm_check["num_image_tokens"] == specs.LLAVA_NUM_IMAGE_TOKENS
