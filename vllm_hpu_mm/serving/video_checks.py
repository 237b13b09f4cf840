"""Video checks in the API server: a bad ``video_url`` becomes a 400 that says why.

vLLM's video loader (OpenCV) raises a bare ``ValueError`` ("Could not open
video stream") or an OpenCV error for an empty, corrupt or non-video body,
which reaches the client as a vague error, and it decodes a video of any
length (sampling its frames afterwards). ``CheckedVideoMediaIO`` reads the
container's header first (frame count, frame rate: OpenCV opens it without
decoding frames) and refuses:

- an empty body ("video is empty (0 bytes)");
- bytes OpenCV cannot open as a video (naming what they look like);
- a video without frames;
- a video longer than ``MAX_VIDEO_SECONDS`` (its duration from the header);

and turns any failure of the decoding itself into a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from vllm.multimodal.media import VideoMediaIO

from vllm_hpu_mm.serving.errors import RequestRejected
from vllm_hpu_mm.serving.image_checks import describe_bytes

MAX_VIDEO_SECONDS = 600.0  # ten minutes of video per item
PARAMETER = "video_url"


def video_header(data: bytes) -> tuple[int, float]:
    """(frames, fps) of a video's container header, nothing decoded."""
    from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin

    if not data:
        raise RequestRejected("video is empty (0 bytes)", parameter=PARAMETER)
    try:
        meta = OpenCVVideoBackendMixin.get_video_metadata(data)
    except Exception:
        raise RequestRejected(
            f"video bytes are not a video OpenCV can open: {describe_bytes(data)} "
            f"({len(data)} bytes)",
            parameter=PARAMETER,
        ) from None
    return int(meta.total_frames_num), float(meta.original_fps)


def check_video_header(
    data: bytes, max_seconds: float = MAX_VIDEO_SECONDS
) -> tuple[int, float]:
    """Raise ``RequestRejected`` for an empty, unreadable, frameless or too long
    video; else its (frames, fps)."""
    frames, fps = video_header(data)
    if frames <= 0:
        raise RequestRejected("video has no frames", parameter=PARAMETER)
    seconds = frames / fps if fps > 0 else 0.0
    if seconds > max_seconds:
        raise RequestRejected(
            f"video is too long: {seconds:.0f} s ({frames} frames at {fps:g} fps); "
            f"the limit is {max_seconds:g} s per video",
            parameter=PARAMETER,
        )
    return frames, fps


class CheckedVideoMediaIO(VideoMediaIO):
    """vLLM's video loader, with the header checked before any decoding."""

    def load_bytes(self, data: bytes) -> Any:
        frames, fps = check_video_header(data)
        try:
            video = super().load_bytes(data)
        except RequestRejected:
            raise
        except Exception as exc:  # whatever OpenCV raises on a broken stream
            raise RequestRejected(
                f"video ({frames} frames at {fps:g} fps) cannot be decoded: {exc}",
                parameter=PARAMETER,
            ) from None
        decoded = getattr(video, "media", video)
        decoded = decoded[0] if isinstance(decoded, tuple) else decoded
        if len(decoded) == 0:
            raise RequestRejected(
                f"video ({frames} frames at {fps:g} fps) decoded to no frames",
                parameter=PARAMETER,
            )
        return video
