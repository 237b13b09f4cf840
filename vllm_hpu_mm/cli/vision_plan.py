"""``vllm-hpu-mm buckets plan-vision``: patch buckets fitted to a sample of image sizes.

For dynamic-resolution vision towers (Qwen2.5-VL, Qwen3-VL). Reads the
model's saved image-processor settings, turns each sampled image size into the
patches the tower runs (the processor's own resize arithmetic), picks at most
``--max-buckets`` patch buckets with the least padding on the sample, prints
the padding against the doubling default, and writes a ``vision_patches:``
line for the bucket file (``bucketing.file``, strategy ``explicit``).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


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
        "--images",
        type=Path,
        required=True,
        metavar="FILE|DIR",
        help="a JSON list of sizes ([width, height] or 'WxH'), or a folder of "
        "images (only their headers are read)",
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


def read_sizes(path: Path) -> list[tuple[int, int]]:
    """(width, height) of each sampled image."""
    if path.is_dir():
        from PIL import Image

        files = sorted(
            f for f in path.rglob("*") if f.suffix.lower() in _IMAGE_SUFFIXES
        )
        if not files:
            raise ValueError(
                f"{path}: no images ({', '.join(sorted(_IMAGE_SUFFIXES))})"
            )
        sizes = []
        for f in files:
            with Image.open(f) as im:  # header only: nothing is decoded
                sizes.append((int(im.width), int(im.height)))
        return sizes
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of sizes")
    sizes = []
    for i, item in enumerate(data):
        if isinstance(item, str) and (
            m := re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", item)
        ):
            sizes.append((int(m[1]), int(m[2])))
        elif (
            isinstance(item, list)
            and len(item) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        ):
            sizes.append((item[0], item[1]))
        else:
            raise ValueError(
                f"{path}, item {i}: {item!r} is not [width, height] or 'WxH'"
            )
    return sizes


def _geometry(model: Path) -> Any:
    from vllm_hpu_mm.bucketing.vision import PatchGeometry

    for name in ("processor_config.json", "preprocessor_config.json"):
        file = model / name
        if file.exists():
            return PatchGeometry.from_processor_config(json.loads(file.read_text()))
    raise ValueError(f"{model}: no processor_config.json or preprocessor_config.json")


def run(args: argparse.Namespace) -> int:
    from vllm_hpu_mm.bucketing.vision import (
        doubling_buckets,
        padding_patches,
        plan_vision_buckets,
    )

    try:
        geometry = _geometry(args.model)
        counts = [geometry.patches(w, h) for w, h in read_sizes(args.images)]
    except (OSError, ValueError) as exc:
        print(f"vllm-hpu-mm: {exc}", file=sys.stderr)
        return 1
    planned = plan_vision_buckets(counts, geometry, args.max_buckets)
    default = doubling_buckets(geometry, args.min_patches)
    real = sum(counts)
    rows = []
    for name, buckets in (("planned", planned), ("doubling (default)", default)):
        pad, misses = padding_patches(counts, buckets)
        rows.append((name, buckets, pad, 100 * pad / (real + pad), misses))
    print(
        f"Sample: {len(counts)} images, {real} patches (patch {geometry.patch_size}, "
        f"merge {geometry.merge_size}, at most {geometry.max_patches} per image)"
    )
    print("| buckets | count | padding patches | padding % | images over the top |")
    print("|---|---:|---:|---:|---:|")
    for name, buckets, pad, pct, misses in rows:
        print(f"| {name} | {len(buckets)} | {pad} | {pct:.1f} | {misses} |")
    command = "vllm-hpu-mm " + shlex.join(getattr(args, "argv", []) or sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Vision patch buckets planned by `vllm-hpu-mm buckets plan-vision`;\n"
        "# add the line to the bucket file (bucketing.file, strategy explicit).\n"
        f"# Command: {command}\n"
        f"# Sample: {len(counts)} images; padding {rows[0][3]:.1f} % planned, "
        f"{rows[1][3]:.1f} % with the doubling default.\n"
        f"vision_patches: [{', '.join(str(b) for b in planned)}]\n",
        encoding="utf-8",
    )
    print(f"\nWrote {args.out}")
    return 0
