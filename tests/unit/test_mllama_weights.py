"""The plugin's Mllama ``load_weights``: what it says about a checkpoint it cannot load.

A fresh interpreter (vLLM's model-parallel state must not leak into other tests)
loads ``models/tiny-mllama`` (the published layout) with vLLM's ``get_model`` on
the CPU, then feeds the same model's ``load_weights`` broken checkpoints: a
tensor that matches no parameter (vision, text, and a ``.bias``, which vLLM's
``AutoWeightsLoader`` alone would drop silently) and one with a tensor missing.
Both layouts loading with the same tensors as HF: ``test_checkpoint_parity``.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest

from tests.fresh_interpreter import run_for_result

_CHECK = textwrap.dedent(
    """
    import json, sys
    import torch
    from safetensors.torch import load_file
    import vllm.model_executor.models.registry as registry
    registry._run_in_subprocess = lambda fn: fn()
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm_hpu_mm import register_models
    from tests.checkpoint_probe import _init_distributed, _vllm_config

    model_dir = sys.argv[1]
    register_models()
    _init_distributed(model_dir)
    vc = _vllm_config(model_dir)
    ckpt = load_file(model_dir + "/model.safetensors")

    def error(weights):
        try:
            model.load_weights(weights)
        except ValueError as e:
            return str(e)
        return None

    with set_current_vllm_config(vc):
        model = get_model(vllm_config=vc)
        lm = "language_model.model.layers."
        res = {
            "ok": error(list(ckpt.items())),
            "unexpected_vision": error(
                [*ckpt.items(), ("vision_model.bogus.weight", torch.zeros(1))]),
            "unexpected_text": error(
                [(lm + "9.self_attn.q_proj.weight", torch.zeros(1))]),
            "unexpected_bias": error(
                [(lm + "0.self_attn.q_proj.bias", torch.zeros(1))]),
            "missing": error(
                [(k, v) for k, v in ckpt.items()
                 if k != "language_model.lm_head.weight"]),
        }
    print("RESULT " + json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def result(tiny_mllama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    res = run_for_result(
        ["-c", _CHECK, tiny_mllama_dir], tmp_path_factory.mktemp("vllm")
    )
    return {"dir": tiny_mllama_dir} | res


def test_the_published_layout_loads(result: Any) -> None:
    assert result["ok"] is None


@pytest.mark.parametrize(
    ("case", "name", "maps_to"),
    [
        ("unexpected_vision", "vision_model.bogus.weight",
         "model.vision_model.bogus.weight"),
        ("unexpected_text", "language_model.model.layers.9.self_attn.q_proj.weight",
         "model.language_model.layers.9.self_attn.qkv_proj.weight"),
        ("unexpected_bias", "language_model.model.layers.0.self_attn.q_proj.bias",
         "model.language_model.layers.0.self_attn.qkv_proj.bias"),
    ],
)  # fmt: skip
def test_unexpected_weight_names_file_parameter_and_prefixes(
    result: Any, case: str, name: str, maps_to: str
) -> None:
    msg = result[case]
    assert msg is not None, f"{name} was accepted"
    # The checkpoint's own name, and the file that holds it (the real tensors
    # are in model.safetensors; an injected one is in no file).
    assert msg.startswith(f"unexpected Mllama weight {name!r} in "), msg
    assert result["dir"] in msg
    assert f"it maps to {maps_to!r}" in msg
    for prefix in ("language_model.model.", "vision_model.", "model.language_model."):
        assert repr(prefix) in msg


def test_missing_tensor_is_named(result: Any) -> None:
    msg = result["missing"]
    assert msg is not None and "lacks 1 tensor(s)" in msg and "'lm_head.weight'" in msg


def test_weight_file_finds_the_shard(tmp_path: Any) -> None:
    import torch
    from safetensors.torch import save_file

    from vllm_hpu_mm.models.checkpoint_files import weight_file

    save_file({"a.weight": torch.zeros(1)}, str(tmp_path / "one.safetensors"))
    save_file({"b.weight": torch.zeros(1)}, str(tmp_path / "two.safetensors"))
    assert weight_file(str(tmp_path), "b.weight") == str(tmp_path / "two.safetensors")
    index = {"weight_map": {"a.weight": "one.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_file(str(tmp_path), "a.weight") == str(tmp_path / "one.safetensors")
    assert weight_file(str(tmp_path), "c.weight") == f"a checkpoint file of {tmp_path}"
