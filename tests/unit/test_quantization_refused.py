"""Quantized checkpoints are refused while vLLM builds the config (in the
process that parses the arguments, before any weight loads), with a message
that names the method and what the plugin runs.

The checkpoints are the tiny Llama with a ``quantization_config`` as AutoAWQ,
AutoGPTQ and FBGEMM's FP8 exporter write it into ``config.json``; vLLM's own config
code (``ModelConfig._verify_quantization``) resolves the method and calls the
platform's ``verify_quantization``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_hpu_mm.platform import CpuMMPlatform, HpuMMPlatform

QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "awq": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    },
    "gptq": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "sym": True,
    },
    "fbgemm_fp8": {  # FP8 too, but not a format the plugin runs
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": [],
    },
}


def _quantized_copy(src: str, dst: Path, quant: dict[str, Any]) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("method", sorted(QUANT_CONFIGS))
def test_quantized_checkpoint_is_refused_at_config_time(
    method: str, tiny_llama_dir: str, tmp_path: Path
) -> None:
    model = _quantized_copy(tiny_llama_dir, tmp_path / method, QUANT_CONFIGS[method])
    with pytest.raises(Exception, match="vllm-hpu-mm does not run") as info:
        EngineArgs(model=model).create_engine_config()
    message = str(info.value)
    assert method in message  # 'awq' is resolved to 'auto_awq' and so on
    assert "Quantization methods it runs: fp8, compressed-tensors" in message


def test_unquantized_checkpoint_still_builds(tiny_llama_dir: str) -> None:
    config = EngineArgs(model=tiny_llama_dir).create_engine_config()
    assert config.model_config.quantization is None


def test_an_fp8_checkpoint_builds(tiny_llama_dir: str, tmp_path: Path) -> None:
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    model = _quantized_copy(tiny_llama_dir, tmp_path / "fp8", fp8)
    config = EngineArgs(model=model, dtype="float32").create_engine_config()
    assert config.model_config.quantization == "fp8"


@pytest.mark.parametrize("platform", [CpuMMPlatform, HpuMMPlatform])
def test_every_platform_refuses_an_unlisted_method(platform: Any) -> None:
    with pytest.raises(ValueError, match="'gptq_marlin'"):
        platform.verify_quantization("gptq_marlin")
