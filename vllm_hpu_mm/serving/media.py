"""vLLM glue for the image and video checks: a media connector of vLLM's own
registry.

vLLM decodes ``image_url`` parts in the API server through the media
connector named by ``VLLM_MEDIA_CONNECTOR`` (registry
``vllm.multimodal.media.connector.MEDIA_CONNECTOR_REGISTRY``, default
``"http"``). ``register_connector`` adds ``"hpu_mm"``: vLLM's connector with an
image loader that reads the header before decoding (``image_checks``) and
turns every decoding failure into a 400 that names it, plus 400s (not 500 or
501) for ``file://`` URLs on a server without ``--allowed-local-media-path``
and for data URLs that are not base64. ``video_url`` parts go through the
header-checked video loader of ``video_checks``.

An ``http(s)`` URL that cannot be fetched is the client's problem too: vLLM
passes connection errors, DNS failures, timeouts and 5xx answers of the image
host through unchanged (so that its retry logic sees them), which the server
then answers with a 500. After vLLM's retries are spent, ``fetch_failure``
names what went wrong (refused, unresolvable host, no answer within
``VLLM_IMAGE_FETCH_TIMEOUT``, the host's HTTP status) and the connector raises
a 400 that names the URL; a body that is not an image (an HTML page) is a 400
naming the URL and what the bytes are.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import aiohttp
import requests
from PIL import Image
from vllm import envs
from vllm.exceptions import VLLMUnprocessableEntityError, VLLMValidationError
from vllm.multimodal.media.base import MediaIO, MediaWithBytes
from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.multimodal.media.image import ImageMediaIO

from vllm_hpu_mm.serving.errors import RequestRejected
from vllm_hpu_mm.serving.image_checks import read_header, to_rgb
from vllm_hpu_mm.serving.video_checks import CheckedVideoMediaIO

logger = logging.getLogger("vllm.hpu_mm.serving")

CONNECTOR_NAME = "hpu_mm"
_MAX_URL_CHARS = 200  # longer URLs are shortened in messages
_TIMEOUTS = (
    TimeoutError,
    asyncio.TimeoutError,
    requests.Timeout,
    aiohttp.ServerTimeoutError,
)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and its chain of causes (``raise ... from`` and implicit)."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def _http_status(exc: BaseException) -> int | None:
    if isinstance(exc, aiohttp.ClientResponseError):
        return exc.status
    if isinstance(exc, requests.HTTPError) and exc.response is not None:
        return exc.response.status_code
    return None


def fetch_failure(exc: BaseException, timeout_s: float | None) -> str | None:
    """Why fetching a media URL failed, in words for the client; None when
    ``exc`` is not a failure to fetch (a bug, a decoding error)."""
    chain = _causes(exc)
    for e in chain:
        if isinstance(e, socket.gaierror | aiohttp.ClientConnectorDNSError):
            return "its host name does not resolve (DNS lookup failed)"
    for e in chain:
        if isinstance(e, ConnectionRefusedError):
            return "the connection was refused (nothing listens on that port)"
        if isinstance(e, _TIMEOUTS):
            limit = f" within {timeout_s:g} s" if timeout_s is not None else ""
            return f"the host did not answer{limit} (VLLM_IMAGE_FETCH_TIMEOUT)"
        status = _http_status(e)
        if status is not None:
            return f"the host answered HTTP {status}"
    for e in chain:
        if isinstance(
            e, aiohttp.ClientConnectionError | requests.ConnectionError | OSError
        ):
            return f"the connection failed ({e.__class__.__name__}: {e})"
    return None


def _shown(url: str) -> str:
    if len(url) <= _MAX_URL_CHARS:
        return url
    return url[:_MAX_URL_CHARS] + "..."


def _is_http(url: str) -> bool:
    return url[:4].lower() == "http"


def _rejected_fetch(
    url: str, exc: BaseException, timeout_s: float | None
) -> RequestRejected | None:
    """The 400 for an http(s) URL whose fetch or body failed; None to re-raise."""
    if not _is_http(url):
        return None  # data: and file: URLs have their own messages
    if isinstance(exc, RequestRejected):  # a body that is not a usable image
        return RequestRejected(
            f"image URL {_shown(url)}: {exc.args[0]}", parameter="image_url"
        )
    if isinstance(exc, VLLMValidationError):
        return None  # vLLM's own 4xx (bad URL, size limit) names the problem
    if isinstance(exc, VLLMUnprocessableEntityError):  # the host answered 4xx
        status = _http_status(exc.__cause__) if exc.__cause__ else None
        if status is None:
            return None
    reason = fetch_failure(exc, timeout_s)
    if reason is None:
        return None
    return RequestRejected(
        f"image URL {_shown(url)} cannot be fetched: {reason}", parameter="image_url"
    )


class CheckedImageMediaIO(ImageMediaIO):
    """vLLM's image loader, with the header checked before any decoding.

    The pixel limit is vLLM's ``VLLM_MAX_IMAGE_PIXELS``, read per image as
    vLLM's own loader reads it."""

    # vLLM's ImageMediaIO returns MediaWithBytes where MediaIO says Image.
    def load_bytes(self, data: bytes) -> MediaWithBytes[Image.Image]:  # type: ignore[override]
        header = read_header(data, envs.VLLM_MAX_IMAGE_PIXELS)
        try:
            return super().load_bytes(data)
        except RequestRejected:
            raise
        except Exception as exc:  # whatever Pillow raises on a broken file
            cause = exc.__cause__ or exc
            raise RequestRejected(
                f"{header.format} image ({header.width}x{header.height}) cannot be "
                f"decoded: {cause}",
                parameter="image_url",
            ) from None

    def _convert_image_mode(
        self, image: Image.Image | MediaWithBytes[Image.Image]
    ) -> Image.Image:
        if isinstance(image, MediaWithBytes):
            image = image.media
        if self.image_mode != "RGB":
            return super()._convert_image_mode(image)
        return to_rgb(image, self.rgba_background_color)


class CheckedMediaConnector(MediaConnector):
    """vLLM's media connector with the plugin's image checks (vLLM builds one
    connector per request)."""

    def _image_io(self, image_mode: str | None = "RGB") -> ImageMediaIO:
        return CheckedImageMediaIO(
            **({"image_mode": image_mode} | self.media_io_kwargs.get("image", {})),
            decoded_budget=self.decoded_budget,
        )

    def _video_io(self, image_mode: str | None, video_processor: str | None) -> Any:
        """vLLM's ``fetch_video`` video loader, header-checked
        (``video_checks``)."""
        from vllm.multimodal.video import get_video_loader_backend_for_processor

        kwargs = dict(self.media_io_kwargs.get("video", {}))
        if "video_backend" not in kwargs and (
            backend := get_video_loader_backend_for_processor(video_processor)
        ):
            kwargs["video_backend"] = backend
        return CheckedVideoMediaIO(self._image_io(image_mode), **kwargs)

    def fetch_video(
        self,
        video_url: str,
        *,
        image_mode: str | None = "RGB",
        video_processor: str | None = None,
    ) -> Any:
        return self.load_from_url(
            video_url,
            self._video_io(image_mode, video_processor),
            fetch_timeout=envs.VLLM_VIDEO_FETCH_TIMEOUT,
        )

    async def fetch_video_async(
        self,
        video_url: str,
        *,
        image_mode: str | None = "RGB",
        video_processor: str | None = None,
    ) -> Any:
        return await self.load_from_url_async(
            video_url,
            self._video_io(image_mode, video_processor),
            fetch_timeout=envs.VLLM_VIDEO_FETCH_TIMEOUT,
        )

    def load_from_url(
        self, url: str, media_io: MediaIO[Any], *, fetch_timeout: int | None = None
    ) -> Any:
        try:
            return super().load_from_url(url, media_io, fetch_timeout=fetch_timeout)
        except Exception as exc:
            rejected = (
                _rejected_fetch(url, exc, fetch_timeout) if _is_http(url) else None
            )
            if rejected is None:
                raise
            raise rejected from exc

    async def load_from_url_async(
        self, url: str, media_io: MediaIO[Any], *, fetch_timeout: int | None = None
    ) -> Any:
        try:
            return await super().load_from_url_async(
                url, media_io, fetch_timeout=fetch_timeout
            )
        except Exception as exc:
            rejected = (
                _rejected_fetch(url, exc, fetch_timeout) if _is_http(url) else None
            )
            if rejected is None:
                raise
            raise rejected from exc

    def _load_data_url(self, url: str, media_io: MediaIO[Any]) -> Any:
        try:
            return super()._load_data_url(url, media_io)
        except NotImplementedError as exc:
            raise RequestRejected(
                f"data URL must be base64 ('data:<type>;base64,<data>'): {exc}",
                parameter="image_url",
            ) from None

    def _load_file_url(self, url_spec: Any, media_io: MediaIO[Any]) -> Any:
        if self.allowed_local_media_path is None:
            raise RequestRejected(
                "file:// media URLs are refused: the server was started without "
                "--allowed-local-media-path",
                parameter="image_url",
            )
        try:
            return super()._load_file_url(url_spec, media_io)
        except OSError as exc:
            raise RequestRejected(
                f"cannot read the file of the media URL: {exc.strerror}",
                parameter="image_url",
            ) from None


def register_connector() -> type[CheckedMediaConnector]:
    """Register ``"hpu_mm"`` in vLLM's media-connector registry (idempotent: the
    last registration wins) and return its class."""
    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)(CheckedMediaConnector)
    return CheckedMediaConnector
