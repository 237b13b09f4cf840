"""vLLM glue for the image checks: a media connector of vLLM's own registry.

vLLM decodes ``image_url`` parts in the API server through the media
connector named by ``VLLM_MEDIA_CONNECTOR`` (registry
``vllm.multimodal.media.connector.MEDIA_CONNECTOR_REGISTRY``, default
``"http"``). ``register_connector`` adds ``"hpu_mm"``: vLLM's connector with an
image loader that reads the header before decoding (``image_checks``) and
turns every decoding failure into a 400 that names it, plus 400s (not 500 or
501) for ``file://`` URLs on a server without ``--allowed-local-media-path``
and for data URLs that are not base64.
"""

from __future__ import annotations

import logging
from typing import Any

from PIL import Image
from vllm.multimodal.media.base import MediaIO, MediaWithBytes
from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.multimodal.media.image import ImageMediaIO

from vllm_hpu_mm.serving.errors import RequestRejected
from vllm_hpu_mm.serving.image_checks import read_header, to_rgb

logger = logging.getLogger("vllm.hpu_mm.serving")

CONNECTOR_NAME = "hpu_mm"


class CheckedImageMediaIO(ImageMediaIO):
    """vLLM's image loader, with the header checked before any decoding."""

    def __init__(self, *args: Any, max_pixels: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_pixels = max_pixels

    # vLLM's ImageMediaIO returns MediaWithBytes where MediaIO says Image.
    def load_bytes(self, data: bytes) -> MediaWithBytes[Image.Image]:  # type: ignore[override]
        header = read_header(data, self.max_pixels)
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
    """vLLM's media connector with the plugin's image checks.

    ``max_image_pixels`` is bound by ``register_connector`` (a subclass per
    configuration); vLLM builds one connector per request."""

    max_image_pixels: int = 4096 * 4096

    def _image_io(self, image_mode: str | None = "RGB") -> ImageMediaIO:
        return CheckedImageMediaIO(
            **({"image_mode": image_mode} | self.media_io_kwargs.get("image", {})),
            decoded_budget=self.decoded_budget,
            max_pixels=self.max_image_pixels,
        )

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


def register_connector(max_image_pixels: int) -> type[CheckedMediaConnector]:
    """Register ``"hpu_mm"`` in vLLM's media-connector registry with this limit
    (the last registration wins) and return its class."""
    cls = type(
        "CheckedMediaConnector",
        (CheckedMediaConnector,),
        {"max_image_pixels": max_image_pixels, "__module__": __name__},
    )
    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)(cls)
    return cls
