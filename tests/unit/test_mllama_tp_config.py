"""Mllama's tensor-parallel sizes are checked at start-up, before the engine core:
each rank holds heads / tp of every attention layer, so tp must divide both the
query and the KV heads (the tiny Mllama: 4 and 2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from vllm_hpu_mm.platform_config import (
    UnsupportedConfigError,
    _set_cross_attention_limits,
)


def _config(model_dir: str, tp: int) -> SimpleNamespace:
    hf = AutoConfig.from_pretrained(model_dir)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, multimodal_config=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_dividing_the_heads_is_accepted(tiny_mllama_dir: str, tp: int) -> None:
    _set_cross_attention_limits(_config(tiny_mllama_dir, tp))  # type: ignore[arg-type]


@pytest.mark.parametrize("tp", [3, 4])
def test_tp_not_dividing_the_heads_is_refused(tiny_mllama_dir: str, tp: int) -> None:
    with pytest.raises(UnsupportedConfigError, match=r"4 query and\s+2 KV heads"):
        _set_cross_attention_limits(_config(tiny_mllama_dir, tp))  # type: ignore[arg-type]
