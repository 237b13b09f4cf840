"""Gaudi warmup settings in ``vllm_hpu_mm.device``: the bridge's compile-only
mode around warmup (``compile_only_mode``) and the graph compiler's
environment (``gaudi_compile_env``), through ``tests.fakes.habana``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.fakes.habana import (
    COMPILE_ONLY_SETTING,
    HABANA_NAMES,
    CompileOnlyRead,
    FakeBridgeConfig,
    FakeHabana,
)
from vllm_hpu_mm import device
from vllm_hpu_mm.device import DEVICE_ENV


@pytest.fixture
def gaudi(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHabana]:
    monkeypatch.setenv(DEVICE_ENV, "hpu")
    device.select_device.cache_clear()
    fake = FakeHabana().install(monkeypatch)
    yield fake
    fake.uninstall()
    device.select_device.cache_clear()


def test_warmup_runs_in_compile_only_mode_on_gaudi(gaudi: FakeHabana) -> None:
    with device.compile_only_mode() as on:
        assert on and gaudi.bridge.settings[COMPILE_ONLY_SETTING] is True
        with pytest.raises(CompileOnlyRead):  # values are not computed
            torch.ones(1).item()
    assert gaudi.bridge.settings[COMPILE_ONLY_SETTING] is None


def test_an_older_bridge_falls_back_to_running_warmup(gaudi: FakeHabana) -> None:
    gaudi.bridge.known = ()  # env_setting raises KeyError for the unknown name
    with device.compile_only_mode() as on:
        assert not on
        assert torch.ones(1).item() == 1.0
    assert gaudi.bridge.entered == 0


def test_compile_only_mode_is_a_no_op_off_gaudi(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    device.select_device.cache_clear()
    for name in HABANA_NAMES:  # importing the bridge would fail the test
        monkeypatch.setitem(sys.modules, name, None)
    try:
        with device.compile_only_mode() as on:
            assert not on and torch.ones(1).item() == 1.0
    finally:
        device.select_device.cache_clear()


def test_recipe_cache_follows_the_configured_directory() -> None:
    env = device.gaudi_compile_env({}, "~/cc")
    home = os.path.expanduser("~")
    assert env == {
        "PT_HPU_RECIPE_CACHE_CONFIG": f"{home}/cc/hpu-recipes,False,8192",
        "FUSER_ENABLE_MULTI_THREADED_INVOCATIONS": "1",
    }


def test_the_operators_settings_are_kept() -> None:
    given = {
        "PT_HPU_RECIPE_CACHE_CONFIG": "/local/recipes,false,4096",
        "FUSER_ENABLE_MULTI_THREADED_INVOCATIONS": "0",
    }
    assert device.gaudi_compile_env(given, "/cache") == {}
    # no configured directory: no recipe cache is invented
    assert device.gaudi_compile_env({}, None) == {
        "FUSER_ENABLE_MULTI_THREADED_INVOCATIONS": "1"
    }


def test_the_fake_bridge_knows_only_its_settings() -> None:
    setting = FakeBridgeConfig().env_setting("PT_NO_SUCH_SETTING", True)
    with pytest.raises(KeyError), setting:
        pass


@pytest.mark.parametrize("device_type", ["hpu", "cpu"])
def test_the_platform_sets_them_before_the_engine_processes_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device_type: str
) -> None:
    from vllm_hpu_mm.platform_config import _set_gaudi_compile_env

    for key in (
        "PT_HPU_RECIPE_CACHE_CONFIG",
        "FUSER_ENABLE_MULTI_THREADED_INVOCATIONS",
    ):
        monkeypatch.delenv(key, raising=False)
    plugin = SimpleNamespace(warmup=SimpleNamespace(compile_cache_dir=str(tmp_path)))
    _set_gaudi_compile_env(plugin, device_type)
    recipes = os.environ.get("PT_HPU_RECIPE_CACHE_CONFIG")
    if device_type == "hpu":
        assert recipes == f"{tmp_path}/hpu-recipes,False,8192"
    else:
        assert recipes is None
