"""Fixtures shared by the unit tests of the Gaudi path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.fakes.habana import FakeHabana
from vllm_hpu_mm import device


@pytest.fixture
def habana(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHabana]:
    """The simulated Habana stack installed, the device module choosing HPU, and
    Dynamo's caches fresh on both sides (a graph compiled for the card must not
    serve another test's host tensors). A module that counts a kernel's calls
    defines its own ``habana``."""
    fake = FakeHabana().install(monkeypatch)
    device.select_device.cache_clear()
    assert device.device_kind() == "hpu"
    torch._dynamo.reset()
    yield fake
    torch._dynamo.reset()
    fake.uninstall()
