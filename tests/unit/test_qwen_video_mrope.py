"""A known difference in Qwen2.5-VL's M-RoPE positions after a video between
vLLM 0.33 and transformers 5.20 (found by the video parity tests).

A video's tokens take time positions ``t_index * second_per_grid_t *
tokens_per_second``. The text after it starts one past:

- vLLM (``Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions``) and
  the original Qwen2.5-VL code (transformers 4.x ``get_rope_index``): the
  largest position of the video on any axis, time included;
- transformers 5.20 (``Qwen2_5_VLModel.get_rope_index``): the video's start
  plus ``max(h, w) / merge``, ignoring the time axis.

So the two agree when a video's time span is at most its spatial span, and the
e2e video cases keep to that (``tests/e2e/test_qwen_video.py``); a longer
video (more temporal patches, or a low frame rate) gets other positions for
the text after it in HF than in vLLM, and other greedy tokens. This test pins
both behaviours so that a change on either side shows up here.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from tests.qwen_reference import load_hf_qwen, tiny_qwen_dir


def _feature(offset: int, grid: list[int], seconds: float) -> Any:
    def field(value: Any) -> Any:
        return types.SimpleNamespace(data=value)

    return types.SimpleNamespace(
        modality="video",
        mm_position=types.SimpleNamespace(offset=offset),
        data={
            "video_grid_thw": field(torch.tensor(grid)),
            "second_per_grid_ts": field(torch.tensor(seconds)),
        },
    )


def _positions(grid: list[int], seconds: float) -> tuple[list[int], list[int]]:
    """(vLLM's, HF's) first position of the text token after a video of
    ``grid`` behind 2 text tokens."""
    from vllm_hpu_mm.models.compat import use_pil_qwen2_vl_image_processor

    use_pil_qwen2_vl_image_processor()  # as the plugin does before vLLM's import
    from vllm.model_executor.models.qwen2_5_vl import (
        Qwen2_5_VLForConditionalGeneration as VllmQwen,
    )

    model = load_hf_qwen(tiny_qwen_dir())
    merge = model.config.vision_config.spatial_merge_size
    tokens = grid[0] * grid[1] * grid[2] // merge**2
    ids = [1, 2] + [model.config.video_token_id] * tokens + [3]
    fake = types.SimpleNamespace(config=model.config)
    fake.iter_mm_grid_thw = lambda feats: VllmQwen.iter_mm_grid_thw(fake, feats)
    ours, _ = VllmQwen.get_mrope_input_positions(
        fake, ids, [_feature(2, [grid[0], grid[1], grid[2]], seconds)]
    )
    types_ = torch.tensor([[0, 0] + [2] * tokens + [0]])
    theirs, _ = model.model.get_rope_index(
        torch.tensor([ids]),
        types_,
        video_grid_thw=torch.tensor([grid]),
        second_per_grid_ts=torch.tensor([seconds]),
    )
    return [int(x) for x in ours[:, -1]], [int(x) for x in theirs[:, 0, -1]]


def test_short_time_span_agrees() -> None:
    # 3 temporal patches, 0.5 s each, 4 tokens/s: time 0, 2, 4 <= max(h, w) 6.
    ours, theirs = _positions([3, 8, 12], 0.5)
    assert ours == theirs


def test_long_time_span_differs() -> None:
    # 3 temporal patches, 1 s each: time 0, 4, 8 > max(h, w) / merge = 5.
    ours, theirs = _positions([3, 10, 8], 1.0)
    assert ours == [2 + 9] * 3  # one past the time axis' 8, after 2 text tokens
    assert theirs == [2 + 5] * 3  # one past start + max(h, w) / merge - 1
