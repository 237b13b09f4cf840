"""Per-request checks of the API server (``validate_request``) and the media
connector's URL errors: each becomes a ``RequestRejected`` (a 400), never an
exception inside the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.multimodal.inputs import PlaceholderRange
from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY
from vllm.sampling_params import SamplingParams

from vllm_hpu_mm.platform_config import validate_sampling_params
from vllm_hpu_mm.serving import sample_images as s
from vllm_hpu_mm.serving.errors import RequestRejected
from vllm_hpu_mm.serving.media import CONNECTOR_NAME, register_connector
from vllm_hpu_mm.serving.request_checks import (
    RequestLimits,
    check_processed_request,
    stray_image_tokens,
)

IMG = 7
LIMITS = RequestLimits(image_token_ids=frozenset({IMG}))


def mm_input(ids: list[int], ranges: list[tuple[int, int]]) -> dict[str, object]:
    return {
        "type": "multimodal",
        "prompt_token_ids": ids,
        "mm_placeholders": {"image": [PlaceholderRange(o, n) for o, n in ranges]},
    }


def test_rejected_is_a_validation_error_and_a_value_error() -> None:
    err = RequestRejected("x", parameter="image_url")
    assert isinstance(err, VLLMValidationError) and isinstance(err, ValueError)


def test_image_tokens_filled_by_images_pass() -> None:
    check_processed_request(
        mm_input([1, IMG, IMG, 5, IMG, IMG], [(1, 2), (4, 2)]), LIMITS
    )
    check_processed_request({"type": "token", "prompt_token_ids": [1, 2]}, LIMITS)


def test_image_tokens_without_images_are_refused() -> None:
    inputs = {"type": "token", "prompt_token_ids": [1, IMG, 3, IMG]}
    with pytest.raises(RequestRejected, match=r"2 image token\(s\).*positions 1, 3"):
        check_processed_request(inputs, LIMITS)


def test_more_image_tokens_than_placeholders_are_refused() -> None:
    inputs = mm_input([IMG, 1, IMG, IMG, 2], [(2, 2)])
    with pytest.raises(
        RequestRejected, match=r"1 image token.*the request has 1 image"
    ):
        check_processed_request(inputs, LIMITS)


def test_stray_positions_and_text_models() -> None:
    ranges = {"image": [PlaceholderRange(0, 2)]}
    assert stray_image_tokens([IMG, IMG, IMG], ranges, frozenset({IMG})) == [2]
    assert stray_image_tokens([IMG], {}, frozenset()) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_p": 0.1},
        {"logit_bias": {5: 3.0}},
        {"min_tokens": 4},
        {"prompt_logprobs": 2},
    ],
)
def test_every_sampling_option_passes_validation(kwargs: dict[str, object]) -> None:
    # Served by the persistent batch and vLLM's logits processors.
    validate_sampling_params(SamplingParams(**kwargs))  # type: ignore[arg-type]


def test_pooling_is_a_validation_error() -> None:
    from vllm.pooling_params import PoolingParams

    with pytest.raises(RequestRejected, match="generation requests only"):
        validate_sampling_params(PoolingParams())


def connector() -> object:
    register_connector()
    return MEDIA_CONNECTOR_REGISTRY.load(CONNECTOR_NAME)


def test_connector_checks_data_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", str(64 * 64))  # vLLM's own limit
    conn = connector()
    ok = conn.fetch_image(s.data_url(s.encode(s.gradient_rgb(40, 24))))  # type: ignore[attr-defined]
    assert ok.size == (40, 24) and ok.mode == "RGB"
    with pytest.raises(RequestRejected, match="over the limit of 4096"):
        conn.fetch_image(s.data_url(s.png_with_header(65, 64)))  # type: ignore[attr-defined]


@pytest.mark.parametrize(("given", "limit"), [(None, "16777216"), ("100", "100")])
def test_install_sets_vllms_pixel_limit_unless_given(
    monkeypatch: pytest.MonkeyPatch, given: str | None, limit: str
) -> None:
    from vllm import envs

    from vllm_hpu_mm.serving import install

    monkeypatch.delenv("VLLM_MEDIA_CONNECTOR", raising=False)
    monkeypatch.delenv("VLLM_MAX_IMAGE_PIXELS", raising=False)
    if given is not None:
        monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", given)
    install(SimpleNamespace(), SimpleNamespace())
    assert int(limit) == envs.VLLM_MAX_IMAGE_PIXELS  # what vLLM's loaders read
    assert CONNECTOR_NAME == envs.VLLM_MEDIA_CONNECTOR


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png,rawbytes", "must be base64"),
        ("file:///etc/hostname", "--allowed-local-media-path"),
    ],
    ids=["not-base64", "file-url"],
)
def test_connector_url_errors_are_400s(url: str, words: str) -> None:
    with pytest.raises(RequestRejected, match=words):
        connector().fetch_image(url)  # type: ignore[attr-defined]
