"""The plugin's Mllama ``load_weights`` on the tiny checkpoint, without an engine.

A fresh interpreter (vLLM's model-parallel state must not leak into other tests)
builds the plugin's ``MllamaForConditionalGeneration`` from a ``VllmConfig`` on
the CPU, loads ``models/tiny-mllama`` through ``load_weights`` and reports what
it loaded, a few fused parameters against the checkpoint, and the errors for an
unexpected name and for a missing tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.conftest import REPO_ROOT

_CHECK = textwrap.dedent(
    """
    import json, socket, sys
    import torch
    from safetensors.torch import load_file
    # Model inspection normally runs in a subprocess; do it in this one.
    import vllm.model_executor.models.registry as registry
    registry._run_in_subprocess = lambda fn: fn()
    from vllm_hpu_mm.models import register_all
    register_all()
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment, initialize_model_parallel)
    from vllm_hpu_mm.models.mllama.model import MllamaForConditionalGeneration
    from vllm_hpu_mm.models.mllama.vision import feature_order

    model_dir = sys.argv[1]
    mc = ModelConfig(model=model_dir, dtype="float32")
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def build():
        with torch.device("cpu"):
            return MllamaForConditionalGeneration(vllm_config=vc)

    def error(weights):
        # The same model again: a second one would register its layers twice.
        try:
            model.load_weights(weights)
        except ValueError as e:
            return str(e)
        return None

    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        model = build()
        ckpt = load_file(model_dir + "/model.safetensors")
        loaded = model.load_weights(ckpt.items())
        params = dict(model.named_parameters())
        lm = "model.language_model.layers."
        self_attn = lm + "0.self_attn."
        cross = lm + "1.cross_attn."
        pairs = {
            self_attn + "qkv_proj.weight": torch.cat(
                [ckpt[self_attn + p + "_proj.weight"] for p in "qkv"]),
            lm + "0.mlp.gate_up_proj.weight": torch.cat(
                [ckpt[lm + "0.mlp." + p + "_proj.weight"] for p in ("gate", "up")]),
            lm + "1.mlp.gate_up_proj.weight": torch.cat(
                [ckpt[lm + "1.mlp." + p + "_proj.weight"] for p in ("gate", "up")]),
            cross + "k_proj.weight": ckpt[cross + "k_proj.weight"],
            lm + "1.cross_attn_attn_gate": ckpt[lm + "1.cross_attn_attn_gate"],
            "model.vision_model.patch_embedding.weight": ckpt[
                "model.vision_model.patch_embedding.weight"],
            "model.vision_model.global_transformer.layers.1.gate_ffn": ckpt[
                "model.vision_model.global_transformer.layers.1.gate_ffn"],
            # Columns permuted to the layer-major encoder_states on loading.
            "model.multi_modal_projector.weight": ckpt[
                "model.multi_modal_projector.weight"][:, feature_order(
                    model.vision.hidden, len(model.vision.intermediate))],
            "lm_head.weight": ckpt["lm_head.weight"],
            "model.language_model.embed_tokens.weight": ckpt[
                "model.language_model.embed_tokens.weight"],
        }
        res = {
            "loaded": sorted(loaded),
            "params": sorted(params),
            "num_ckpt": len(ckpt),
            "equal": {
                k: bool(torch.equal(params[k][: t.shape[0]], t))
                for k, t in pairs.items()
            },
            "unexpected_vision": error(
                [*ckpt.items(), ("model.vision_model.bogus.weight", torch.zeros(1))]),
            "unexpected_text": error(
                [(lm + "9.self_attn.q_proj.weight", torch.zeros(1))]),
            "missing": error(
                [(k, v) for k, v in ckpt.items() if k != "lm_head.weight"]),
        }
    print("RESULT " + json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def result(tiny_mllama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm"))}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, tiny_mllama_dir],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_every_parameter_is_loaded(result: Any) -> None:
    assert result["loaded"] == result["params"]


def test_fused_and_plain_parameters_hold_the_checkpoint(result: Any) -> None:
    assert result["equal"] and all(result["equal"].values()), result["equal"]


def test_unexpected_name_is_rejected_by_name(result: Any) -> None:
    assert result["unexpected_vision"] == (
        "unexpected Mllama weight 'model.vision_model.bogus.weight'"
    )
    # A text name is reported as written in the checkpoint, not as fused.
    name = "model.language_model.layers.9.self_attn.q_proj.weight"
    assert result["unexpected_text"] == f"unexpected Mllama weight {name!r}"


def test_missing_tensor_is_named(result: Any) -> None:
    msg = result["missing"]
    assert msg is not None and "lacks" in msg and "lm_head.weight" in msg
