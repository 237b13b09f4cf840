"""Request checks in the API server: bad input becomes a 4xx, never an engine error.

``install(plugin_config, vllm_config)`` runs from the platform's
``check_and_update_config`` (so in the API server, before any request):

1. registers vLLM media connector ``"hpu_mm"`` (``media.py``) and makes it
   vLLM's choice unless the operator set ``VLLM_MEDIA_CONNECTOR`` to another;
2. sets vLLM's pixel limit ``VLLM_MAX_IMAGE_PIXELS`` to 4096 x 4096 unless the
   operator set it: vLLM's default (178,956,970, Pillow's own refusal point)
   lets a ~100-byte PNG that claims 12000 x 12000 pixels reach the decoder
   (within vLLM's decode budget of 715 MB a request), which allocates the
   image before finding its data missing;
3. records the model facts the per-request checks need (``RequestLimits``);
4. applies the serving path's patches (``patches.SERVING_PATCHES``: a refused
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
_MAX_PIXELS_ENV = "VLLM_MAX_IMAGE_PIXELS"  # read by vllm.envs at each image
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096

# Set once per process by install() at start-up (frozen), read by check_request.
_limits = RequestLimits()


def install(plugin_config: Any, vllm_config: Any) -> None:
    """Turn on the plugin's request checks in this process (idempotent)."""
    global _limits
    from vllm_hpu_mm.serving.media import CONNECTOR_NAME, register_connector

    register_connector()
    max_pixels = os.environ.setdefault(_MAX_PIXELS_ENV, str(DEFAULT_MAX_IMAGE_PIXELS))
    logger.info("Images over %s pixels are refused (%s)", max_pixels, _MAX_PIXELS_ENV)
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
