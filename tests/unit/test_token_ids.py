"""The image token id, read from the HF configs transformers builds (both of its
spellings, the attribute_map alias, text_config) in one place."""

from __future__ import annotations

import pytest
from transformers import (
    Gemma3Config,
    Idefics3Config,
    LlamaConfig,
    LlavaConfig,
    MllamaConfig,
    PretrainedConfig,
    Qwen2_5_VLConfig,
)

from vllm_hpu_mm.multimodal.token_ids import image_token_id, require_image_token_id
from vllm_hpu_mm.serving.request_checks import RequestLimits


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LlavaConfig(image_token_index=7), 7),  # image_token_index
        (Gemma3Config(image_token_index=8), 8),
        (MllamaConfig(image_token_index=9), 9),
        (Idefics3Config(image_token_id=10), 10),  # image_token_id
        (Qwen2_5_VLConfig(image_token_id=11), 11),
        (LlamaConfig(), None),  # a text model
        (None, None),
    ],
    ids=["llava", "gemma3", "mllama", "idefics3", "qwen2.5-vl", "llama", "none"],
)
def test_image_token_id_of_real_configs(
    config: PretrainedConfig | None, expected: int | None
) -> None:
    assert image_token_id(config) == expected
    expected_ids = frozenset(() if expected is None else (expected,))
    assert RequestLimits.from_hf_config(config).image_token_ids == expected_ids


def test_image_token_id_in_text_config_and_not_a_bool() -> None:
    text = PretrainedConfig.from_dict({"image_token_id": 12})
    nested = PretrainedConfig.from_dict({"text_config": text})
    assert image_token_id(nested) == 12
    assert RequestLimits.from_hf_config(nested).image_token_ids == {12}
    assert image_token_id(PretrainedConfig.from_dict({"image_token_id": True})) is None


def test_require_names_the_config() -> None:
    assert require_image_token_id(MllamaConfig(image_token_index=9)) == 9
    with pytest.raises(ValueError, match="LlamaConfig has no image token id"):
        require_image_token_id(LlamaConfig())
