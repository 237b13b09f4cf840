"""The platform's start-up config steps and per-request checks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm import PoolingParams, SamplingParams
from vllm.config import CompilationMode, CUDAGraphMode

from vllm_hpu_mm.platform import CpuMMPlatform, HpuMMPlatform
from vllm_hpu_mm.platform_config import (
    DEFAULT_BLOCK_SIZE,
    WORKER_CLS,
    UnsupportedConfigError,
    _keep_images_whole,
    _reject_unsupported,
    _set_block_size,
    _set_scheduling,
    update_vllm_config,
    validate_sampling_params,
)

# ---- a stand-in VllmConfig -----------------------------------------------------


def make_config(**overrides: Any) -> SimpleNamespace:
    """Exactly the attributes update_vllm_config reads (a missing one would be an
    AttributeError, so the test also pins down what the code looks at)."""
    cfg = SimpleNamespace(
        additional_config={},
        speculative_config=None,
        lora_config=None,
        kv_transfer_config=None,
        model_config=SimpleNamespace(runner_type="generate"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, worker_cls="auto"),
        cache_config=SimpleNamespace(
            block_size=None, user_specified_block_size=False, cache_dtype="auto"
        ),
        scheduler_config=SimpleNamespace(
            async_scheduling=True,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            enable_chunked_prefill=True,
        ),
        compilation_config=SimpleNamespace(
            mode=CompilationMode.VLLM_COMPILE,
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
            cudagraph_capture_sizes=[1, 2, 4],
            max_cudagraph_capture_size=4,
            custom_ops=["none"],
            # What vLLM derives for its own compile mode with inductor.
            ir_enable_torch_wrap=True,
        ),
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(autouse=True)
def _keep_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HPU steps set VLLM_WORKER_MULTIPROC_METHOD: undo it after each test."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "x")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")


# ---- update_vllm_config ---------------------------------------------------------


@pytest.mark.parametrize(("device_type", "block"), [("hpu", 128), ("cpu", 16)])
def test_update_sets_defaults(device_type: str, block: int) -> None:
    cfg = make_config()
    update_vllm_config(cfg, device_type)  # type: ignore[arg-type]
    assert cfg.cache_config.block_size == block
    assert cfg.scheduler_config.async_scheduling is True  # vLLM's choice stands
    assert cfg.parallel_config.worker_cls == WORKER_CLS
    cc = cfg.compilation_config
    assert cc.mode == CompilationMode.NONE
    assert cc.cudagraph_mode == CUDAGraphMode.NONE
    assert cc.cudagraph_capture_sizes == []
    assert cc.max_cudagraph_capture_size == 0
    # IR ops call their implementation, so graphs trace (and fuse) it.
    assert cc.ir_enable_torch_wrap is False
    fused = [
        "+RMSNorm",
        "+GemmaRMSNorm",
        "+RotaryEmbedding",
        "+Llama3RotaryEmbedding",
        "+LinearScalingRotaryEmbedding",
        "+DynamicNTKScalingRotaryEmbedding",
        "+DynamicNTKAlphaRotaryEmbedding",
        "+NTKScalingRotaryEmbedding",
        "+YaRNScalingRotaryEmbedding",
        "+MRotaryEmbedding",
    ]
    expected_ops = ["none", *fused] if device_type == "hpu" else ["none"]
    assert cc.custom_ops == expected_ops


def test_default_block_sizes() -> None:
    assert DEFAULT_BLOCK_SIZE == {"hpu": 128, "cuda": 16, "cpu": 16}


def test_update_replaces_foreign_worker() -> None:
    cfg = make_config()
    cfg.parallel_config.worker_cls = "some.other.Worker"
    update_vllm_config(cfg, "cpu")  # type: ignore[arg-type]
    assert cfg.parallel_config.worker_cls == WORKER_CLS


def test_platform_check_and_update_config_uses_its_device() -> None:
    hpu_cfg, cpu_cfg = make_config(), make_config()
    HpuMMPlatform.check_and_update_config(hpu_cfg)  # type: ignore[arg-type]
    CpuMMPlatform.check_and_update_config(cpu_cfg)  # type: ignore[arg-type]
    assert hpu_cfg.cache_config.block_size == 128
    assert cpu_cfg.cache_config.block_size == 16


def test_the_block_size_outlives_vllms_backend_update() -> None:
    """vLLM 0.33 resets a block size the user did not give to the attention
    backend's preferred one after the worker's runner has read it; the KV
    spec and the runner's metadata then disagree (128 vs 16 on Gaudi)."""
    cfg = make_config()
    HpuMMPlatform.check_and_update_config(cfg)  # type: ignore[arg-type]
    HpuMMPlatform.update_block_size_for_backend(cfg)  # type: ignore[arg-type]
    assert cfg.cache_config.block_size == 128


@pytest.mark.parametrize("device_type", ["hpu", "cpu"])
def test_user_specified_block_size_is_kept(device_type: str) -> None:
    cfg = make_config()
    cfg.cache_config.block_size = 32
    cfg.cache_config.user_specified_block_size = True
    _set_block_size(cfg, device_type)  # type: ignore[arg-type]
    assert cfg.cache_config.block_size == 32


@pytest.mark.parametrize(("device_type", "block"), [("hpu", 128), ("cpu", 16)])
def test_unspecified_block_size_is_replaced(device_type: str, block: int) -> None:
    # vLLM may have filled in its own default (e.g. 16) without the user asking.
    cfg = make_config()
    cfg.cache_config.block_size = 64
    _set_block_size(cfg, device_type)  # type: ignore[arg-type]
    assert cfg.cache_config.block_size == block


def test_user_specified_but_none_gets_default() -> None:
    cfg = make_config()
    cfg.cache_config.user_specified_block_size = True
    _set_block_size(cfg, "hpu")  # type: ignore[arg-type]
    assert cfg.cache_config.block_size == 128


@pytest.mark.parametrize("chosen", [True, False])
def test_scheduling_keeps_vllms_choice(
    chosen: bool, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config()
    cfg.scheduler_config.async_scheduling = chosen
    with caplog.at_level("INFO", logger="vllm.hpu_mm"):
        _set_scheduling(cfg)  # type: ignore[arg-type]
    assert cfg.scheduler_config.async_scheduling is chosen
    assert ("async scheduling" if chosen else "synchronous scheduling") in caplog.text


# ---- rejected features ----------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"speculative_config": SimpleNamespace()}, "speculative decoding"),
        (
            {"lora_config": SimpleNamespace(enable_tower_connector_lora=True)},
            "LoRA on the vision tower and connector (--enable-tower-connector-lora)",
        ),
        ({"model_config": SimpleNamespace(runner_type="pooling")}, "'pooling'"),
        (
            {
                "model_config": SimpleNamespace(
                    runner_type="generate",
                    is_mm_prefix_lm=True,
                    hf_config=SimpleNamespace(
                        architectures=["PaliGemmaForConditionalGeneration"]
                    ),
                )
            },
            "prefix-LM multimodal model ['PaliGemmaForConditionalGeneration']",
        ),
        ({"kv_transfer_config": SimpleNamespace()}, "KV transfer"),
        (
            {
                "cache_config": SimpleNamespace(
                    block_size=None,
                    user_specified_block_size=False,
                    cache_dtype="fp8_e5m2",
                )
            },
            "--kv-cache-dtype 'fp8_e5m2'",
        ),
    ],
)
def test_reject_unsupported(overrides: dict[str, Any], named: str) -> None:
    cfg = make_config(**overrides)
    with pytest.raises(UnsupportedConfigError) as info:
        _reject_unsupported(cfg)  # type: ignore[arg-type]
    assert named in str(info.value)
    assert str(info.value).startswith("vllm-hpu-mm does not support: ")
    # Through the full update too, before anything is changed.
    with pytest.raises(UnsupportedConfigError, match="does not support"):
        update_vllm_config(cfg, "cpu")  # type: ignore[arg-type]
    assert cfg.parallel_config.worker_cls == "auto"
    assert cfg.cache_config.block_size is None
    assert cfg.scheduler_config.async_scheduling is True


def gemma3_config(*, multimodal: bool = True) -> SimpleNamespace:
    cfg = make_config(
        model_config=SimpleNamespace(
            runner_type="generate",
            is_mm_prefix_lm=True,
            hf_config=SimpleNamespace(architectures=["Gemma3ForConditionalGeneration"]),
        )
    )
    cfg.scheduler_config.is_multimodal_model = multimodal
    cfg.scheduler_config.disable_chunked_mm_input = False
    cfg.scheduler_config.encoder_cache_size = 512
    return cfg


def test_gemma3_is_served_with_images_scheduled_whole() -> None:
    """Gemma 3's bidirectional image attention is implemented: not refused, and
    chunked prefill never cuts an image (as vLLM's CUDA platform sets it)."""
    cfg = gemma3_config()
    _reject_unsupported(cfg)  # type: ignore[arg-type]
    _keep_images_whole(cfg)  # type: ignore[arg-type]
    assert cfg.scheduler_config.disable_chunked_mm_input is True
    # Two consecutive images fit the encoder cache (they share a token).
    assert cfg.scheduler_config.encoder_cache_size == 2 * 512
    # A causal model keeps vLLM's setting.
    plain = make_config()
    plain.scheduler_config.disable_chunked_mm_input = False
    _keep_images_whole(plain)  # type: ignore[arg-type]
    assert plain.scheduler_config.disable_chunked_mm_input is False


def test_reject_names_every_problem_at_once() -> None:
    cfg = make_config(
        speculative_config=SimpleNamespace(),
        lora_config=SimpleNamespace(enable_tower_connector_lora=True),
        kv_transfer_config=SimpleNamespace(),
    )
    with pytest.raises(UnsupportedConfigError) as info:
        _reject_unsupported(cfg)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "speculative decoding" in msg
    assert "LoRA on the vision tower" in msg
    assert "KV transfer" in msg


def test_pipeline_parallelism_is_served() -> None:
    """--pipeline-parallel-size is no longer refused (worker/pipeline.py)."""
    cfg = make_config(
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, worker_cls="auto")
    )
    _reject_unsupported(cfg)  # type: ignore[arg-type]


@pytest.mark.parametrize("asked", [True, False])
def test_pipeline_parallelism_schedules_synchronously(
    asked: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With two stages async scheduling is off, and the log line says why: the
    first stage learns the sampled tokens from the scheduler, which sends them
    only under synchronous scheduling."""
    cfg = make_config(
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, worker_cls="auto")
    )
    cfg.scheduler_config.async_scheduling = asked
    with caplog.at_level("INFO", logger="vllm.hpu_mm"):
        _set_scheduling(cfg)  # type: ignore[arg-type]
    assert cfg.scheduler_config.async_scheduling is False
    assert "synchronous scheduling with 2 pipeline stages" in caplog.text
    assert "async scheduling is off" in caplog.text


def test_accepts_plain_config_and_missing_model_config() -> None:
    _reject_unsupported(make_config())  # type: ignore[arg-type]
    # LoRA is served (vllm_hpu_mm.lora): --enable-lora is not refused.
    _reject_unsupported(make_config(lora_config=SimpleNamespace()))  # type: ignore[arg-type]
    _reject_unsupported(make_config(model_config=None))  # type: ignore[arg-type]


def test_unsupported_config_error_is_value_error() -> None:
    assert issubclass(UnsupportedConfigError, ValueError)


# ---- validate_sampling_params ---------------------------------------------------


def test_accepts_supported_sampling_params() -> None:
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=1, logprobs=2, stop=["x"]
    )
    validate_sampling_params(params)
    CpuMMPlatform.validate_request(None, params)  # type: ignore[arg-type]


def test_accepts_defaults() -> None:
    validate_sampling_params(SamplingParams())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_p": 0.1},
        {"logit_bias": {1: 1.0}},
        {"min_tokens": 2},
        {"prompt_logprobs": 1},
        {"prompt_logprobs": 0},
        {"allowed_token_ids": [1, 2]},
        {"bad_words": ["x"]},
    ],
)
def test_accepts_every_sampling_option(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    validate_sampling_params(params)
    CpuMMPlatform.validate_request(None, params)  # type: ignore[arg-type]


def test_accepts_structured_outputs() -> None:
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    validate_sampling_params(params)
    assert CpuMMPlatform.supports_structured_output()


def test_rejects_pooling_params() -> None:
    with pytest.raises(ValueError, match="generation requests only"):
        validate_sampling_params(PoolingParams())
    with pytest.raises(ValueError, match="generation requests only"):
        CpuMMPlatform.validate_request(None, PoolingParams())  # type: ignore[arg-type]
