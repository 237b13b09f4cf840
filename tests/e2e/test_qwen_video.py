"""Video through ``vllm.LLM`` with the tiny Qwen2.5-VL and Qwen3-VL: greedy
parity with HF.

One engine per model (float32, graph mode over explicit buckets, a
32-token step budget so that chunked prefill cuts through every video here:
each has 48 to 72 placeholder tokens). The videos are short MJPG clips written
with OpenCV and decoded by vLLM's own loader, as the server decodes a
``video_url``; the torchvision-free video processor
(``vllm_hpu_mm.models.qwen_video``) turns them into ``pixel_values_videos``
and ``video_grid_thw``; HF transformers' ``generate`` on the same prompt ids
and processor outputs (``second_per_grid_ts`` included: M-RoPE's time axis)
is the oracle. Videos share the image patch buckets (each temporal patch is
one attention segment of the tower), so serving compiles nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.graph_config import compiled_with_buckets
from tests.mm_reference import engine_lifetime, make_image
from tests.qwen_reference import (
    Video,
    check_video_parity,
    load_video,
    qwen_video_prompt,
    tiny_qwen_dir,
    write_video,
)
from vllm_hpu_mm.metrics_reader import read_metric

pytestmark = pytest.mark.e2e

MAX_NEW = 6
BUDGET = 32  # max_num_batched_tokens: smaller than every video's placeholders


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_qwen_dir()


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Video]:
    root: Path = tmp_path_factory.mktemp("videos")
    specs = {
        "short": dict(frames=6, size=(48, 32), fps=4.0),  # 3 x 8 x 12 patches
        "odd": dict(frames=5, size=(32, 40), fps=4.0, variant=1),  # padded to 6
        "wide": dict(frames=4, size=(64, 24), fps=8.0, variant=2),
    }
    return {
        name: load_video(write_video(root / f"{name}.avi", **spec))  # type: ignore[arg-type]
        for name, spec in specs.items()
    }


@pytest.fixture(scope="module")
def llm(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    engine = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        limit_mm_per_prompt={"image": 1, "video": 2},
        seed=0,
        additional_config=compiled_with_buckets(
            tmp_path_factory,
            "qwen_video",
            "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [8, 32]\n",
        ),
    )
    yield from engine_lifetime(engine)


def test_one_video(llm: Any, model_dir: str, videos: dict[str, Video]) -> None:
    before = read_metric("vllm_hpu_mm:vision_patches_total")
    check_video_parity(
        llm, model_dir, [(qwen_video_prompt(0, 1), [], [videos["short"]])], MAX_NEW
    )
    # The video ran on the patch buckets: its 3 x 8 x 12 patches, counted once.
    assert read_metric("vllm_hpu_mm:vision_patches_total") - before == 3 * 8 * 12


def test_mixed_batch_with_chunks_cutting_videos(
    llm: Any, model_dir: str, videos: dict[str, Video]
) -> None:
    # One step budget of 32 tokens: the videos' placeholders (48 to 72) are
    # cut across steps, beside an image, a two-video prompt and a text prompt.
    image = make_image("checkerboard", (40, 24), 1)
    cases = [
        (qwen_video_prompt(1, 1, "Image then video?"), [image], [videos["odd"]]),
        (
            qwen_video_prompt(0, 2, "Which is longer?"),
            [],
            [videos["wide"], videos["short"]],
        ),
        (qwen_video_prompt(0, 0, "The quick brown fox"), [], []),
    ]
    check_video_parity(llm, model_dir, cases, MAX_NEW)
    # Every shape, vision patch buckets included, was compiled at warmup.
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert read_metric("vllm_hpu_mm:fallback_buckets_total") == 0


def test_prefix_cache_hit_inside_a_video(
    llm: Any, model_dir: str, videos: dict[str, Video]
) -> None:
    # The same prompt twice: the second starts after cached blocks that end
    # inside the video, so its M-RoPE positions (time axis included) are read
    # from the middle of the stored prompt positions.
    case = (qwen_video_prompt(0, 1, "Again?"), [], [videos["wide"]])
    check_video_parity(llm, model_dir, [case], MAX_NEW)
    (out,) = check_video_parity(llm, model_dir, [case], MAX_NEW)
    assert out.num_cached_tokens >= 32, out.num_cached_tokens


@pytest.fixture(scope="module")
def llm_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    engine = LLM(
        model=tiny_qwen_dir("tiny-qwen3-vl"),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        limit_mm_per_prompt={"image": 1, "video": 1},
        seed=0,
        additional_config=compiled_with_buckets(
            tmp_path_factory,
            "qwen3_video",
            "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [8, 32]\n",
        ),
    )
    yield from engine_lifetime(engine)


def test_qwen3_vl_video_with_timestamps(
    llm_qwen3: Any, videos: dict[str, Video]
) -> None:
    # Qwen3-VL: the processor samples 2 fps and writes "<t seconds>" before
    # each temporal patch (vLLM's prompt update and transformers' processor
    # alike); deep-stack features ride with the video rows.
    image = make_image("gradient", (40, 24), 2)
    cases = [
        (qwen_video_prompt(0, 1), [], [videos["short"]]),
        (qwen_video_prompt(1, 1, "Mixed?"), [image], [videos["odd"]]),
    ]
    check_video_parity(llm_qwen3, tiny_qwen_dir("tiny-qwen3-vl"), cases, MAX_NEW)
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
