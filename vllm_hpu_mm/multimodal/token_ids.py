"""The image placeholder token id of a model's HF config: read here only.

transformers spells it ``image_token_id`` (Idefics3, Qwen2-VL/2.5-VL/3-VL) or
``image_token_index`` (LLaVA, Gemma 3, Mllama, whose configs also answer to
``image_token_id`` through their ``attribute_map``); both names are read, so a
config without that alias (a remote-code one) works too. Some configs keep it in
their ``text_config``.
"""

from __future__ import annotations

from typing import Any

_NAMES = ("image_token_id", "image_token_index")


def image_token_id(hf_config: Any) -> int | None:
    """The id of the token that stands for image embeddings; None for a model
    without one (a text model)."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        for name in _NAMES:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def require_image_token_id(hf_config: Any) -> int:
    """``image_token_id`` of a model that has one, or a ValueError naming the
    config class and the keys looked for."""
    value = image_token_id(hf_config)
    if value is None:
        raise ValueError(
            f"{type(hf_config).__name__} has no image token id: none of "
            f"{', '.join(_NAMES)} is an integer in it or its text_config"
        )
    return value
