"""``vllm-hpu-mm buckets plan-vision``: patch buckets fitted to sampled images, videos.

For dynamic-resolution vision towers (Qwen2.5-VL, Qwen3-VL). Reads the
model's saved processor settings, turns each sampled image size and video
(frames, size, fps) into the patches the tower runs (the processors' own
frame sampling and resize arithmetic), picks at most ``--max-buckets`` patch
buckets with the least padding on the sample, prints the padding against the
doubling default, and writes a ``vision_patches:`` line for the bucket file
(``bucketing.file``, strategy ``explicit``).

Sample items (a JSON list): an image as ``[width, height]``, ``"WxH"`` or
``{"width": W, "height": H}``; a video as ``{"frames": F, "width": W,
"height": H, "fps": R}`` (the file's frame count and rate, as its header
gives them; ``fps`` is needed where the processor samples by fps: Qwen3-VL).
Or a folder: image headers and video headers (OpenCV) are read.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from vllm_hpu_mm.bucketing.video import LOADER_NUM_FRAMES, VideoSample

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
_VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".webm"}
# One sampled item: (width, height) of an image, or a video.
Sample = tuple[int, int] | VideoSample


def add_parser(sub: Any, positive: Any) -> None:
    p = sub.add_parser(
        "plan-vision",
        help="plan vision patch buckets from a sample of image sizes",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        help="the checkpoint (its processor config)",
    )
    p.add_argument(
        "--samples",
        "--images",
        dest="samples",
        type=Path,
        required=True,
        metavar="FILE|DIR",
        help="a JSON list of images ([width, height], 'WxH' or {width, height}) "
        "and videos ({frames, width, height, fps}), or a folder of images and "
        "videos (only their headers are read)",
    )
    p.add_argument(
        "--num-frames",
        type=int,
        default=LOADER_NUM_FRAMES,
        help="frames vLLM's video loader keeps of a longer video "
        f"(--media-io-kwargs video num_frames; default: {LOADER_NUM_FRAMES}; "
        "-1: all)",
    )
    p.add_argument(
        "--max-buckets",
        type=positive,
        default=6,
        help="most patch buckets (graphs warmup compiles; default: 6)",
    )
    p.add_argument(
        "--min-patches",
        type=positive,
        default=16,
        help="the doubling default's smallest bucket, for the comparison "
        "(bucketing.vision_min_patches; default: 16)",
    )
    p.add_argument("--out", type=Path, required=True, help="YAML file to write")
    p.set_defaults(handler=run)


def _video_header(path: Path) -> VideoSample:
    """A video file's frames, size and fps from its header (OpenCV, as vLLM's
    loader opens it; nothing is decoded)."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            raise ValueError(f"{path}: not a video OpenCV can open")
        fps = float(cap.get(cv2.CAP_PROP_FPS))
        return VideoSample(
            frames=int(cap.get(cv2.CAP_PROP_FRAME_COUNT)),
            width=int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            fps=fps if fps > 0 else None,
        )
    finally:
        cap.release()


def _read_folder(path: Path) -> list[Sample]:
    from PIL import Image

    suffixes = _IMAGE_SUFFIXES | _VIDEO_SUFFIXES
    files = sorted(f for f in path.rglob("*") if f.suffix.lower() in suffixes)
    if not files:
        raise ValueError(f"{path}: no images or videos ({', '.join(sorted(suffixes))})")
    samples: list[Sample] = []
    for f in files:
        if f.suffix.lower() in _VIDEO_SUFFIXES:
            samples.append(_video_header(f))
            continue
        with Image.open(f) as im:  # header only: nothing is decoded
            samples.append((int(im.width), int(im.height)))
    return samples


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _item(path: Path, i: int, item: Any) -> Sample:
    """One JSON sample item: an image size or a video."""
    if isinstance(item, str) and (m := re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", item)):
        return (int(m[1]), int(m[2]))
    if isinstance(item, list) and len(item) == 2 and all(map(_is_int, item)):
        return (item[0], item[1])
    if isinstance(item, dict):
        keys = set(item)
        fps = item.get("fps")
        ints = all(_is_int(item.get(k)) for k in ("width", "height"))
        if keys == {"width", "height"} and ints:
            return (item["width"], item["height"])
        if (
            {"frames", "width", "height"}
            <= keys
            <= {"frames", "width", "height", "fps"}
            and ints
            and _is_int(item["frames"])
            and (
                fps is None
                or (isinstance(fps, (int, float)) and not isinstance(fps, bool))
            )
        ):
            try:
                return VideoSample(
                    item["frames"],
                    item["width"],
                    item["height"],
                    None if fps is None else float(fps),
                )
            except ValueError as exc:
                raise ValueError(f"{path}, item {i}: {exc}") from None
    raise ValueError(
        f"{path}, item {i}: {item!r} is not an image ([width, height], 'WxH', "
        "{width, height}) or a video ({frames, width, height[, fps]}, integers "
        "but fps)"
    )


def read_samples(path: Path) -> list[Sample]:
    """The sampled images ((width, height)) and videos (``VideoSample``)."""
    if path.is_dir():
        return _read_folder(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of samples")
    return [_item(path, i, item) for i, item in enumerate(data)]


def _geometry(model: Path) -> Any:
    from vllm_hpu_mm.bucketing.vision import PatchGeometry

    for name in ("processor_config.json", "preprocessor_config.json"):
        file = model / name
        if file.exists():
            return PatchGeometry.from_processor_config(json.loads(file.read_text()))
    raise ValueError(f"{model}: no processor_config.json or preprocessor_config.json")


def patch_counts(model: Path, samples: list[Sample], num_frames: int) -> list[int]:
    """Patches the tower runs for each sample (an image or a whole video)."""
    from vllm_hpu_mm.bucketing.video import video_config, video_patches

    geometry = _geometry(model)
    video_cfg = None
    counts = []
    for sample in samples:
        if isinstance(sample, VideoSample):
            video_cfg = video_cfg or video_config(model)
            counts.append(video_patches(video_cfg, sample, num_frames))
        else:
            counts.append(geometry.patches(*sample))
    return counts


def run(args: argparse.Namespace) -> int:
    from vllm_hpu_mm.bucketing.vision import (
        doubling_buckets,
        padding_patches,
        plan_vision_buckets,
    )

    try:
        geometry = _geometry(args.model)
        samples = read_samples(args.samples)
        counts = patch_counts(args.model, samples, args.num_frames)
    except (OSError, ValueError) as exc:
        print(f"vllm-hpu-mm: {exc}", file=sys.stderr)
        return 1
    videos = sum(isinstance(s, VideoSample) for s in samples)
    what = f"{len(samples) - videos} images, {videos} videos"
    planned = plan_vision_buckets(counts, geometry, args.max_buckets)
    default = doubling_buckets(geometry, args.min_patches)
    real = sum(counts)
    rows = []
    for name, buckets in (("planned", planned), ("doubling (default)", default)):
        pad, misses = padding_patches(counts, buckets)
        rows.append((name, buckets, pad, 100 * pad / (real + pad), misses))
    print(
        f"Sample: {what}, {real} patches (patch {geometry.patch_size}, "
        f"merge {geometry.merge_size}, at most {geometry.max_patches} per image"
        f"{f', {max(counts)} in the largest item' if videos else ''})"
    )
    print("| buckets | count | padding patches | padding % | items over the top |")
    print("|---|---:|---:|---:|---:|")
    for name, buckets, pad, pct, misses in rows:
        print(f"| {name} | {len(buckets)} | {pad} | {pct:.1f} | {misses} |")
    command = "vllm-hpu-mm " + shlex.join(getattr(args, "argv", []) or sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Vision patch buckets planned by `vllm-hpu-mm buckets plan-vision`;\n"
        "# add the line to the bucket file (bucketing.file, strategy explicit).\n"
        f"# Command: {command}\n"
        f"# Sample: {what}; padding {rows[0][3]:.1f} % planned, "
        f"{rows[1][3]:.1f} % with the doubling default.\n"
        f"vision_patches: [{', '.join(str(b) for b in planned)}]\n",
        encoding="utf-8",
    )
    print(f"\nWrote {args.out}")
    return 0
