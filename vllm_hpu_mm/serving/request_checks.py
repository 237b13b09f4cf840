"""Checks on a processed request, in the API server (``validate_request``).

By then vLLM has tokenised the prompt and run the model's multimodal
processor: ``prompt_token_ids`` and, per modality, the placeholder ranges of
the items. What vLLM lets through and the engine would misread:

- image tokens that no image fills: a prompt (text or token ids) carrying the
  model's image token where no image placeholder is. The model would embed
  them as text; HF refuses such a prompt. The plugin refuses it with a 400.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hpu_mm.multimodal.token_ids import image_token_id
from vllm_hpu_mm.serving.errors import RequestRejected


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the request checks need from the model's config."""

    # Token ids that stand for an image embedding (``token_ids.image_token_id``);
    # empty for a text-only model.
    image_token_ids: frozenset[int] = frozenset()

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> RequestLimits:
        found = image_token_id(hf_config)
        return cls(image_token_ids=frozenset(() if found is None else (found,)))


def _covered(ranges: Iterable[Any]) -> list[tuple[int, int]]:
    """[start, end) token spans of placeholder ranges (dicts or objects)."""
    spans = []
    for r in ranges:
        offset = r["offset"] if isinstance(r, Mapping) else r.offset
        length = r["length"] if isinstance(r, Mapping) else r.length
        spans.append((int(offset), int(offset) + int(length)))
    return spans


def stray_image_tokens(
    token_ids: Sequence[int],
    placeholders: Mapping[str, Iterable[Any]],
    image_token_ids: frozenset[int],
) -> list[int]:
    """Positions of image tokens outside every placeholder range."""
    if not image_token_ids:
        return []
    inside = [False] * len(token_ids)
    for ranges in placeholders.values():
        for start, end in _covered(ranges):
            for i in range(max(start, 0), min(end, len(inside))):
                inside[i] = True
    return [
        i for i, t in enumerate(token_ids) if t in image_token_ids and not inside[i]
    ]


def check_processed_request(inputs: Any, limits: RequestLimits) -> None:
    """Raise ``RequestRejected`` for a request the engine must not get."""
    if not isinstance(inputs, Mapping):
        return
    token_ids = inputs.get("prompt_token_ids")
    if token_ids is None:
        return
    placeholders = inputs.get("mm_placeholders") or {}
    stray = stray_image_tokens(token_ids, placeholders, limits.image_token_ids)
    if stray:
        items = sum(len(list(r)) for r in placeholders.values())
        shown = ", ".join(str(p) for p in stray[:8]) + (
            ", ..." if len(stray) > 8 else ""
        )
        raise RequestRejected(
            f"prompt has {len(stray)} image token(s) (id "
            f"{'/'.join(str(i) for i in sorted(limits.image_token_ids))}) that no "
            f"image fills, at positions {shown}; the request has {items} image "
            "item(s). Send one image per image placeholder, and do not write the "
            "image token in the text",
            parameter="messages",
        )
