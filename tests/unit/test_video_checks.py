"""The API server's video checks on real bytes: clips written with OpenCV,
vLLM's own OpenCV loader behind the check."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.multimodal.media import ImageMediaIO

from tests.qwen_reference import write_video
from vllm_hpu_mm.serving.errors import RequestRejected
from vllm_hpu_mm.serving.video_checks import CheckedVideoMediaIO, check_video_header


def _bytes(path: Path) -> bytes:
    return path.read_bytes()


def _loader() -> CheckedVideoMediaIO:
    return CheckedVideoMediaIO(ImageMediaIO(), num_frames=8)


def test_good_video_loads(tmp_path: Path) -> None:
    data = _bytes(write_video(tmp_path / "a.avi", frames=6, fps=4.0))
    assert check_video_header(data) == (6, 4.0)
    frames, meta = _loader().load_bytes(data).media
    assert frames.shape == (6, 32, 48, 3)
    assert meta["total_num_frames"] == 6


def test_empty_video_is_refused() -> None:
    with pytest.raises(RequestRejected, match=r"video is empty \(0 bytes\)"):
        _loader().load_bytes(b"")


def test_bytes_that_are_no_video_are_refused() -> None:
    with pytest.raises(RequestRejected, match="not a video OpenCV can open: an HTML"):
        _loader().load_bytes(b"<html><body>not found</body></html>" * 4)


def test_corrupt_video_is_refused(tmp_path: Path) -> None:
    data = _bytes(write_video(tmp_path / "a.avi", frames=6))
    with pytest.raises(RequestRejected, match="video"):
        _loader().load_bytes(data[:200])


def test_too_long_video_is_refused(tmp_path: Path) -> None:
    # 6 frames at 0.005 fps: 1200 s of video in a few kB.
    data = _bytes(write_video(tmp_path / "slow.avi", frames=6, fps=0.005))
    with pytest.raises(RequestRejected, match=r"video is too long: 1200 s .*600 s"):
        _loader().load_bytes(data)
