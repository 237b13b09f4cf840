"""Request checks in the API server: bad input becomes a 4xx, never an engine error.

``install(plugin_config, vllm_config)`` runs from the platform's
``check_and_update_config`` (so in the API server, before any request):

1. registers vLLM media connector ``"hpu_mm"`` (``media.py``) with the pixel
   limit ``hpu_mm.mm_max_image_pixels`` and makes it vLLM's choice unless the
   operator set ``VLLM_MEDIA_CONNECTOR`` to another;
2. records the model facts the per-request checks need (``RequestLimits``);
3. applies the serving path's patches (``patches.SERVING_PATCHES``: a refused
   request's images leave vLLM's front-end cache).

``check_request`` is called by the platform's ``validate_request``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_hpu_mm.serving.request_checks import RequestLimits, check_processed_request

logger = logging.getLogger("vllm.hpu_mm.serving")

_MEDIA_CONNECTOR_ENV = "VLLM_MEDIA_CONNECTOR"

# Set once per process by install() at start-up (frozen), read by check_request.
_limits = RequestLimits()


def install(plugin_config: Any, vllm_config: Any) -> None:
    """Turn on the plugin's request checks in this process (idempotent)."""
    global _limits
    from vllm_hpu_mm.serving.media import CONNECTOR_NAME, register_connector

    register_connector(plugin_config.mm_max_image_pixels)
    chosen = os.environ.setdefault(_MEDIA_CONNECTOR_ENV, CONNECTOR_NAME)
    if chosen != CONNECTOR_NAME:
        logger.warning(
            "%s=%s: the plugin's image checks (pixel limit before decoding, "
            "16-bit conversion) are off; unset it or set it to %r",
            _MEDIA_CONNECTOR_ENV,
            chosen,
            CONNECTOR_NAME,
        )
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    _limits = RequestLimits.from_hf_config(hf_config)
    from vllm_hpu_mm.patches import apply_serving_patches

    apply_serving_patches()


def check_request(processed_inputs: Any) -> None:
    """Raise ``RequestRejected`` (a 400) for a request the engine must not get."""
    check_processed_request(processed_inputs, _limits)


__all__ = ["RequestLimits", "check_request", "install"]
