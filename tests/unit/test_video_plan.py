"""Videos in the vision planner (bucketing/video.py, ``buckets plan-vision``).

The oracle for a video's patch count is the processor itself: a clip written
with OpenCV, decoded by vLLM's loader as the server decodes a ``video_url``,
through transformers' processor ``__call__`` (the torchvision-free video
processor attached, as the HF reference of the e2e tests): ``t * h * w`` of
its ``video_grid_thw``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.qwen_reference import (
    hf_qwen_video_inputs,
    load_video,
    qwen_video_prompt,
    tiny_qwen_dir,
    write_video,
)
from vllm_hpu_mm.bucketing.video import (
    VideoSample,
    loader_frames,
    video_config,
    video_family,
    video_patches,
)
from vllm_hpu_mm.bucketing.vision import (
    PatchGeometry,
    padding_patches,
    plan_vision_buckets,
)
from vllm_hpu_mm.cli.main import main

MODELS = ["tiny-qwen2_5-vl", "tiny-qwen3-vl"]
# (frames, (width, height), fps): whole clips the processor may sample again
# (Qwen3-VL at 2 fps), an odd count (last frame repeated), a clip the loader
# cuts to 32 frames, a very wide one and a 30 fps one.
CLIPS = [
    (6, (48, 32), 4.0),
    (5, (32, 40), 4.0),
    (40, (48, 32), 8.0),
    (3, (100, 20), 2.0),
    (12, (64, 64), 30.0),
]


def _geometry(model: str) -> PatchGeometry:
    config = json.loads((Path(model) / "processor_config.json").read_text())
    return PatchGeometry.from_processor_config(config)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}f-{c[1][0]}x{c[1][1]}")
def test_video_patches_equal_the_processors_grid(
    name: str, clip: tuple[int, tuple[int, int], float], tmp_path: Path
) -> None:
    frames, (width, height), fps = clip
    model = tiny_qwen_dir(name)
    path = write_video(
        tmp_path / "clip.avi", frames=frames, size=(width, height), fps=fps
    )
    inputs = hf_qwen_video_inputs(
        model, qwen_video_prompt(0, 1), [], [load_video(path)]
    )
    want = int(np.prod(inputs["video_grid_thw"][0].tolist()))
    sample = VideoSample(frames=frames, width=width, height=height, fps=fps)
    assert video_patches(video_config(Path(model)), sample) == want


@pytest.mark.parametrize("frames", [1, 5, 31, 32, 33, 40, 1000])
@pytest.mark.parametrize("num_frames", [-1, 8, 32])
def test_loader_frames_as_vllms_loader(frames: int, num_frames: int) -> None:
    from vllm.multimodal.video import VideoBackend
    from vllm.multimodal.video_decoders.base import (
        VideoSourceMetadata,
        VideoTargetMetadata,
    )

    source = VideoSourceMetadata(frames, 10.0, frames / 10.0)
    target = VideoTargetMetadata(num_frames=num_frames, fps=-1, max_duration=300)
    indices = VideoBackend.compute_frames_index_to_sample(source, target)
    assert loader_frames(frames, num_frames) == (len(indices), len(indices) == frames)


def test_family_and_refusals(tmp_path: Path) -> None:
    assert video_family(Path(tiny_qwen_dir(MODELS[0]))) == "qwen2"
    assert video_family(Path(tiny_qwen_dir(MODELS[1]))) == "qwen3"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match="model_type 'llava' takes no video"):
        video_family(tmp_path)
    with pytest.raises(ValueError, match="frames, width and height > 0"):
        VideoSample(frames=0, width=4, height=4)
    # Qwen3-VL samples a whole video at 2 fps: it needs the video's rate.
    cfg = video_config(Path(tiny_qwen_dir(MODELS[1])))
    with pytest.raises(ValueError, match="needs its fps"):
        video_patches(cfg, VideoSample(frames=6, width=48, height=32))
    # ... not when the loader already sampled it.
    assert video_patches(cfg, VideoSample(frames=64, width=48, height=32)) > 0


def test_plan_from_images_and_videos_covers_every_sample() -> None:
    model = tiny_qwen_dir(MODELS[0])
    geometry = _geometry(model)
    cfg = video_config(Path(model))
    images = [geometry.patches(w, h) for w, h in [(40, 24), (64, 48), (16, 16)]]
    videos = [
        video_patches(cfg, VideoSample(frames, w, h, fps))
        for frames, (w, h), fps in CLIPS
    ]
    # Videos beyond the largest image: a plan over images alone leaves them out.
    assert max(videos) > geometry.max_patches
    counts = images + videos
    for k in (1, 2, 4):
        planned = plan_vision_buckets(counts, geometry, k)
        assert len(planned) <= k and all(b % geometry.unit == 0 for b in planned)
        assert padding_patches(counts, planned)[1] == 0, (planned, counts)
        assert planned[-1] >= geometry.max_patches  # every image fits too


def test_cli_plans_images_and_videos(tmp_path: Path) -> None:
    model = tiny_qwen_dir(MODELS[1])
    samples = [
        "40x24",
        [64, 48],
        {"width": 16, "height": 16},
        {"frames": 6, "width": 48, "height": 32, "fps": 4},
        {"frames": 40, "width": 48, "height": 32, "fps": 8.0},
        {"frames": 5, "width": 32, "height": 40, "fps": 4.0},
    ]
    file = tmp_path / "samples.json"
    file.write_text(json.dumps(samples))
    out = tmp_path / "vision.yaml"
    argv = ["buckets", "plan-vision", "--model", model, "--samples", str(file)]
    assert main([*argv, "--max-buckets", "8", "--out", str(out)]) == 0
    text = out.read_text()
    assert "# Sample: 3 images, 3 videos;" in text
    (line,) = [x for x in text.splitlines() if x.startswith("vision_patches")]
    planned = [int(v) for v in line.split("[")[1].rstrip("]").split(",")]
    geometry = _geometry(model)
    cfg = video_config(Path(model))
    counts = [
        geometry.patches(40, 24),
        geometry.patches(64, 48),
        geometry.patches(16, 16),
    ]
    counts += [
        video_patches(cfg, VideoSample(6, 48, 32, 4.0)),
        video_patches(cfg, VideoSample(40, 48, 32, 8.0)),
        video_patches(cfg, VideoSample(5, 32, 40, 4.0)),
    ]
    # Eight buckets for six distinct items: every item is a bucket, no padding.
    assert set(counts) <= set(planned)
    assert padding_patches(counts, planned) == (0, 0)


def test_cli_reads_a_folder_of_images_and_videos(tmp_path: Path) -> None:
    model = tiny_qwen_dir(MODELS[0])
    folder = tmp_path / "media"
    folder.mkdir()
    Image.new("RGB", (40, 24)).save(folder / "a.png")
    write_video(folder / "b.avi", frames=6, size=(48, 32), fps=4.0)
    out = tmp_path / "vision.yaml"
    argv = ["buckets", "plan-vision", "--model", model, "--images", str(folder)]
    assert main([*argv, "--max-buckets", "4", "--out", str(out)]) == 0
    text = out.read_text()
    assert "# Sample: 1 images, 1 videos;" in text
    # The header's 6 frames at 48x32: the processor's grid of the decoded clip.
    inputs = hf_qwen_video_inputs(
        model, qwen_video_prompt(0, 1), [], [load_video(folder / "b.avi")]
    )
    video = int(np.prod(inputs["video_grid_thw"][0].tolist()))
    (line,) = [x for x in text.splitlines() if x.startswith("vision_patches")]
    planned = [int(v) for v in line.split("[")[1].rstrip("]").split(",")]
    assert video in planned and planned[-1] >= video


def test_cli_bad_video_items(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path / "o.yaml")]
    file = tmp_path / "samples.json"
    argv = ["buckets", "plan-vision", "--samples", str(file), *out]
    qwen3 = tiny_qwen_dir(MODELS[1])
    for items, model, why in [
        ([{"frames": 6, "width": 48}], qwen3, "item 0: {'frames': 6, 'width': 48}"),
        ([{"frames": 0, "width": 4, "height": 4}], qwen3, "item 0: a video needs"),
        ([{"frames": 6, "width": 48, "height": 32}], qwen3, "needs its fps"),
    ]:
        file.write_text(json.dumps(items))
        assert main([*argv, "--model", model]) == 1
        assert why in capsys.readouterr().err
